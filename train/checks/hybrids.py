"""The hybrid half of the architecture matrix: targets with linear-attention, state-space or short-convolution
layers beside attention (verified by treespec/recurrent.py), as tiny random models of the stock families.

Every check decodes with generate() and compares with transformers' own greedy ``generate`` token for token.
The drafter that makes paths accepted to every depth is ``NoisyOracle``: it proposes the target's own greedy
token at each node, corrupted with a fixed probability, so a step's walk stops anywhere from the root to a
leaf (the restore-and-replay branch and the keep-a-row branch both run). The prompt (20 tokens) is longer
than every convolution window (4), so conv states hold real history when verification starts.

``verification_cost`` is the issue's cost column: a tree pass (path rows, plus the replay a partial
acceptance needs) ÷ one plain one-token step, medians of interleaved timings.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from treespec import Tree, generate
from treespec.compat import cache_arg
from treespec.drafter import Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel
from treespec.heads.eagle import Eagle, EagleModel
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.layer_types import check_rollback
from treespec.recurrent import TargetRows
from treespec.sampling import Sampling
from treespec.train.checks.architectures import NotApplicable
from treespec.train.checks.lossless import chi2_pvalue, enumerate_law, hf_greedy

PROMPT_LEN, NEW = 20, 24
TREES = {"chain": Tree.chain(3), "tree": Tree.full(2, 2),
         "uneven tree": Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])}  # leaves at depths 2 and 3
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)


@dataclass(frozen=True)
class Hybrid:
    name: str
    model_type: str     # transformers' config model type
    mixer: str          # what its recurrent layers are
    kwargs: dict


HYBRIDS = [
    Hybrid("Qwen3.5", "qwen3_5_text", "gated delta net", {"num_hidden_layers": 4, **_GDN}),
    Hybrid("Qwen3-Next", "qwen3_next", "gated delta net",
           {"num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, **_GDN}),
    Hybrid("OLMo-hybrid", "olmo_hybrid", "gated delta net",
           {"num_hidden_layers": 4, "num_key_value_heads": 2, **{k: v for k, v in _GDN.items() if "conv" not in k}}),
    Hybrid("Kimi Linear", "kimi_linear", "Kimi delta attention",
           {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_key_value_heads": 2, "kv_lora_rank": 8, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 8,
            "linear_head_dim": 8, "linear_num_heads": 2, "num_experts": 2, "num_experts_per_token": 1,
            "moe_intermediate_size": 32}),
    Hybrid("Nemotron-H", "nemotron_h", "Mamba-2",
           {"layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention"], "ssm_state_size": 8,
            "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "conv_kernel": 4, "chunk_size": 8}),
    Hybrid("Granite-4 hybrid", "granitemoehybrid", "Mamba-2",
           {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 2,
            "num_experts_per_tok": 1, "shared_intermediate_size": 32, **_MAMBA2}),
    Hybrid("Bamba", "bamba", "Mamba-2", {"num_hidden_layers": 3, "attn_layer_indices": [1], **_MAMBA2}),
    Hybrid("Falcon-H1", "falcon_h1", "Mamba-2 beside attention in every layer",
           {"num_hidden_layers": 2, "mamba_d_ssm": 64, **_MAMBA2}),
    Hybrid("Jamba", "jamba", "Mamba-1 (fed one token at a time)",
           {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
            "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8, "mamba_dt_rank": 4,
            "use_mamba_kernels": False}),
    Hybrid("LFM2", "lfm2", "short convolution",
           {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "block_auto_adjust_ff_dim": False}),
]
# recurrent-only families (no attention layer): refused as targets (treespec.layer_types.check_hybrid), drafts only
RECURRENT_ONLY = [
    Hybrid("Mamba", "mamba", "Mamba-1 (no attention)", {"num_hidden_layers": 2, "state_size": 8, "use_mambapy": False}),
    Hybrid("Mamba-2", "mamba2", "Mamba-2 (no attention)",
           {"num_hidden_layers": 2, "num_heads": 4, "head_dim": 16, "state_size": 8, "n_groups": 1, "chunk_size": 8}),
]
BY_NAME = {h.name: h for h in HYBRIDS + RECURRENT_ONLY}
SAMPLING = ("Qwen3.5", "Nemotron-H")  # one gated-delta-net and one Mamba-2 family


@functools.cache
def build(name: str, *, vocab: int = 64, hidden: int = 32, init_std: float = 0.2, seed: int = 0):
    """A tiny random hybrid of family ``name`` (sdpa attention). init_std well above the usual 0.02 makes the
    logits peaked, so greedy argmax has no near-ties that tree vs sequential rounding could flip."""
    family = BY_NAME[name]
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, max_position_embeddings=256, initializer_range=init_std,
                 pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = AutoConfig.for_model(family.model_type, **(sizes | family.kwargs))
    if family not in RECURRENT_ONLY:  # whose models take no attention implementation
        config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def layers(name: str) -> str:
    model = build(name)
    kinds = {"LinearAttentionLayer": "recurrent", "DynamicLayer": "attention", "DummyLayer": "MLP",
             "LinearAttentionAndFullAttentionLayer": "recurrent + attention"}
    return " / ".join(kinds.get(type(layer).__name__, type(layer).__name__)
                      for layer in DynamicCache(config=model.config).layers)


def cache_states(cache) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a cache holds, cloned, with its kind: conv and recurrent states (a dict per layer, or one tensor on
    older transformers), attention keys."""
    out = []
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states", "keys"):
            value = getattr(layer, name, None)
            values = value.values() if isinstance(value, dict) else [value]
            out += [(name, t.clone()) for t in values if isinstance(t, torch.Tensor)]
    return out


class NoisyOracle(Drafter):
    """Proposes, at each node, the target's greedy token for the node's context with probability ``p`` (at rank
    0; a random other token otherwise, and at other ranks), so accepted paths end at every depth. Its
    candidates are a function of the context and its own generator, hence verified losslessly as prompt
    lookup's are; it runs the target without a cache (slow: tiny models only)."""

    def __init__(self, target, p: float = 0.7, seed: int = 0):
        self.target, self.p = target, p
        self.rng = torch.Generator().manual_seed(seed)
        self.vocab = target.config.get_text_config(decoder=True).vocab_size
        self.default_tree = Tree.full(2, 2)

    @torch.no_grad()
    def greedy(self, context: list[int]) -> int:
        return int(self.target(input_ids=torch.tensor([context])).logits[0, -1].argmax())

    def other(self, avoid: int) -> int:
        token = int(torch.randint(0, self.vocab - 1, (), generator=self.rng))
        return token + (token >= avoid)

    def propose(self, committed, feature, tree: Tree, sampling: Sampling, generator=None) -> Proposals:
        seq = committed.row(0).tolist()
        contexts, tokens = {0: seq}, []
        for i in range(1, tree.num_nodes):  # parents first
            parent, rank = tree.parent_list[i], int(tree.ranks[i])
            best = self.greedy(contexts[parent])
            hit = rank == 0 and float(torch.rand((), generator=self.rng)) < self.p
            tokens.append(best if hit else self.other(best))
            contexts[i] = contexts[parent] + tokens[-1:]
        return Proposals.stack([Proposal(tree=tree, tokens=torch.tensor(tokens, dtype=torch.long))])


def prompt(length: int = PROMPT_LEN, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(3))


def expect_greedy(target, drafter, tree, new: int = NEW):
    """generate() must equal transformers' greedy generate token for token; returns its result."""
    ids = prompt()
    out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=new)
    expected = hf_greedy(target, ids, new)
    if not torch.equal(out.sequences, expected):
        raise AssertionError(f"differs from transformers' greedy: {out.sequences[0, ids.shape[1]:].tolist()} vs "
                             f"{expected[0, ids.shape[1]:].tolist()}")
    return out


def tau(out) -> str:
    """τ and the accept lengths' range (paths must end at several depths for the check to mean much)."""
    lengths = out.accept_lengths[:-1] or out.accept_lengths
    new = len(out.sequences[0]) - PROMPT_LEN
    return f"τ {new / len(out.accept_lengths):.2f} (accepts {min(lengths)}–{max(lengths)})"


def check_greedy(name: str, tree: str) -> str:
    """The noisy oracle proposes a chain or a branching tree; equal to transformers' greedy generate."""
    target = build(name)
    out = expect_greedy(target, NoisyOracle(target), TREES[tree])
    if len(set(out.accept_lengths[:-1])) < 2:
        raise AssertionError(f"every path stopped at one depth ({out.accept_lengths}): the check saw one branch only")
    return tau(out)


def llama(vocab: int = 64, seed: int = 1):
    """A tiny random attention-only Llama (one layer): the plain draft of a hybrid, or the plain target of one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)).eval()


def check_draft_model(name: str) -> str:
    """A separate (attention-only) random draft model samples nothing: rejections at the first depth mostly."""
    return tau(expect_greedy(build(name), DraftModel(llama()), Tree.full(2, 2)))


def check_eagle(name: str, dynamic: bool = False) -> str:
    """An untrained EAGLE drafter (one full-attention decoder layer of the family's own class) on the hybrid's
    last hidden state; a static 2×2 tree or a dynamic one (EAGLE-2: 6 nodes, depth 3, top 2)."""
    target = build(name)
    torch.manual_seed(0)
    tree = DynamicTree(total_tokens=6, depth=3, top_k=2) if dynamic else Tree.full(2, 2)
    try:
        model = EagleModel(target).eval()
    except ValueError as err:  # no full-attention layer of the family's own class (Falcon-H1)
        raise NotApplicable(str(err)) from err
    return tau(expect_greedy(target, Eagle(model), tree))


def check_medusa(name: str) -> str:
    target = build(name)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=2,
                        lm_head=target.get_output_embeddings())
    return tau(expect_greedy(target, Medusa(heads.eval()), Tree.full(2, 2)))


# sampling: vocabulary 4, so the law of a 3-token continuation is enumerable
S_VOCAB, S_NEW, S_RUNS = 4, 3, 500
S_PROMPT = torch.tensor([[1, 3, 0, 2, 1, 3, 0, 0, 2]])  # longer than the convolution window


def exact_distribution(model, sampling: Sampling) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration with the model's own cache-free forward: array [V, V, V]."""
    return enumerate_law(model, S_PROMPT, sampling, S_VOCAB, S_NEW)


def sampled_counts(target, drafter, runs: int = S_RUNS, tree: Tree = TREES["uneven tree"]) -> np.ndarray:
    gen, counts = torch.Generator().manual_seed(0), np.zeros((S_VOCAB,) * S_NEW)
    for _ in range(runs):
        out = generate(target, S_PROMPT, drafter=drafter, tree=tree, max_new_tokens=S_NEW, temperature=1.0,
                       generator=gen)
        counts[tuple(out.sequences[0, S_PROMPT.shape[1]:].tolist())] += 1
    return counts


def check_sampling(name: str, runs: int = S_RUNS) -> float:
    """Sampled continuations (temperature 1, the noisy oracle's uneven tree) against the exact law: p-value."""
    target = build(name, vocab=S_VOCAB, hidden=32, init_std=0.3, seed=11)
    counts = sampled_counts(target, NoisyOracle(target, p=0.5), runs)
    return chi2_pvalue(counts, exact_distribution(target, Sampling(1.0)))


def cached_vs_full(name: str, prefix: int = 16, steps: int = 4) -> float:
    """max |logits of the model's own cached one-token decode − its cache-free forward| over ``steps`` tokens after
    ``prefix``: how far transformers' implementation agrees with itself (no decoder can equal both beyond it)."""
    target = build(name)
    ids = prompt(prefix + steps)
    with torch.no_grad():
        full = target(input_ids=ids).logits[:, prefix:]
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, :prefix], **cache_arg(cache), use_cache=True)
        stepped = torch.cat([target(input_ids=ids[:, i : i + 1], **cache_arg(cache), use_cache=True).logits
                             for i in range(prefix, prefix + steps)], dim=1)
    return float((stepped - full).abs().max())


def verification_cost(name: str, tree: str = "tree", repeats: int = 15, past: int = 64) -> tuple[float, float]:
    """(a verification pass over ``tree`` ÷ one one-token step, the same plus the replay of a path stopped at
    depth 1), medians of interleaved timings after ``past`` cached tokens."""
    target = build(name)
    check_rollback(target)
    shape = TREES[tree]
    ids = prompt(past)
    tokens = torch.randint(0, 64, (1, shape.num_nodes), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"step": [], "tree": [], "tree+replay": []}

    def fresh():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, **cache_arg(cache), use_cache=True)
        return cache

    def run(cache, feed):
        return target(input_ids=feed, **cache_arg(cache), use_cache=True)

    with torch.no_grad():
        for _ in range(repeats):
            cache = fresh()
            start = time.perf_counter()
            run(cache, tokens[:, :1])
            times["step"].append(time.perf_counter() - start)
            for label, replay in (("tree", False), ("tree+replay", True)):
                cache = fresh()
                verifier = TargetRows(target, cache)
                start = time.perf_counter()
                verifier.tree_pass(lambda feed, c=cache: (run(c, feed).logits, None), tokens, shape)
                verifier.keep(lambda feed, c=cache: run(c, feed), [0, 1] if replay else [0, *shape.leaf_paths[0]])
                times[label].append(time.perf_counter() - start)
    step = statistics.median(times["step"])
    return statistics.median(times["tree"]) / step, statistics.median(times["tree+replay"]) / step

