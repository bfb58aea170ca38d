"""The preallocated KV cache (treespec/cache.py, ``PreallocatedLayer``): the same logits and the same held
entries as transformers' concatenating DynamicLayer through a prefill, tree passes compacted to a non-contiguous
accepted path, crops, growth past the buffer's capacity and a reset; and generate() decodes the same tokens."""

import pytest
import torch
from transformers import DynamicCache

from treespec import Tree, generate
from treespec.attention import tree_masks, tree_position_ids
from treespec.cache import PreallocatedLayer, TreeCache, keep_tree_path
from treespec.compat import cache_arg
from treespec.heads import DraftModel

from .tiny_models import hf_greedy, perturbed, tiny_llama


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
