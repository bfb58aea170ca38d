"""The CPU linear kernel (treespec/linear_kernels.py): oneDNN's forward agrees with F.linear, steps aside for
gradients and other dtypes, is what the loader applies (and switches off), and keeps greedy decoding equal to
transformers' on every family of the architecture matrix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec.heads import DraftModel
from treespec.linear_kernels import AUTO_MIN_WEIGHTS, linear_kernel_of, onednn_available, use_linear_kernel
from treespec.reference import load
from treespec.train.checks.architectures import FAMILIES, TREES, build, draft_of, expect_greedy, prompt

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(3,), (2, 5), (2, 3, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_forward_agrees_with_f_linear(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    assert use_linear_kernel(layer, "onednn") == 1 and linear_kernel_of(layer) == "onednn"
    with torch.no_grad():
        got = layer(x)
        strided = layer(torch.randn(24, *shape).movedim(0, -1))  # a non-contiguous input
    assert got.shape == expected.shape and strided.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


@needs_onednn
def test_gradients_and_other_dtypes_take_f_linear():
    torch.manual_seed(0)
    plain, fast = nn.Linear(8, 6), nn.Linear(8, 6)
    fast.load_state_dict(plain.state_dict())
    use_linear_kernel(fast, "onednn")
    x = torch.randn(4, 8)
    plain(x).square().sum().backward()
    fast(x).square().sum().backward()  # under autograd: F.linear itself, so the gradients are the same bits
    assert torch.equal(plain.weight.grad, fast.weight.grad) and torch.equal(plain.bias.grad, fast.bias.grad)
    half = nn.Linear(8, 6).to(torch.bfloat16)
    use_linear_kernel(half, "onednn")
    xb = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(half(xb), F.linear(xb, half.weight, half.bias))


def test_the_loader_applies_the_kernel_and_torch_switches_it_off():
    model, _ = load("target")
    assert linear_kernel_of(model) == ("onednn" if onednn_available() else "torch")
    assert use_linear_kernel(model, "torch") == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert linear_kernel_of(model) == "torch"
    assert linear_kernel_of(load("target", linear_kernel="torch")[0]) == "torch"


@needs_onednn
def test_auto_keeps_torch_below_the_size_where_onednn_pays():
    """A tiny model's layers keep F.linear under "auto" (oneDNN's per-call cost is most of their time); a layer
    at the threshold and "onednn" asked for by name take oneDNN."""
    small, large = nn.Linear(16, 64), nn.Linear(256, AUTO_MIN_WEIGHTS // 256)
    model = nn.Sequential(small, large)
    assert use_linear_kernel(model, "auto") == 2
    assert (linear_kernel_of(small), linear_kernel_of(large), linear_kernel_of(model)) == ("torch", "onednn", "mixed")
    use_linear_kernel(model, "onednn")
    assert linear_kernel_of(model) == "onednn"


def test_an_unknown_kernel_is_refused_before_loading():
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        load("target", linear_kernel="mkl")
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        use_linear_kernel(nn.Linear(2, 2), "fast")
    with pytest.raises(TypeError, match="sets a torch module's linear layers, got NoneType"):
        use_linear_kernel(None, "torch")
    with pytest.raises(ValueError, match=r"attn_implementation must be a name .* got 5"):  # an AttributeError
        load("target", attn_implementation=5)


@needs_onednn
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_greedy_stays_equal_to_transformers_on_the_onednn_kernel(name):
    target = build(name)
    assert use_linear_kernel(target, "onednn") > 0
    tree = TREES[next(iter(TREES))]
    expect_greedy(target, prompt(), DraftModel(draft_of(name)), tree)  # transformers' greedy on the same model
