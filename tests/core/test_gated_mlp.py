"""A gated MLP fused on the packed kernel (``linear_kernels._gated_mlp_forward`` through
``native_linear.packed_gated``: gate and up products and the SiLU in one call): it agrees with the MLP's own forward
at every row count (groups of 16, partial panels), is installed only on bias-free SiLU MLPs whose products run the
packed kernel and removed with it, and hands gradients and other dtypes to the module's own forward. Greedy equality
with transformers on the architecture matrix runs through it in tests/core/test_linear_kernels.py (its SiLU families
on "packed")."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import ACT2FN

from treespec import native_linear
from treespec.linear_kernels import fusable_mlp, onednn_available, use_linear_kernel

pytestmark = pytest.mark.skipif(not (onednn_available() and native_linear.packed_available()),
                                reason="no packed kernel here (AVX-512 and a C compiler)")


class GatedMLP(nn.Module):
    """Llama's MLP, as transformers writes it."""

    def __init__(self, width: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=bias)
        self.up_proj = nn.Linear(width, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, width, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def fused(module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is not None and fusable_mlp(module)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize(("width", "hidden"), [(64, 160), (24, 40), (576, 1536)])
def test_the_fused_mlp_agrees_with_its_own_forward(rows, width, hidden):
    torch.manual_seed(rows + width)
    mlp = GatedMLP(width, hidden)
    x = torch.randn(1, rows, width) * 2
    with torch.no_grad():
        want = mlp(x)
        use_linear_kernel(mlp, "packed")
        assert fused(mlp)
        got = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_it_is_installed_only_where_it_fuses_and_removed_with_the_kernel():
    assert not fused(use_and_return(GatedMLP(32, 48, act="gelu_pytorch_tanh")))  # another activation
    assert not fused(use_and_return(GatedMLP(32, 48, bias=True)))  # biases
    mlp = use_and_return(GatedMLP(32, 48))
    assert fused(mlp)
    for kernel in ("native", "fewrow", "torch"):
        use_linear_kernel(mlp, kernel)
        assert "forward" not in mlp.__dict__  # the class's forward again, on that kernel's linear layers
    use_linear_kernel(mlp, "packed")
    assert fused(mlp)


def use_and_return(mlp):
    use_linear_kernel(mlp, "packed")
    return mlp


def test_gradients_and_other_dtypes_take_the_modules_own_forward():
    mlp = use_and_return(GatedMLP(32, 48))
    x = torch.randn(2, 32, requires_grad=True)
    mlp(x).sum().backward()  # the packed kernel has no backward: the module's own forward carried it
    assert x.grad is not None and mlp.gate_proj.weight.grad is not None
    with torch.no_grad():
        half = mlp.to(torch.bfloat16)(torch.randn(2, 32, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16
