"""The architecture matrix as tests: the checks of train/checks/architectures.py on every family (tiny random models
of the stock transformers decoders, prompts longer than the sliding window), and what they rest on: tree masks
that honour the window, a sliding layer that keeps the committed window, transformers' own sliding cache refused.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import treespec.visibility
from treespec import Tree, generate
from treespec.cache import TreeCache, keep_tree_path
from treespec.compat import cache_arg
from treespec.heads import DraftModel
from treespec.train.checks.architectures import (
    BY_NAME,
    FAMILIES,
    PROMPT_LEN,
    SAMPLING,
    TREES,
    WINDOW,
    NotApplicable,
    build,
    check_eagle,
    check_greedy,
    check_medusa,
    check_prompt_lookup,
    check_refused,
    check_same_architecture_draft,
    check_sampling,
    draft_of,
    expect_greedy,
    prompt,
    use_attention,
)
from treespec.visibility import tree_allowed, tree_masks, tree_position_ids

ATTENTIONS = ("eager", "sdpa")
NAMES = [f.name for f in FAMILIES]


def run(check, *args):
    try:
        return check(*args)
    except NotApplicable as reason:
        pytest.skip(str(reason))


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("attn", ATTENTIONS)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers(name, attn, tree):
    run(check_greedy, name, attn, tree)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_lookup_long_paths(name):
    run(check_prompt_lookup, name)


@pytest.mark.parametrize("name", NAMES)
def test_eagle_builds_and_decodes(name):
    run(check_eagle, name)


@pytest.mark.parametrize("name", NAMES)
def test_medusa_builds_and_decodes(name):
    run(check_medusa, name)


@pytest.mark.parametrize("name", ["Mistral", "Gemma-3"])
def test_same_architecture_draft_sliding(name):
    run(check_same_architecture_draft, name)


# full attention with -m slow: tests/test_lossless.py's tree-sampled is the same check on a full-attention Llama, and
# the greedy matrix shows every full-attention family's tree passes equal to its own
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "full" else k for k in SAMPLING])
def test_sampling_is_lossless(kind):
    p_value, p_unwindowed = check_sampling(kind)
    assert p_value > 1e-3
    if p_unwindowed is not None:  # power: these counts reject the law of a model that ignores the window
        assert p_unwindowed < 1e-3


def test_tree_masks_honour_the_window(monkeypatch):
    """Power of the greedy checks: tree masks that ignore the window break equality on a sliding family."""
    mask_for = treespec.visibility.mask_for
    monkeypatch.setattr(treespec.visibility, "mask_for", lambda *a, **k: mask_for(*a, **{**k, "window": None}))
    for name in ("Mistral", "Gemma-3"):
        with pytest.raises(AssertionError, match="greedy output differs"):
            check_greedy(name, "eager", "tree")


def test_window_relation():
    """By sequential position: a chain root at 5, child 6, grandchild 7, window 3, cache holding positions 3, 4."""
    seen = tree_allowed(Tree.chain(2), 5, start=3, window=3)  # keys at positions 3, 4 | 5, 6, 7
    assert seen.int().tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert tree_allowed(Tree.full(2, 1), 5, start=3, window=3).int().tolist() == [  # siblings never see each other
        [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 1]]


@pytest.mark.parametrize("name", ["Mistral", "Gemma-3"])
def test_window_fills_during_decoding(name):
    """A prompt shorter than the window: the window first fills, then slides, during tree passes."""
    target = use_attention(build(name), "sdpa", BY_NAME[name])
    expect_greedy(target, prompt(5), DraftModel(draft_of(name)), Tree.full(2, 2))


@torch.no_grad()
def test_sliding_layer_keeps_committed_window():
    """A 20-token prompt in a window of 8, a tree pass, a non-contiguous path kept: each sliding layer holds
    exactly the last window − 1 committed tokens and the next logits equal a sequential decode's."""
    target = use_attention(build("Gemma-3"), "eager", BY_NAME["Gemma-3"])
    ids, tree = prompt(), Tree.full(2, 3)
    cache = TreeCache(target.config)
    target(input_ids=ids, **cache_arg(cache), use_cache=True)
    nodes = torch.randint(0, 64, (tree.num_nodes,), generator=torch.Generator().manual_seed(5))
    past = PROMPT_LEN
    target(input_ids=nodes[None], **cache_arg(cache), use_cache=True, attention_mask=tree_masks(cache, tree, past),
           position_ids=tree_position_ids(tree, past))
    leaf = max(tree.leaf_paths, key=lambda p: (len(p), p))  # the last deepest path: not a chain prefix
    keep = torch.tensor([0, *leaf])
    keep_tree_path(cache, past, keep)
    committed = torch.cat([ids[0], nodes[keep]])  # [P + k]
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.held() == WINDOW - 1 and layer.get_seq_length() == len(committed) for layer in sliding)
    token = torch.tensor([[7]])
    logits = target(input_ids=token, **cache_arg(cache), use_cache=True).logits[0, -1]
    reference = target(input_ids=torch.cat([committed[None], token], dim=1)).logits[0, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_transformers_sliding_cache_is_refused():
    target = build("Mistral")
    cache = transformers.DynamicCache(config=target.config)
    target(input_ids=prompt(), **cache_arg(cache), use_cache=True)
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer cannot be rolled back.*TreeCache"):
        keep_tree_path(cache, PROMPT_LEN - 1, torch.tensor([0]))


@pytest.mark.parametrize("name, expected", [
    ("Mamba", "mamba has no attention layer"),
    ("Llama 4", "cannot be verified with tree passes: 'chunked_attention'"),
    ("Gemma-3n", "cannot be verified with tree passes: 'dummy' (1 of 2 layers): layers that reuse another layer's"),
    ("RWKV", "RwkvForCausalLM keeps a recurrent state"),
    ("xLSTM", "xLSTMForCausalLM keeps a recurrent state"),
])
def test_state_that_cannot_be_rolled_back_is_refused(name, expected):
    assert expected in check_refused(name)


def test_refused_at_generates_door():
    """Before any forward: by layer type (Mamba: recurrent layers only), or by transformers' stateful flag (RWKV)."""
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                                   state_size=4)).eval()
    with pytest.raises(ValueError, match="mamba has no attention layer"):
        generate(mamba, torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    rwkv = transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                                attention_hidden_size=16)).eval()
    with pytest.raises(ValueError, match="RwkvForCausalLM keeps a recurrent state"):
        generate(rwkv, torch.tensor([[1, 2, 3]]), max_new_tokens=2)
