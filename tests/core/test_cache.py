"""The preallocated KV cache (treespec/cache.py, ``PreallocatedLayer``): the same logits and the same held
entries as transformers' concatenating DynamicLayer through a prefill, tree passes compacted to a non-contiguous
accepted path, crops, growth past the buffer's capacity and a reset; and generate() decodes the same tokens.
A batch's rows (treespec/rows.py): per-row compaction equals each row's alone, row selection, slots' validity,
positions and masks."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from treespec import Tree, generate
from treespec.cache import PreallocatedLayer, TreeCache, keep_row_paths, keep_tree_path, select_rows
from treespec.compat import cache_arg
from treespec.heads import DraftModel
from treespec.rows import RowSlots
from treespec.visibility import slots_mask, tree_masks, tree_position_ids

from tests.helpers import hf_greedy, perturbed, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def steps(target, cache, gen):
    """A prefill, then tree passes kept to a non-contiguous path, a chain pass and a crop: the logits of each."""
    tree = Tree.full(2, 2)  # nodes 1, 2 (depth 1), 3..6 (depth 2)
    out = [target(input_ids=torch.randint(0, 64, (1, 5), generator=gen), **cache_arg(cache), use_cache=True).logits]
    past = 5
    for keep in ([0, 2, 5], [0, 1, 4], [0]):
        tokens = torch.randint(0, 64, (1, tree.num_nodes), generator=gen)
        out.append(target(input_ids=tokens, **cache_arg(cache), use_cache=True,
                          attention_mask=tree_masks(cache, tree, past, dtype=target.dtype),
                          position_ids=tree_position_ids(tree, past)).logits)
        keep_tree_path(cache, past, torch.tensor(keep))
        past += len(keep)
    out.append(target(input_ids=torch.randint(0, 64, (1, 3), generator=gen), **cache_arg(cache), use_cache=True).logits)
    cache.crop(-2)
    out.append(target(input_ids=torch.randint(0, 64, (1, 1), generator=gen), **cache_arg(cache), use_cache=True).logits)
    return out


def test_preallocated_cache_equals_concatenating_cache(target, monkeypatch):
    monkeypatch.setattr(PreallocatedLayer, "MIN_CAPACITY", 4)  # grows several times on the way
    caches = {p: TreeCache(target.config, preallocate=p) for p in (False, True)}
    assert all(isinstance(layer, PreallocatedLayer) for layer in caches[True].layers)
    assert not any(isinstance(layer, PreallocatedLayer) for layer in caches[False].layers)
    with torch.no_grad():
        outs = {p: steps(target, cache, torch.Generator().manual_seed(0)) for p, cache in caches.items()}
    for a, b in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for plain, pre in zip(caches[False].layers, caches[True].layers, strict=True):
        assert pre.keys.shape == plain.keys.shape == (1, 2, 5 + 3 + 3 + 1 + 3 - 2 + 1, 16)
        torch.testing.assert_close(pre.keys, plain.keys, rtol=0, atol=0)
        torch.testing.assert_close(pre.values, plain.values, rtol=0, atol=0)
        assert pre.keys.data_ptr() == pre._buffers[0].data_ptr()  # a view of its buffer, not a copy
    caches[True].reset()
    assert caches[True].get_seq_length() == 0
    with torch.no_grad():
        again = steps(target, caches[True], torch.Generator().manual_seed(0))
    torch.testing.assert_close(again[-1], outs[True][-1], rtol=0, atol=0)


def test_a_layer_whose_keys_were_replaced_is_copied_not_overwritten(target):
    cache = TreeCache(target.config)
    with torch.no_grad():
        target(input_ids=torch.arange(6)[None], **cache_arg(cache), use_cache=True)
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # e.g. a batch op replaced them
        held = layer.keys.clone()
        target(input_ids=torch.arange(2)[None], **cache_arg(cache), use_cache=True)
    torch.testing.assert_close(layer.keys[:, :, :6], held, rtol=0, atol=0)
    assert layer.keys.shape[2] == 8 and layer.keys.data_ptr() == layer._buffers[0].data_ptr()


def test_generate_with_the_preallocated_cache_equals_transformers(target):
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    for drafter, tree in ((None, None), (DraftModel(perturbed(target, 0.3)), Tree.full(2, 3))):
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=40)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 40))


def test_values_with_their_own_head_size_get_their_own_buffer():
    layer = PreallocatedLayer()
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 2, 6, 3, generator=gen)
    layer.update(keys, values)
    assert layer._kv is None and layer.values.shape == (1, 2, 6, 3)
    cache = DynamicCache()
    cache.layers = [layer]
    keep_tree_path(cache, 2, [0, 2, 3])  # rows 2, 4, 5 move to 2, 3, 4: one by one, not through _kv
    torch.testing.assert_close(layer.keys, torch.cat([keys[:, :, :3], keys[:, :, 4:6]], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(layer.values, torch.cat([values[:, :, :3], values[:, :, 4:6]], dim=2), rtol=0, atol=0)
    same = PreallocatedLayer()
    same.update(keys, keys + 1)
    assert same._kv is not None and same._kv.shape == (2, 1, 2, PreallocatedLayer.MIN_CAPACITY, 4)


@pytest.mark.parametrize("preallocate", [True, False])
def test_per_row_compaction_and_row_selection(preallocate):
    """keep_row_paths: each row's entries equal keep_tree_path on that row alone (one gather for all rows, holes
    after a shorter row's path); select_rows keeps the chosen rows, in buffers that still grow."""
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 9, 4, generator=gen), torch.randn(3, 2, 9, 4, generator=gen)

    def cache_of(k, v):
        cache = DynamicCache()
        cache.layers = [PreallocatedLayer() if preallocate else DynamicLayer()]
        cache.layers[0].update(k.clone(), v.clone())
        return cache

    keeps = [[0, 2, 5], [0], [0, 1, 3, 4]]  # rows keep different paths after a pass at slots 3..8
    batch = cache_of(keys, values)
    assert keep_row_paths(batch, 3, keeps) == 4
    layer = batch.layers[0]
    assert layer.keys.shape == (3, 2, 7, 4)
    for b, keep in enumerate(keeps):
        alone = cache_of(keys[b : b + 1], values[b : b + 1])
        keep_tree_path(alone, 3, keep)
        n = 3 + len(keep)
        torch.testing.assert_close(layer.keys[b : b + 1, :, :n], alone.layers[0].keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.values[b : b + 1, :, :n], alone.layers[0].values, rtol=0, atol=0)
    kept = layer.keys[[2, 0]].clone()
    select_rows(batch, torch.tensor([2, 0]))
    torch.testing.assert_close(layer.keys, kept, rtol=0, atol=0)
    layer.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))  # the selected rows keep growing
    assert layer.keys.shape == (2, 2, 8, 4) and bool((layer.keys[:, :, -1] == 1).all())
    chains = cache_of(keys, values)  # rows keeping chain prefixes move nothing: only the tail is cut
    assert keep_row_paths(chains, 3, [[0, 1], [0, 1, 2], [0]]) == 3
    torch.testing.assert_close(chains.layers[0].keys, keys[:, :, :6], rtol=0, atol=0)


def test_row_slots_positions_and_masks():
    """RowSlots: left padding and holes are invalid slots; positions count a row's valid slots."""
    cache = DynamicCache()
    cache.layers = [PreallocatedLayer()]
    slots = RowSlots(2, cache=cache)  # the cache's slots: keep compacts it
    slots.append_prompts(torch.tensor([[0, 1, 1], [1, 1, 1]]), 3)
    assert slots.ragged and slots.counts == [2, 3]
    cache.layers[0].update(torch.zeros(2, 1, 6, 2), torch.zeros(2, 1, 6, 2))  # a pass of 3 nodes per row
    slots.keep([[0, 2], [0]])
    assert slots.length == 5 and slots.counts == [4, 4]
    assert slots.valid.tolist() == [[False, True, True, True, True], [True, True, True, True, False]]
    assert slots.positions(torch.tensor([0, 1])).tolist() == [[4, 5], [4, 5]]
    mask = slots_mask(slots, torch.tensor([[True, False], [True, True]])[None])  # [2, 1, 2, 5 + 2]
    assert mask.shape == (2, 1, 2, 7)
    assert (mask[0, 0, :, 0] < 0).all() and (mask[1, 0, :, 4] < 0).all() and (mask[:, 0, 0, 6] < 0).all()
    assert (mask[0, 0, 1, 1:] == 0).all()
    dense = RowSlots(2)
    dense.append(4)
    assert not dense.ragged and dense.positions(torch.tensor([0, 1])).tolist() == [[4, 5]]
    dense.append(2, [2, 1])  # a hole in row 1 makes it ragged
    assert dense.ragged and dense.counts == [6, 5] and dense.valid[1].tolist() == [True] * 5 + [False]


@pytest.mark.parametrize("one_dict", [False, True], ids=["per-layer-kwargs", "one-kwargs-dict"])
def test_layer_windows_from_either_library_kwargs_form(monkeypatch, one_dict):
    """transformers' get_layer_types_and_kwargs returned one kwargs dict for all layers before 5.19 (5.17, the GPU
    image's release, failed every tree pass on it) and one dict per layer since: both give the same windows."""
    from transformers import LlamaConfig

    from treespec import compat
    from treespec.layer_types import attention_layers

    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = LlamaConfig(num_hidden_layers=4, layer_types=types, sliding_window=6)

    def library(cfg):  # the two shapes of the library's answer
        kwargs = {"sliding_window": 6} if one_dict else [{"sliding_window": 6} if t.startswith("sliding") else {}
                                                          for t in types]
        return list(types), kwargs

    monkeypatch.setattr(compat, "_library_layer_types", library)
    assert compat.layer_types_and_kwargs(config)[1] == [{"sliding_window": 6}, {}, {"sliding_window": 6}, {}]
    assert attention_layers(config) == [6, None, 6, None]
