"""The architecture matrix: tree speculation on the stock transformers decoders users bring.

Each family is a tiny random model (hidden 32, 2 layers, vocabulary 64: well under a second to build) whose
treespec decoding must equal transformers' own greedy ``generate`` token for token: a chain and a branching
tree under eager and sdpa (a draft model), prompt lookup on a repetitive prompt (long accepted paths, so
non-contiguous compaction and window trimming), EAGLE (one decoder layer of the family's own class) and
Medusa. Sliding families have a window of 8 and a 20-token prompt, so the window slides during the prompt and
during every tree pass; interleaved families (Qwen2 with ``max_window_layers``, Gemma-2/3, gpt-oss) mix
sliding and full layers, which take different masks. One chi-square check per attention family (full,
sliding, interleaved) shows sampling is lossless, and that the same counts reject the distribution a
window-ignoring implementation would give. Models whose state cannot be rolled back are refused at
generate's door, naming the layer type.

The checks are plain functions that return a summary (τ, p-values) or raise; ``NotApplicable`` marks a
combination transformers itself does not offer. scripts/architecture_matrix.py runs the same checks and
writes treespec/models/results/architecture_matrix.md.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import transformers

import treespec.cache
from treespec import Tree, generate
from treespec.attention import tree_allowed, tree_masks, tree_position_ids
from treespec.cache import (
    TreeCache,
    attention_layers,
    check_layer,
    check_rollback,
    keep_tree_path,
)
from treespec.heads import DraftModel, PromptLookup
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.sampling import Sampling, probs

from .stats import chi2_pvalue
from .tiny_models import hf_greedy, perturbed

WINDOW, PROMPT_LEN, NEW = 8, 20, 24
TREES = {"chain": Tree.chain(3), "tree": Tree.full(2, 2)}
ATTENTIONS = ("eager", "sdpa")
HEAD_DIM, SLIDING = "head_dim", "window"  # placeholders build() fills in from the model's sizes


@dataclass(frozen=True)
class Family:
    name: str
    config: str                 # transformers config class
    model: str                  # transformers causal-LM class
    kind: str                   # "full", "sliding" or "interleaved": the masks its layers take
    kwargs: dict = field(default_factory=dict)
    no_sdpa: str | None = None  # why transformers offers this family no sdpa attention


FAMILIES = [
    Family("Llama", "LlamaConfig", "LlamaForCausalLM", "full"),
    Family("Mistral", "MistralConfig", "MistralForCausalLM", "sliding", {"sliding_window": SLIDING}),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", "interleaved",  # layer 0 full, layer 1 sliding
           {"use_sliding_window": True, "sliding_window": SLIDING, "max_window_layers": 1}),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", "full", {"head_dim": HEAD_DIM}),
    Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "full",
           {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", "sliding",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": SLIDING}),
    Family("Gemma-2", "Gemma2Config", "Gemma2ForCausalLM", "interleaved",  # sliding, full
           {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": SLIDING},
           no_sdpa="transformers 5.24 has no sdpa attention for Gemma-2 (logit softcapping): eager only"),
    Family("Gemma-3", "Gemma3TextConfig", "Gemma3ForCausalLM", "interleaved",
           {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": SLIDING,
            "layer_types": ["sliding_attention", "full_attention"]}),
    Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", "sliding", {"sliding_window": SLIDING}),
    Family("GPT-2", "GPT2Config", "GPT2LMHeadModel", "full"),
    Family("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM", "full"),
    Family("OLMo-2", "Olmo2Config", "Olmo2ForCausalLM", "full"),
    Family("gpt-oss", "GptOssConfig", "GptOssForCausalLM", "interleaved",
           {"head_dim": HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": SLIDING,
            "layer_types": ["sliding_attention", "full_attention"]},
           no_sdpa="transformers 5.24 has no sdpa attention for gpt-oss (attention sinks): eager only"),
]
BY_NAME = {f.name: f for f in FAMILIES}
SAMPLING = {"full": "Qwen3", "sliding": "Mistral", "interleaved": "Gemma-3"}  # one family per attention kind


class NotApplicable(Exception):
    """A combination transformers itself does not offer (e.g. sdpa for Gemma-2)."""


@functools.cache
def build(name: str, *, vocab: int = 64, hidden: int = 32, window: int = WINDOW, init_std: float = 0.2,
          seed: int = 0):
    """A tiny random model of family ``name``. init_std well above the usual 0.02 makes the logits peaked, so
    greedy argmax has no near-ties that tree vs sequential rounding could flip (tests/tiny_models.py)."""
    family = BY_NAME[name]
    fill = {HEAD_DIM: hidden // 2, SLIDING: window}
    kwargs = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in family.kwargs.items()}
    config = getattr(transformers, family.config)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, initializer_range=init_std,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager", **kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, family.model)(config).eval()


def use_attention(model, attn: str, family: Family):
    if attn == "sdpa" and family.no_sdpa:
        raise NotApplicable(family.no_sdpa)
    model.set_attn_implementation(attn)
    return model


def full_attention(model):
    """``model`` with every layer attending fully: the greedy and sampling checks use such drafts so that a
    failure points at the target's masks and cache; drafts with their own windows are checked separately
    (``check_same_architecture_draft``). Any draft is lossless; this one only agrees less once the window
    slides."""
    config = model.config
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    elif getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    return model


@functools.cache
def draft_of(name: str):
    """A draft for family ``name``: its target with every weight jittered (agrees often, not always)."""
    return full_attention(perturbed(build(name), scale=0.2))


def prompt(length: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(3))


def expect_greedy(target, input_ids, drafter, tree, new: int = NEW):
    """generate() must equal transformers' greedy generate token for token; returns its result."""
    out = generate(target, input_ids, drafter=drafter, tree=tree, max_new_tokens=new)
    expected = hf_greedy(target, input_ids, new)
    if not torch.equal(out.sequences, expected):
        first = int((out.sequences != expected).nonzero()[0, 1]) - input_ids.shape[1]
        raise AssertionError(f"greedy output differs from transformers' from new token {first}")
    return out


def tau(out) -> str:
    return f"τ {out.mean_accept_length:.2f}"


# -- the checks (shared with scripts/architecture_matrix.py) -------------------------------------------------
def check_greedy(name: str, attn: str, tree: str) -> str:
    """A draft model proposes a chain or a tree; equal to transformers' greedy generate under ``attn``."""
    family = BY_NAME[name]
    target = use_attention(build(name), attn, family)
    draft = use_attention(draft_of(name), attn, family)
    return tau(expect_greedy(target, prompt(), DraftModel(draft), TREES[tree]))


def check_prompt_lookup(name: str) -> str:
    """A repetitive prompt: prompt lookup's tree is accepted for long paths (non-contiguous compaction)."""
    pattern = torch.tensor([[5, 9, 13, 2, 7] * 4])  # [1, 20]
    return tau(expect_greedy(use_attention(build(name), "eager", BY_NAME[name]), pattern, PromptLookup(),
                             Tree.full(2, 3)))


def check_same_architecture_draft(name: str) -> str:
    """The target drafting for itself (a draft model with the target's own windows): every candidate path is
    accepted in full, so the draft's own tree expansion sees exactly what the target's sequential decode does."""
    target = use_attention(build(name), "eager", BY_NAME[name])
    drafter = DraftModel(copy.deepcopy(target))
    for layer in drafter.cache.layers:  # the draft's own cache must be one treespec can roll back
        check_layer(layer)
    out = expect_greedy(target, prompt(), drafter, Tree.full(2, 2))
    if any(n != 3 for n in out.accept_lengths[:-1]):
        raise AssertionError(f"a perfect draft had paths rejected: accept lengths {out.accept_lengths}")
    return tau(out)


def check_eagle(name: str) -> str:
    """An untrained EAGLE drafter: one decoder layer of the family's own class (full attention), then greedy."""
    target = use_attention(build(name), "eager", BY_NAME[name])
    torch.manual_seed(0)
    return tau(expect_greedy(target, prompt(), Eagle(EagleModel(target).eval()), Tree.full(2, 2)))


def check_medusa(name: str) -> str:
    """Untrained Medusa heads on the family's final hidden state and lm_head, then greedy."""
    target = use_attention(build(name), "eager", BY_NAME[name])
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=2,
                        lm_head=target.get_output_embeddings())
    return tau(expect_greedy(target, prompt(), Medusa(heads.eval()), Tree.full(2, 2)))


# sampling: vocabulary 4, so the law of a 3-token continuation is enumerable (as in tests/test_lossless.py)
S_VOCAB, S_NEW, S_WINDOW, S_RUNS = 4, 3, 3, 500
S_PROMPT = torch.tensor([[1, 3, 0, 2, 1, 3]])  # longer than the window


def exact_distribution(model, sampling: Sampling) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration with the model's own causal forward: array [V, V, V]."""
    dist = np.zeros((S_VOCAB,) * S_NEW)
    with torch.no_grad():
        for prefix in itertools.product(range(S_VOCAB), repeat=S_NEW - 1):
            ids = torch.cat([S_PROMPT, torch.tensor([prefix])], dim=1)
            p = probs(model(input_ids=ids).logits[0, -S_NEW:], sampling).double().numpy()  # [NEW, V]
            dist[prefix] = p[0, prefix[0]] * p[1, prefix[1]] * p[2]
    return dist


def check_sampling(kind: str, runs: int = S_RUNS) -> tuple[float, float | None]:
    """Sampled continuations (a draft model's sampled candidates in a 2×2 tree, temperature 1) against the exact
    law: (p-value, p-value against the law without sliding windows, None for full attention)."""
    name = SAMPLING[kind]
    family = BY_NAME[name]
    target = use_attention(build(name, vocab=S_VOCAB, hidden=16, window=S_WINDOW, init_std=0.3, seed=11), "sdpa",
                           family)
    drafter = DraftModel(full_attention(perturbed(target, 1.0)), candidates="sample")
    sampling, gen = Sampling(1.0), torch.Generator().manual_seed(0)
    counts = np.zeros((S_VOCAB,) * S_NEW)
    for _ in range(runs):
        out = generate(target, S_PROMPT, drafter=drafter, tree=Tree.full(2, 2), max_new_tokens=S_NEW,
                       temperature=1.0, generator=gen)
        counts[tuple(out.sequences[0, S_PROMPT.shape[1]:].tolist())] += 1
    p_value = chi2_pvalue(counts, exact_distribution(target, sampling))
    if kind == "full":
        return p_value, None
    unwindowed = full_attention(copy.deepcopy(target))
    return p_value, chi2_pvalue(counts, exact_distribution(unwindowed, sampling))


# -- tests -------------------------------------------------------------------------------------------------
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


@pytest.mark.parametrize("kind", list(SAMPLING))
def test_sampling_is_lossless(kind):
    p_value, p_unwindowed = check_sampling(kind)
    assert p_value > 1e-3
    if p_unwindowed is not None:  # power: these counts reject the law of a model that ignores the window
        assert p_unwindowed < 1e-3


def test_tree_masks_honour_the_window(monkeypatch):
    """Power of the greedy checks: tree masks that ignore the window break equality on a sliding family."""
    mask_for = treespec.cache.mask_for
    monkeypatch.setattr(treespec.cache, "mask_for", lambda *a, **k: mask_for(*a, **{**k, "window": None}))
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
    target(input_ids=ids, cache=cache, use_cache=True)
    nodes = torch.randint(0, 64, (tree.num_nodes,), generator=torch.Generator().manual_seed(5))
    past = PROMPT_LEN
    target(input_ids=nodes[None], cache=cache, use_cache=True, attention_mask=tree_masks(cache, tree, past),
           position_ids=tree_position_ids(tree, past))
    leaf = max(tree.leaf_paths, key=lambda p: (len(p), p))  # the last deepest path: not a chain prefix
    keep = torch.tensor([0, *leaf])
    keep_tree_path(cache, past, keep)
    committed = torch.cat([ids[0], nodes[keep]])  # [P + k]
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.held() == WINDOW - 1 and layer.get_seq_length() == len(committed) for layer in sliding)
    token = torch.tensor([[7]])
    logits = target(input_ids=token, cache=cache, use_cache=True).logits[0, -1]
    reference = target(input_ids=torch.cat([committed[None], token], dim=1)).logits[0, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_transformers_sliding_cache_is_refused():
    target = build("Mistral")
    cache = transformers.DynamicCache(config=target.config)
    target(input_ids=prompt(), cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer cannot be rolled back.*TreeCache"):
        keep_tree_path(cache, PROMPT_LEN - 1, torch.tensor([0]))


REFUSED = {  # where it is refused: "config" (its layer types) or "model" (transformers' stateful flag)
    "Qwen3-Next": ("config", "Qwen3NextConfig", {"layer_types": ["linear_attention", "full_attention"]}),
    "Mamba": ("config", "MambaConfig", {}),
    "Falcon-H1": ("config", "FalconH1Config", {}),
    "Llama 4": ("config", "Llama4TextConfig", {"attention_chunk_size": 8}),
    "RWKV": ("model", "RwkvForCausalLM", {"attention_hidden_size": 16}),
    "xLSTM": ("model", "xLSTMForCausalLM", {"num_heads": 2}),
}


def check_refused(name: str) -> str:
    """The error generate() raises at its door for a family whose state cannot be rolled back."""
    where, cls, kwargs = REFUSED[name]
    if where == "config":
        config = getattr(transformers, cls)(num_hidden_layers=2, **kwargs)
        check = functools.partial(attention_layers, config)
    else:
        model_class = getattr(transformers, cls)
        config = model_class.config_class(vocab_size=64, hidden_size=16, num_hidden_layers=2, **kwargs)
        check = functools.partial(check_rollback, model_class(config))
    try:
        check()
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{name} was not refused")


@pytest.mark.parametrize("name, expected", [
    ("Qwen3-Next", "cannot be verified with tree passes: 'linear_attention' (1 of 2 layers): recurrent state"),
    ("Mamba", "cannot be verified with tree passes: 'linear_attention'"),
    ("Falcon-H1", "cannot be verified with tree passes: 'hybrid'"),
    ("Llama 4", "cannot be verified with tree passes: 'chunked_attention'"),
    ("RWKV", "RwkvForCausalLM keeps a recurrent state"),
    ("xLSTM", "xLSTMForCausalLM keeps a recurrent state"),
])
def test_state_that_cannot_be_rolled_back_is_refused(name, expected):
    assert expected in check_refused(name)


def test_refused_at_generates_door():
    """Before any forward: by layer type (Mamba), or by transformers' stateful flag (RWKV)."""
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                                   state_size=4)).eval()
    with pytest.raises(ValueError, match="mamba cannot be verified with tree passes: 'linear_attention'"):
        generate(mamba, torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    rwkv = transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                                attention_hidden_size=16)).eval()
    with pytest.raises(ValueError, match="RwkvForCausalLM keeps a recurrent state"):
        generate(rwkv, torch.tensor([[1, 2, 3]]), max_new_tokens=2)
