"""Each lossless rule's τ on sampled chains, predicted in closed form from drafts (what tree=auto chooses γ by).

For one chain draft x_1..x_D with the target's conditionals P_i and the drafter's Q_i after x_1..x_i
(P_0, Q_0 after the root), the number of draft tokens a rule accepts has a closed-form expectation *given
the draft*, over the verifier's coins alone. With r_i = P_{i−1}(x_i) / Q_{i−1}(x_i):

* token-level rejection (Leviathan et al. 2023, Algorithm 1; ``acceptance="rejection"``): x_i is accepted
  with min(1, r_i) once x_1..x_{i−1} were, so E[accepted | x, γ] = Σ_{i≤γ} Π_{j≤i} min(1, r_j).
* block verification (Sun, Mendlovic, Leviathan et al. 2024, "Block Verification Accelerates Speculative
  Decoding", Algorithm 2; ``acceptance="block"``, and "traversal", which is block verification on a chain):
  with w_0 = 1, w_i = min(1, w_{i−1} r_i) and, for i < γ, h_i = S_i / (S_i + 1 − w_i),
  S_i = Σ_v max(w_i P_i(v) − Q_i(v), 0), and h_γ = w_γ, the backward pass stops at the largest i whose
  coin succeeds (h_0 = 1), so E[accepted | x, γ] = Σ_{i≤γ} i · h_i · Π_{i<j≤γ}(1 − h_j).

Averaging either over drafts drawn as decoding draws them is an unbiased estimate of that rule's accepted
length (Rao-Blackwellised: the verifier's coins are integrated out, so it has less variance than counting
walks). Only h_γ depends on γ and the first γ tokens of a D-deep draft are a γ-deep draft, so one D-deep
draft per context predicts every chain γ = 0..D: with A_0 = 0 and A_k = A_{k−1}(1 − h_k) + k h_k,
E[accepted | x, γ] = A_{γ−1}(1 − w_γ) + γ w_γ. Deterministic candidates (top-k, ``q_draft`` None) are the
point mass Q_i = δ_{x_{i+1}}, their exact law given the context (treespec/walker_traversal.py).

``measure_chain_tau`` drafts those chains through the public Drafter interface (any drafter: draft model,
EAGLE, EAGLE-3), runs the target once over each, and returns τ = 1 + E[accepted] per rule and γ with its
standard error across contexts. Branching trees under traversal verification have no such closed form here.

A measurement is kept beside a trained drafter (``save_chain_tau``: chain_tau.json, one entry per sampling), or
measured on first use on the target's own sampled continuations of the prompt being decoded
(``measure_on_prompt``; heads.load_profile caches it, treespec/planning/profile_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from treespec.compat import cache_arg, prefill_kwargs
from treespec.drafter import Committed, Drafter, in_use, stack_features
from treespec.generate import decode
from treespec.io import atomic_write_json, read_measurements
from treespec.planning.autotree import ChainTable
from treespec.sampling import Sampling, probs
from treespec.tree import Tree
from treespec.walker_traversal import EMPTY_MASS

#: the rules with a closed form on chains, and the table each reads ("traversal" is "block" on a chain)
CHAIN_RULES = {"rejection": "rejection", "block": "block", "traversal": "block"}
CHAIN_TAU_FILE = "chain_tau.json"
DEPTH = 8  # the deepest chain measured (tree=auto chooses γ = 0..this)


def chain_ratios(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """r_i = P_{i−1}(x_i) / Q_{i−1}(x_i). p, q: [b, D+1, V] (row i: after x_1..x_i); tokens [b, D] → [b, D]
    (a token the drafter gave no mass, by rounding, counts as accepted: r = inf, as the walker decides)."""
    index = tokens[..., None]
    p_x = p[:, :-1].gather(-1, index)[..., 0]  # [b, D]
    q_x = q[:, :-1].gather(-1, index)[..., 0]  # [b, D]
    return torch.where(q_x > 0, p_x / q_x.clamp(min=1e-30), torch.full_like(p_x, math.inf))


def token_level_accepted(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """E[accepted draft tokens | draft] under token-level rejection for every γ: [b, D+1] (column γ)."""
    reach = chain_ratios(p, q, tokens).clamp(max=1.0).cumprod(-1)  # [b, D]: P(x_1..x_i all accepted)
    return torch.cat([reach.new_zeros(reach.shape[0], 1), reach.cumsum(-1)], dim=-1)


def block_accepted(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """E[accepted draft tokens | draft] under block verification for every γ: [b, D+1] (column γ); the
    walker's rounding conventions for an empty residual (walker_traversal.Mass.reject) are kept, so it is
    exactly the walker's expectation."""
    ratios = chain_ratios(p, q, tokens).double()  # [b, D]
    p, q = p.double(), q.double()
    b, depth = ratios.shape
    w = [ratios.new_ones(b)]  # w_0 = 1
    for i in range(depth):  # an unbounded ratio (q(x) = 0) accepts, whatever w is (no 0 · inf)
        w.append(torch.where(ratios[:, i].isinf(), 1.0, torch.minimum(w[-1] * ratios[:, i], ratios.new_ones(b))))
    # A_k: expected stop of the backward pass over 1..k when every h is a non-final one (h_k for k < γ)
    settled, out = ratios.new_zeros(b), [ratios.new_zeros(b)]
    for gamma in range(1, depth + 1):
        out.append(settled * (1 - w[gamma]) + gamma * w[gamma])
        if gamma < depth:
            left = (w[gamma][:, None] * p[:, gamma] - q[:, gamma]).clamp(min=0).sum(-1)  # [b]: S_γ
            h = left / (left + 1 - w[gamma]).clamp(min=1e-300)
            # the walker: an empty residual leaves a certain node (w ≈ 1) as it was and empties any other
            h = torch.where(left <= EMPTY_MASS, torch.where(w[gamma] >= 1 - EMPTY_MASS, w[gamma], 0.0), h)
            settled = settled * (1 - h) + gamma * h
    return torch.stack(out, dim=-1).to(p.dtype)  # [b, D+1]


ACCEPTED = {"rejection": token_level_accepted, "block": block_accepted}


@dataclass
class ChainTau:
    """Predicted τ (tokens per target pass: 1 + accepted) of chains γ = 0..D per rule, at ``sampling``."""

    sampling: Sampling
    tau: dict[str, list[float]]      # "rejection" / "block" → τ[γ]
    stderr: dict[str, list[float]]   # standard error of τ[γ] across the drafts
    drafts: int

    @classmethod
    def from_drafts(cls, p, q, tokens, sampling: Sampling) -> ChainTau:
        """p, q: [b, D+1, V] target and draft distributions along b drafted chains, tokens [b, D]."""
        tau, err = {}, {}
        for rule, accepted in ACCEPTED.items():
            x = 1.0 + accepted(p, q, tokens).double()  # [b, D+1]
            tau[rule] = x.mean(0).tolist()
            spread = x.std(0) if x.shape[0] > 1 else torch.full_like(x[0], math.nan)
            err[rule] = (spread / math.sqrt(x.shape[0])).tolist()
        return cls(sampling, tau, err, int(tokens.shape[0]))

    @classmethod
    def pooled(cls, parts: list[ChainTau]) -> ChainTau:
        """Measurements of disjoint drafts (same sampling and depth) as one."""
        n = sum(m.drafts for m in parts)
        tau = {r: [sum(m.tau[r][g] * m.drafts for m in parts) / n for g in range(len(parts[0].tau[r]))]
               for r in ACCEPTED}
        # Var of the pooled mean: Σ (n_k / n)² stderr_k², each part's own spread
        err = {r: [math.sqrt(sum((m.drafts / n * m.stderr[r][g]) ** 2 for m in parts)) for g in range(len(tau[r]))]
               for r in ACCEPTED}
        return cls(parts[0].sampling, tau, err, n)

    def source(self, rule: str, sampling: Sampling | None = None) -> ChainTable | None:
        """The auto chooser's τ source for ``rule`` (None: no closed form, e.g. typical acceptance). A
        ``sampling`` other than the measured one is refused: τ depends on the temperature and top-p."""
        if sampling is not None and sampling != self.sampling:
            raise ValueError(f"chain τ was measured at {self.sampling} and decoding runs at {sampling}: measure it "
                             "again at this sampling (treespec.planning.chain_tau.measure_chain_tau)")
        return ChainTable(self.tau[CHAIN_RULES[rule]], rule) if rule in CHAIN_RULES else None


@torch.no_grad()
def draft_chain(target, drafter: Drafter, contexts: torch.Tensor, depth: int, sampling: Sampling,
                generator: torch.Generator | None = None):
    """One ``depth``-deep chain per context [b, L] (its last token the root), drafted by ``drafter`` as generate()
    drafts it, and the target over it → (p [b, D+1, V], q [b, D+1, V], tokens [b, D]) on the host."""
    layers = tuple(drafter.feature_layers) if drafter.needs_features else ()
    prompt, root = contexts[:, :-1], contexts[:, -1:]  # what generate's prefill saw, and the token it committed
    cache = DynamicCache(config=target.config)
    out = target(input_ids=prompt, **cache_arg(cache), use_cache=True, output_hidden_states=bool(layers),
                 **prefill_kwargs(target))
    features = stack_features(out.hidden_states, layers) if layers else None  # [b, L-1, L·h]
    with in_use(drafter):
        drafter.reset()
        drafter.prefill(prompt, features, None)
        proposals = drafter.propose(Committed(contexts, [contexts.shape[1]] * contexts.shape[0]),
                                    None if features is None else features[:, -1], Tree.chain(depth), sampling,
                                    generator)
        drafter.reset()
    tokens = proposals.tokens.to(contexts.device)  # [b, D]
    logits = target(input_ids=torch.cat([root, tokens], dim=1), **cache_arg(cache), use_cache=True).logits
    p = probs(logits.float(), sampling).cpu()  # [b, D+1, V]
    if proposals.q_draft is None:  # deterministic candidates: the point mass at each drafted token
        q = torch.nn.functional.one_hot(tokens.cpu(), p.shape[-1]).to(p.dtype)
        q = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[-1])], dim=1)
    else:
        q = proposals.q_draft.float().cpu()
    return p, q, tokens.cpu()


def measure_chain_tau(target, drafter: Drafter, windows, *, depth: int, sampling: Sampling,
                      lead: int | list[int] = 16, cuts: int = 4, generator: torch.Generator | None = None) -> ChainTau:
    """Each rule's predicted τ for chains γ = 0..``depth`` (module docstring), from one sampled chain per context.

    ``windows``: held-out text the target wrote itself (train/training/data.py ``own_continuations``), one [n, S] tensor
    or a list of [1, S_i]; each window gives ``cuts`` contexts, its prefixes cut at evenly spaced lengths past
    its ``lead`` prompt tokens (one for all, or one per window: the text decoding would verify). Off the decoding
    path: one drafting call per depth and two target passes per batch of contexts."""
    windows = [windows] if isinstance(windows, torch.Tensor) else list(windows)
    leads = [lead] * len(windows) if isinstance(lead, int) else list(lead)
    pairs = list(zip(windows, leads, strict=True))
    try:
        drafter.check_batch(max(w.shape[0] for w in windows))
    except ValueError:  # a drafter that drafts one prompt at a time: one window after another
        pairs = [(row[None], n) for w, n in pairs for row in w]
    parts = []
    for batch, lead in pairs:
        length = batch.shape[1]
        first = min(max(2, lead + 1), length)
        for end in sorted({round(first + (length - first) * k / max(1, cuts - 1)) for k in range(cuts)}):
            parts.append(ChainTau.from_drafts(*draft_chain(target, drafter, batch[:, :end], depth, sampling,
                                                           generator), sampling))
    if not parts:
        raise ValueError("no held-out window to draft chains on")
    return ChainTau.pooled(parts)


# -- kept and measured on first use ----------------------------------------------------------------------------
def record(measured: ChainTau, **about) -> dict:
    """``measured`` as JSON: its sampling, τ and standard errors per rule, drafts, and ``about``."""
    return {"sampling": asdict(measured.sampling), "tau": measured.tau, "stderr": measured.stderr,
            "drafts": measured.drafts, **about}


def from_record(data: dict) -> ChainTau:
    try:
        return ChainTau(Sampling(**data["sampling"]), {r: [float(t) for t in v] for r, v in data["tau"].items()},
                        {r: [float(t) for t in v] for r, v in data["stderr"].items()}, int(data["drafts"]))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"a chain τ record holds sampling, tau, stderr and drafts ({type(err).__name__}: {err})") \
            from None


def save_chain_tau(folder, measured: list[ChainTau], **about) -> Path:
    """Write ``measured`` (one per sampling) to ``folder``/chain_tau.json, beside a drafter's weights."""
    return atomic_write_json(Path(folder) / CHAIN_TAU_FILE, {"measurements": [record(m, **about) for m in measured]},
                             indent=1)


def read_chain_tau(folder) -> list[ChainTau]:
    """The measurements ``save_chain_tau`` wrote in ``folder`` (none: [])."""
    return read_measurements(Path(folder) / CHAIN_TAU_FILE, "chain τ file", from_record)


def at_sampling(measured: list[ChainTau], sampling: Sampling) -> ChainTau | None:
    """The measurement at ``sampling`` (τ depends on the temperature and top-p), or None."""
    return next((m for m in measured if m.sampling == sampling), None)


def measure_on_prompt(target, drafter: Drafter, prompt: torch.Tensor, sampling: Sampling, *, depth: int = DEPTH,
                      continuations: int = 4, new_tokens: int = 48, seed: int = 0) -> ChainTau:
    """Each rule's chain τ on the target's own continuations of ``prompt`` [1, P]: ``continuations`` of
    ``new_tokens`` sampled at ``sampling`` (what verification sees after it), each cut at a few lengths; chains
    γ = 0..``depth`` (no deeper than the drafter fills)."""
    if sampling.greedy:
        raise ValueError("chain τ is for sampled candidates: measure it at a temperature above 0")
    depth = min(depth, drafter.max_tree_depth or depth)
    gen = torch.Generator().manual_seed(seed)
    # the loop itself, not the public generate(): this runs while a generate() call plans, before its decoding
    windows = [decode(target, prompt, max_new_tokens=new_tokens, temperature=sampling.temperature,
                      top_p=sampling.top_p, generator=gen).sequences for _ in range(continuations)]
    return measure_chain_tau(target, drafter, windows, depth=depth, sampling=sampling, lead=prompt.shape[1],
                             generator=gen)
