"""The CPU linear kernels (treespec/linear_kernels.py): oneDNN's, the few-row kernel's and the native kernel's forwards
agree with F.linear at every row count (the few-row kernel's two paths, the native kernel's passes of up to six rows
and what it hands on: more than 16 rows, widths not a multiple of 8; the reordered weight made again when the weight
changes), step aside for gradients and other dtypes, are what the loader applies (and switches off), and keep greedy
decoding equal to transformers' on every family of the architecture matrix."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec import linear_kernels, native_linear
from treespec.heads import DraftModel, registry
from treespec.linear_kernels import (
    AUTO_MIN_WEIGHTS,
    linear_kernel_of,
    onednn_available,
    path_changes,
    use_linear_kernel,
)
from treespec.planning import autotree
from treespec.reference import load
from treespec.train.checks.architectures import FAMILIES, TREES, build, draft_of, expect_greedy, prompt

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
needs_native = pytest.mark.skipif(not (onednn_available() and native_linear.available()),
                                  reason=f"no native kernel here: {native_linear.why_unavailable()}")
needs_packed = pytest.mark.skipif(not (onednn_available() and native_linear.packed_available()),
                                  reason="no packed kernel here (AVX-512 and a C compiler)")
KERNELS = ["onednn", "fewrow", pytest.param("native", marks=needs_native), pytest.param("packed", marks=needs_packed)]
# what "auto" gives a large layer here
AUTO = linear_kernels.auto_kernel() if onednn_available() else "torch"


@needs_onednn
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(3,), (1,), (2, 1), (1, 2), (2, 5), (2, 3, 4), (1, 16), (2, 9)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_agrees_with_f_linear(kernel, shape, bias):
    """Rows 1 and 2 take the few-row kernel's MKL path, 3 and more its reordered oneDNN one; the native kernel takes
    up to 16 rows in passes of six (1, 2, 5, 6 + 6 + 4) and hands 18 to the few-row kernel."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(*shape, 24)
    expected = F.linear(x, layer.weight, layer.bias)
    assert use_linear_kernel(layer, kernel) == 1 and linear_kernel_of(layer) == kernel
    with torch.no_grad():
        got = layer(x)
        strided = layer(torch.randn(24, *shape).movedim(0, -1))  # a non-contiguous input
    assert got.shape == expected.shape and strided.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()  # a transposed output fed to the next layer once took MKL's slow path
    assert not torch.equal(got, torch.zeros_like(got))


@needs_native
@pytest.mark.parametrize("width", [20, 13])
def test_the_native_kernel_hands_on_widths_it_does_not_take(width):
    """Input widths that are not a multiple of 8 go to the few-row kernel, with the same result as F.linear."""
    torch.manual_seed(0)
    layer = nn.Linear(width, 33)
    x = torch.randn(3, width)
    assert not native_linear.takes(x, layer.weight, layer.bias)
    # a large weight's products of more than LARGE_ROWS rows go on too (the few-row kernel was faster there)
    large = torch.empty(native_linear.LARGE_WEIGHTS // 64, 64)
    rows = native_linear.LARGE_ROWS
    assert native_linear.takes(torch.randn(rows, 64), large)
    assert not native_linear.takes(torch.randn(rows + 1, 64), large)
    use_linear_kernel(layer, "native")
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_native_refused_by_name_where_it_cannot_build(monkeypatch):
    """Asked for by name where it cannot be built, "native" is an error that says why; "auto" takes the few-row
    kernel."""
    monkeypatch.setattr(native_linear, "_state", {"why": "no C compiler found ($CC, gcc or cc)"})
    layer = nn.Linear(256, AUTO_MIN_WEIGHTS // 256)
    with pytest.raises(ValueError, match=r"linear_kernel='native' is not available here: no C compiler found"):
        use_linear_kernel(layer, "native")
    use_linear_kernel(layer, "auto")
    assert linear_kernel_of(layer) == "fewrow"
    with pytest.raises(RuntimeError, match="the native kernel is not available: no C compiler"):
        native_linear.linear(torch.randn(1, 256), layer.weight)


@needs_onednn
@pytest.mark.parametrize("kernel", ["fewrow", pytest.param("packed", marks=needs_packed)])
def test_the_held_weight_copy_follows_the_weight(kernel):
    """The few-row kernel's reordered copy (the packed kernel's packed one) is made again after the weight changes in
    place (load_state_dict) or is replaced: never a stale product; the layer deep-copies (an opaque oneDNN tensor
    would not)."""
    torch.manual_seed(0)
    layer, other = nn.Linear(24, 40), nn.Linear(24, 40)
    use_linear_kernel(layer, kernel)
    x = torch.randn(5, 24)
    with torch.no_grad():
        layer(x)
        twin = copy.deepcopy(layer)  # the reordered copy is held beside the layer: a deep copy makes its own
        torch.testing.assert_close(twin(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), F.linear(x, other.weight, other.bias), rtol=1e-5, atol=1e-5)
        layer.weight = nn.Parameter(torch.randn(40, 24))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_and_other_dtypes_take_f_linear(kernel):
    torch.manual_seed(0)
    plain, fast = nn.Linear(8, 6), nn.Linear(8, 6)
    fast.load_state_dict(plain.state_dict())
    use_linear_kernel(fast, kernel)
    x = torch.randn(4, 8)
    plain(x).square().sum().backward()
    fast(x).square().sum().backward()  # under autograd: F.linear itself, so the gradients are the same bits
    assert torch.equal(plain.weight.grad, fast.weight.grad) and torch.equal(plain.bias.grad, fast.bias.grad)
    half = nn.Linear(8, 6).to(torch.bfloat16)
    use_linear_kernel(half, kernel)
    xb = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(half(xb), F.linear(xb, half.weight, half.bias))


def test_the_loader_applies_the_kernel_and_torch_switches_it_off():
    model, _ = load("target")
    assert linear_kernel_of(model) == AUTO
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
    assert (linear_kernel_of(small), linear_kernel_of(large), linear_kernel_of(model)) == ("torch", AUTO, "mixed")
    use_linear_kernel(model, "onednn")
    assert linear_kernel_of(model) == "onednn"


@needs_native
def test_auto_keeps_a_vocabulary_sized_layer_off_the_native_kernel(monkeypatch):
    """Above ``AUTO_NATIVE_MAX_WEIGHTS`` (SmolLM2's head: MKL and oneDNN stream it faster) "auto" takes the few-row
    kernel; "native" by name takes every layer (the packed kernel, where there is one, takes both)."""
    monkeypatch.setattr(linear_kernels, "AUTO_NATIVE_MAX_WEIGHTS", AUTO_MIN_WEIGHTS)
    monkeypatch.setattr(native_linear, "packed_available", lambda: False)
    layer, head = nn.Linear(256, AUTO_MIN_WEIGHTS // 256), nn.Linear(256, 2 * AUTO_MIN_WEIGHTS // 256)
    model = nn.Sequential(layer, head)
    use_linear_kernel(model, "auto")
    assert (linear_kernel_of(layer), linear_kernel_of(head)) == ("native", "fewrow")
    use_linear_kernel(model, "native")
    assert linear_kernel_of(model) == "native"


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
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_greedy_stays_equal_to_transformers_on_the_cpu_kernels(name, kernel):
    target = build(name)
    assert use_linear_kernel(target, kernel) > 0
    tree = TREES[next(iter(TREES))]
    try:
        expect_greedy(target, prompt(), DraftModel(draft_of(name)), tree)  # transformers' greedy on the same model
    finally:
        use_linear_kernel(target, "torch")  # build() may hand the same model to other tests


def test_drafters_follow_the_target_kernel():
    """A drafter loaded for a target runs the target's kernel (a draft depth is the same few-row products), and
    stays on torch's beside a target that does."""
    target, _ = load("target")
    assert linear_kernel_of(registry.load_module("eagle3", target, "reference:eagle3")) == AUTO
    assert linear_kernel_of(registry.load("reference:eagle3", target).model) == AUTO
    plain, _ = load("target", linear_kernel="torch")
    assert linear_kernel_of(registry.load_module("eagle3", plain, "reference:eagle3")) == "torch"


@needs_native
def test_cost_curves_measure_both_sides_of_a_path_change(monkeypatch):
    """A pass's cost can jump where a kernel changes path (after 16 rows natively): the curve at B rows measures the
    sizes on both sides of it rather than interpolating across."""
    layer = nn.Linear(64, 64)
    assert path_changes(nn.Sequential(nn.Linear(64, 64))) == set()  # torch's kernel never changes path
    use_linear_kernel(layer, "native")
    assert path_changes(layer) == {native_linear.MAX_ROWS}
    use_linear_kernel(layer, "fewrow")
    assert path_changes(layer) == {linear_kernels.MKL_ROWS}
    timed = []
    monkeypatch.setattr(autotree, "cost_curve_rounds", lambda model, sizes, *a: timed.append(sizes) or
                        {n: [1e-3] * 3 for n in sizes})
    monkeypatch.setattr(autotree, "path_changes", lambda model: {16})
    assert sorted(autotree.measure_cost_curve(layer, (1, 2, 4, 8), batch=4)) == [1, 2, 4, 5, 8]
    assert sorted(autotree.measure_cost_curve(layer, (1, 2, 4, 8, 16, 32), batch=1)) == [1, 2, 4, 8, 16, 17, 32]
