"""The architecture matrix: which stock transformers families treespec decodes losslessly, with which drafters.

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
combination transformers itself does not offer. The test suite runs them as tests; matrix_report.py
(scripts/architecture_matrix.py) runs them into a markdown table.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

from treespec import Tree, generate
from treespec.cache import check_layer
from treespec.heads import DraftModel, PromptLookup
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.layer_types import check_layer_types, check_rollback
from treespec.sampling import Sampling
from treespec.train.checks.lossless import chi2_pvalue, enumerate_law, hf_greedy, perturbed

WINDOW, PROMPT_LEN, NEW = 8, 20, 24
TREES = {"chain": Tree.chain(3), "tree": Tree.full(2, 2)}
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
    greedy argmax has no near-ties that tree vs sequential rounding could flip."""
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


# -- the checks ---------------------------------------------------------------------------------------------
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


# sampling: vocabulary 4, so the law of a 3-token continuation is enumerable
S_VOCAB, S_NEW, S_WINDOW, S_RUNS = 4, 3, 3, 500
S_PROMPT = torch.tensor([[1, 3, 0, 2, 1, 3]])  # longer than the window


def exact_distribution(model, sampling: Sampling) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration with the model's own causal forward: array [V, V, V]."""
    return enumerate_law(model, S_PROMPT, sampling, S_VOCAB, S_NEW)


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


REFUSED = {  # where it is refused: "config" (its layer types) or "model" (transformers' stateful flag)
    "Mamba": ("config", "MambaConfig", {}),
    "Llama 4": ("config", "Llama4TextConfig", {"attention_chunk_size": 8}),
    "Gemma-3n": ("config", "Gemma3nTextConfig", {"num_kv_shared_layers": 1, "layer_types": ["full_attention"] * 2}),
    "RWKV": ("model", "RwkvForCausalLM", {"attention_hidden_size": 16}),
    "xLSTM": ("model", "xLSTMForCausalLM", {"num_heads": 2}),
}


def check_refused(name: str) -> str:
    """The error generate() raises at its door for a family whose state cannot be rolled back."""
    where, cls, kwargs = REFUSED[name]
    if where == "config":
        config = getattr(transformers, cls)(num_hidden_layers=2, **kwargs)
        check = functools.partial(check_layer_types, config)
    else:
        model_class = getattr(transformers, cls)
        config = model_class.config_class(vocab_size=64, hidden_size=16, num_hidden_layers=2, **kwargs)
        check = functools.partial(check_rollback, model_class(config))
    try:
        check()
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{name} was not refused")
