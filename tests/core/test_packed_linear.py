"""The packed linear kernel (treespec/packed_linear.c through treespec/native_linear.py and the "packed" CPU kernel of
treespec/linear_kernels.py): it agrees with F.linear at every row count, width and output size (panels of 16 with a
partial last one, groups of 16 rows), gives a row the same bits whatever rows are beside it, holds one packed copy
and never oneDNN's reordered one, is what "auto" takes where it builds, and is refused by name, with the reason,
where it does not. Greedy equality on the architecture matrix, the copy following the weight, and the gradient and
dtype hand-offs run it in tests/core/test_linear_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec import linear_kernels, native_linear
from treespec.linear_kernels import linear_kernel_of, onednn_available, path_changes, use_linear_kernel

needs_packed = pytest.mark.skipif(not (onednn_available() and native_linear.packed_available()),
                                  reason="no packed kernel here (AVX-512 and a C compiler)")


@needs_packed
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 17, 40])
@pytest.mark.parametrize(("width", "out"), [(24, 40), (13, 7), (576, 49), (8, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_agrees_with_f_linear(rows, width, out, bias):
    torch.manual_seed(rows * 1000 + width + out)
    layer = nn.Linear(width, out, bias=bias)
    x = torch.randn(rows, width)
    use_linear_kernel(layer, "packed")
    assert linear_kernel_of(layer) == "packed"
    with torch.no_grad():
        got = layer(x)
        folded = layer(x.reshape(1, rows, width))  # [b, n, in] as a model calls it
        strided = layer(torch.randn(width, rows).T)  # a non-contiguous input
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(folded, got[None]) and strided.shape == got.shape and got.is_contiguous()


@needs_packed
def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it():
    """What makes a tree pass's logits for a node the bits a one-token pass would give (the walker's greedy check
    compares them with vanilla decoding): one FMA chain per output, in the same order for every group."""
    torch.manual_seed(0)
    weight = torch.randn(100, 96)
    packed = native_linear.pack(weight)
    x = torch.randn(37, 96)
    together = native_linear.packed_linear(x, packed, 100)
    for row in (0, 5, 15, 16, 31, 36):
        alone = native_linear.packed_linear(x[row:row + 1], packed, 100)
        assert torch.equal(alone[0], together[row])
        assert torch.equal(native_linear.packed_linear(x[row:row + 3], packed, 100)[0], together[row])
    assert native_linear.packed_linear(x[:0], packed, 100).shape == (0, 100)


@needs_packed
def test_the_packed_layer_holds_one_packed_copy_and_no_reordered_one():
    """(That the copy follows the weight: tests/core/test_linear_kernels.py.)"""
    layer = nn.Linear(24, 40)
    use_linear_kernel(layer, "packed")
    with torch.no_grad():
        layer(torch.randn(5, 24))
    assert layer in linear_kernels._PACKED and layer not in linear_kernels._REORDERED
    assert linear_kernels._PACKED[layer][2].shape == (3, 24, 16)  # ⌈40 / 16⌉ panels, zero past row 40
    use_linear_kernel(layer, "torch")
    assert layer not in linear_kernels._PACKED  # switched off: its memory goes


@needs_packed
def test_auto_takes_packed_for_every_large_layer_and_marks_its_group_boundary():
    layer = nn.Linear(256, linear_kernels.AUTO_NATIVE_MAX_WEIGHTS // 256 + 16)  # vocabulary-sized: packed too
    small = nn.Linear(16, 16)
    model = nn.Sequential(layer, small)
    use_linear_kernel(model, "auto")
    assert (linear_kernel_of(layer), linear_kernel_of(small)) == ("packed", "torch")
    assert path_changes(model) == {native_linear.PANEL}


@needs_packed
def test_a_shared_projection_uses_the_copy_its_layer_holds():
    """A drafter's vocabulary projection on a target's head (heads/drafting/lean.py) reads the layer's packed copy,
    not a second, reordered one; a layer that already holds a reordered copy keeps using it."""
    torch.manual_seed(0)
    head, other = nn.Linear(64, 300, bias=False), nn.Linear(64, 300, bias=False)
    x = torch.randn(3, 64)
    with torch.no_grad():
        got = linear_kernels.few_row_linear(head, x)
        use_linear_kernel(other, "fewrow")
        other(torch.randn(4, 64))  # makes its reordered copy
        linear_kernels.few_row_linear(other, x)
    assert head in linear_kernels._PACKED and head not in linear_kernels._REORDERED
    assert other in linear_kernels._REORDERED and other not in linear_kernels._PACKED
    torch.testing.assert_close(got, x @ head.weight.T, rtol=1e-5, atol=1e-5)


def test_packed_refused_by_name_where_it_cannot_build(monkeypatch):
    layer = nn.Linear(256, 256)
    monkeypatch.setattr(native_linear, "packed_available", lambda: False)
    monkeypatch.setattr(native_linear, "_state", {"why": "no C compiler found ($CC, gcc or cc)"})
    if onednn_available():
        with pytest.raises(ValueError, match=r"linear_kernel='packed' is not available here: no C compiler found"):
            use_linear_kernel(layer, "packed")
        use_linear_kernel(layer, "auto")  # "auto" silently takes what builds
        assert linear_kernel_of(layer) in ("native", "fewrow")
    with pytest.raises(RuntimeError, match="the packed kernel is not available: no C compiler"):
        native_linear.packed_linear(torch.randn(1, 256), torch.zeros(16, 256, 16), 256)
