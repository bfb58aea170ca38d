"""treespec.masks (with the core's owner of masks, treespec.visibility): one forward over a tree equals sequential
decoding of every root-to-node path.

Tiny random-weight Llama, Qwen2 and GPT-2 (learned absolute positions), eager and sdpa attention. Weights
are initialised with a large std so that a wrong mask visibly changes the logits (checked too: the test
has power). The FlexAttention BlockMask is checked cheaply on CPU: its mask_mod against the float mask,
and un-compiled flex_attention against sdpa; the full-model flex test compiles (~10 s) and is opt-in.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from transformers import DynamicCache

from treespec.compat import cache_arg, output_cache
from treespec.masks import ancestor_mask
from treespec.masks.flex import FlexTreeMasks, mask_mod_of
from treespec.tree import Tree
from treespec.visibility import mask_for, tree_allowed, tree_mask_builder, tree_position_ids

VOCAB, PREFIX, ATOL = 50, 7, 1e-4
TREES = {
    "medusa-like": Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
    "full-2x2": Tree.full(2, 2),
}


def tree_attention_mask(tree: Tree, past_len: int, *, dtype=torch.float32):
    """The additive mask of a whole tree after ``past_len`` cached tokens, built from scratch."""
    return mask_for("sdpa", tree.ancestors, past_len, dtype=dtype)


def tree_block_mask(tree: Tree, past_len: int):
    """The BlockMask of a whole tree after ``past_len`` cached tokens, built with create_block_mask (~1 s on CPU)."""
    return mask_for("flex_attention", tree.ancestors, past_len)


def tree_mask_mod(tree: Tree, past_len: int):
    return mask_mod_of(tree_allowed(tree, past_len))


def tiny_model(arch: str, attn: str):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, initializer_range=0.2, attn_implementation=attn)
    if arch == "gpt2":
        config = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None,
                               **common)
        return tf.GPT2LMHeadModel(config).eval()
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, **common)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**sizes)).eval()
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**sizes)).eval()


def prefill(model, prefix):
    """A DynamicCache holding ``prefix`` [1, P]. Recomputed rather than copied for each use."""
    cache = DynamicCache(config=model.config)
    model(prefix, **cache_arg(cache), use_cache=True)
    return cache


def sequential_logits(model, prefix, tokens, tree: Tree) -> torch.Tensor:
    """Logits [N, V] of each node from decoding root → node one token at a time after ``prefix``."""
    logits = torch.full((tree.num_nodes, VOCAB), float("nan"))
    for leaf_path in tree.leaf_paths or [[]]:
        cache = prefill(model, prefix)
        for node in [0, *leaf_path]:
            out = model(tokens[:, node : node + 1], **cache_arg(cache), use_cache=True)
            logits[node] = out.logits[0, -1]
    return logits


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@torch.no_grad()
def test_tree_forward_equals_sequential(arch, attn, tree_name):
    tree = TREES[tree_name]
    model = tiny_model(arch, attn)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(VOCAB, (1, PREFIX), generator=gen)  # [1, P]
    tokens = torch.randint(VOCAB, (1, tree.num_nodes), generator=gen)  # [1, N]: root + candidates

    cache = prefill(model, prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the release's own cache keyword (treespec.compat) never warns
        out = model(tokens, **cache_arg(cache), use_cache=True, attention_mask=tree_attention_mask(tree, PREFIX),
                    position_ids=tree_position_ids(tree, PREFIX))
    assert output_cache(out) is cache and cache.get_seq_length() == PREFIX + tree.num_nodes
    tree_logits = out.logits[0]  # [N, V]
    reference = sequential_logits(model, prefix, tokens, tree)
    torch.testing.assert_close(tree_logits, reference, atol=ATOL, rtol=0)

    # power: plain causal attention over the same tokens (siblings see each other) must differ
    causal = model(tokens, **cache_arg(prefill(model, prefix)), position_ids=tree_position_ids(tree, PREFIX)).logits[0]
    assert (causal - reference).abs().max() > 100 * ATOL


@torch.no_grad()
def test_bool_mask_is_wrong_with_eager():
    """Why tree_attention_mask is float: eager attention ADDS a 4D mask to the scores, so a bool one blocks nothing."""
    tree = TREES["medusa-like"]
    model = tiny_model("llama", "eager")
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(VOCAB, (1, PREFIX), generator=gen)
    tokens = torch.randint(VOCAB, (1, tree.num_nodes), generator=gen)
    kwargs = dict(position_ids=tree_position_ids(tree, PREFIX))
    as_float = model(tokens, **cache_arg(prefill(model, prefix)), attention_mask=tree_attention_mask(tree, PREFIX),
                     **kwargs)
    as_bool = model(tokens, **cache_arg(prefill(model, prefix)), attention_mask=tree_allowed(tree, PREFIX)[None, None],
                    **kwargs)
    assert (as_float.logits - as_bool.logits).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_values(dtype):
    tree, past = TREES["medusa-like"], 5
    mask = tree_attention_mask(tree, past, dtype=dtype)
    big_n = tree.num_nodes
    assert mask.shape == (1, 1, big_n, past + big_n) and mask.dtype == dtype and mask.is_floating_point()
    allowed = torch.cat([torch.ones(big_n, past, dtype=torch.bool), tree.ancestors], dim=1)  # [N, P + N]
    assert (mask[0, 0][allowed] == 0).all()
    assert (mask[0, 0][~allowed] == torch.finfo(dtype).min).all()
    assert tree_allowed(tree, past).equal(allowed)
    assert tree_position_ids(tree, past).tolist() == [[past + d for d in tree.depths.tolist()]]
    assert tree_position_ids(tree, past).dtype == torch.long


def test_reused_mask_parts_equal_a_fresh_mask():
    # one decoding run's dense tree masks: trees alternate (kept block rebuilt), the past grows past the
    # zero buffer's capacity; every mask must equal the one built from scratch
    reuse = tree_mask_builder("sdpa", dtype=torch.bfloat16)
    trees = {**TREES, "chain": Tree.chain(3), "root-only": Tree.chain(0)}
    for tree_name, past in [("medusa-like", 3), ("medusa-like", 4), ("full-2x2", 4), ("chain", 5),
                            ("medusa-like", 300), ("root-only", 301), ("medusa-like", 0), ("full-2x2", 900)]:
        tree = trees[tree_name]
        mask = reuse(tree.ancestors, past)
        assert mask.equal(tree_attention_mask(tree, past, dtype=torch.bfloat16)), (tree_name, past)


def test_ancestor_mask_partial_rows():
    # a drafter feeding only some nodes: rows = those nodes, columns = past + the nodes fed so far
    allowed = torch.tensor([[True, False, False], [True, True, False]])  # [q=2, t=3]
    mask = ancestor_mask(allowed, 4)
    assert mask.shape == (1, 1, 2, 7) and mask.dtype == torch.float32
    assert ((mask[0, 0] == 0) == torch.cat([torch.ones(2, 4, dtype=torch.bool), allowed], dim=1)).all()


def test_no_past_and_root_only():
    root_only = Tree.chain(0)
    assert tree_attention_mask(root_only, 0).equal(torch.zeros(1, 1, 1, 1))
    assert tree_position_ids(root_only, 3).tolist() == [[3]]


@pytest.fixture(scope="module")
def block_mask_case():
    tree, past = TREES["medusa-like"], 5
    return tree, past, tree_block_mask(tree, past)  # ~1 s on CPU


def test_block_mask_matches_float_mask(block_mask_case):
    tree, past, block_mask = block_mask_case
    big_n = tree.num_nodes
    assert block_mask.shape == (1, 1, big_n, past + big_n)
    q_idx, kv_idx = torch.arange(big_n)[:, None], torch.arange(past + big_n)[None, :]  # broadcast to [N, P + N]
    expected = tree_attention_mask(tree, past)[0, 0] == 0
    for mask_mod in (block_mask.mask_mod, tree_mask_mod(tree, past)):
        assert mask_mod(0, 0, q_idx, kv_idx).equal(expected)


def test_flex_attention_matches_sdpa(block_mask_case):
    from torch.nn.attention.flex_attention import flex_attention

    tree, past, block_mask = block_mask_case
    big_n, gen = tree.num_nodes, torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, big_n, 8, generator=gen)  # [b, h, q, d]
    k, v = torch.randn(2, 1, 4, past + big_n, 8, generator=gen)  # [b, h, k, d] each
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")  # un-fused on purpose: cheap
        flex = flex_attention(q, k, v, block_mask=block_mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(tree, past))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


def test_per_row_masks_dense_and_flex():
    """A batch's masks (rows_mask_for): row b sees its valid cached slots and its own tree; the BlockMask over b
    rows (un-compiled flex_attention on CPU) attends as sdpa does with the float mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from treespec.masks import visible_rows
    from treespec.visibility import rows_mask_for

    cached = torch.tensor([[False, True, True, True], [True, True, False, True]])  # padding, a hole
    trees = [Tree.full(2, 2), Tree.chain(6)]  # 7 nodes each: per-row relations
    allowed = torch.stack([tree.ancestors for tree in trees])  # [2, 7, 7]
    seen = visible_rows(cached, allowed, 4)
    assert seen.shape == (2, 7, 11)
    for b, tree in enumerate(trees):
        assert seen[b, :, :4].equal(cached[b].expand(7, -1)) and seen[b, :, 4:].equal(tree.ancestors)
    assert visible_rows(None, trees[0].ancestors[None], 4)[0].equal(tree_allowed(trees[0], 4))  # broadcasts
    dense = rows_mask_for("sdpa", cached, allowed, 4)
    assert dense.shape == (2, 1, 7, 11) and dense[~seen[:, None]].lt(0).all() and (dense[seen[:, None]] == 0).all()
    block = rows_mask_for("flex_attention", cached, allowed, 4)
    assert block.shape == (2, 1, 7, 11)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 7, 8, generator=gen)
    k, v = torch.randn(2, 2, 2, 11, 8, generator=gen)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        out = flex_attention(q, k, v, block_mask=block)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                               atol=1e-5, rtol=0)


def test_reused_block_masks_equal_fresh_ones():
    # one decoding run's FlexTreeMasks against create_block_mask (tree_block_mask), across key-block boundaries
    # (block size 16 here, so a few cheap steps cross several), a tree change and the table's growth; and
    # un-compiled flex_attention with it against sdpa with the float mask
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    assert isinstance(tree_mask_builder("flex_attention"), FlexTreeMasks)
    reuse = FlexTreeMasks(block_size=16)
    gen = torch.Generator().manual_seed(0)
    trees = {**TREES, "chain": Tree.chain(3)}
    for tree_name, past in [("medusa-like", 0), ("medusa-like", 5), ("medusa-like", 9), ("medusa-like", 16),
                            ("medusa-like", 30), ("full-2x2", 31), ("full-2x2", 33), ("chain", 40), ("chain", 150)]:
        tree = trees[tree_name]
        big_n, length = tree.num_nodes, past + tree.num_nodes
        fast = reuse(tree.ancestors, past)
        fresh = create_block_mask(tree_mask_mod(tree, past), None, None, big_n, length, device="cpu", BLOCK_SIZE=16)
        assert fast.shape == fresh.shape == (1, 1, big_n, length), (tree_name, past)
        q_idx, kv_idx = torch.arange(big_n)[:, None], torch.arange(length)[None, :]
        expected = tree_attention_mask(tree, past)[0, 0] == 0
        assert fast.mask_mod(0, 0, q_idx, kv_idx).equal(expected), (tree_name, past)
        # the same key blocks visited (un-compiled flex ignores them, the GPU kernels do not), and the blocks it
        # calls full (their mask_mod is skipped) are wholly allowed
        assert fast.to_dense().equal(fresh.to_dense()), (tree_name, past)
        for block in fast.full_kv_indices[0, 0, 0, : int(fast.full_kv_num_blocks[0, 0, 0])].tolist():
            assert expected[:, 16 * block : 16 * block + 16].all(), (tree_name, past, block)
        q = torch.randn(1, 2, big_n, 8, generator=gen)  # [b, h, q, d]
        k, v = torch.randn(2, 1, 2, length, 8, generator=gen)  # [b, h, k, d] each
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            out = flex_attention(q, k, v, block_mask=fast)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(tree, past))
        torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TREESPEC_SLOW"), reason="compiles flex_attention (~10 s on CPU); "
                    "set TREESPEC_SLOW=1 to run")
@torch.no_grad()
def test_flex_model_forward_equals_sdpa():
    tree = TREES["medusa-like"]
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(VOCAB, (1, PREFIX), generator=gen)
    tokens = torch.randint(VOCAB, (1, tree.num_nodes), generator=gen)
    logits = {}
    for attn, mask in [("sdpa", tree_attention_mask(tree, PREFIX)), ("flex_attention", tree_block_mask(tree, PREFIX))]:
        model = tiny_model("llama", attn)
        logits[attn] = model(tokens, **cache_arg(prefill(model, prefix)), attention_mask=mask,
                             position_ids=tree_position_ids(tree, PREFIX)).logits
    torch.testing.assert_close(logits["flex_attention"], logits["sdpa"], atol=ATOL, rtol=0)
