"""The one decoding loop: prefill → draft → verify → commit.

    prefill   target(prompt)                         → first token (the root of step 1); drafter.prefill
    draft     drafter.propose(committed, feature)    → candidate tree (tokens, q_draft)
    verify    target([root] + tree, tree mask)       → logits at every node, one pass
              walk(logits, proposal)                 → accepted path + next token
    commit    keep_tree_path(cache); drafter.accept  → caches hold prefix + accepted path

Invariant between steps: the target's cache holds every committed token except the last one, the
root, which is fed at the start of the next verification pass. ``drafter=None`` runs the same loop
with an empty tree: plain autoregressive decoding, the baseline every speedup is measured against.

What one sequence carries from step to step is a ``DecodeState``; what stays fixed for the call is a
``Run``. Timing is an optional observer (treespec/timing.py): without one the loop never waits for the
device.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from treespec.attention import TreeAttention
from treespec.cache import TreeCache, check_filled, keep_tree_path
from treespec.compat import cache_arg
from treespec.drafter import Drafter, Proposal, stack_features
from treespec.dynamic_tree import DynamicTree
from treespec.inputs import check_inputs
from treespec.sampling import Sampling, argmax, probs, sample
from treespec.timing import DRAFT, TARGET, StepTimer, clock, timed
from treespec.tree import Tree
from treespec.verify import Walk, walk

NO_CANDIDATES = torch.empty(0, dtype=torch.long)  # a plain step's proposal: the root alone


@dataclass
class GenerationResult:
    sequences: torch.Tensor                          # LongTensor [1, prompt + new]
    prompt_length: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification pass
    wall_time: float = 0.0                           # seconds, prefill included
    target_time: float = 0.0                         # seconds inside target forwards (with an observer)
    draft_time: float = 0.0                          # seconds inside drafter calls (with an observer)

    @property
    def target_passes(self) -> int:
        """Verification passes (the prefill, which commits the first token, is not counted)."""
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """τ: mean tokens committed per verification pass, bonus token included."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def overhead_time(self) -> float:
        """Seconds spent outside target and drafter calls: masks, walking, cache compaction, glue."""
        return self.wall_time - self.target_time - self.draft_time


@dataclass(frozen=True)
class Run:
    """What stays fixed during one generate() call (checked by treespec/inputs.py)."""

    target: torch.nn.Module
    drafter: Drafter | None             # None: plain decoding (no drafter, or an empty tree)
    tree: Tree | DynamicTree            # the tree every step verifies, truncated near the end
    sampling: Sampling
    acceptance: str
    generator: torch.Generator | None
    eos: frozenset[int]
    observer: StepTimer | None          # timing, only when asked for
    feature_layers: tuple[int, ...]     # the target hidden states the drafter takes; () for none


@dataclass
class DecodeState:
    """What decoding one sequence carries from step to step (the batch issue makes these per row)."""

    sequence: torch.Tensor              # LongTensor [1, P + max_new_tokens]: the prompt, then committed tokens
    length: int                         # tokens committed, prompt included; sequence[0, length − 1] is the root
    end: int                            # P + max_new_tokens: no token is committed at or after it
    root: int                           # the root token, on the host (eos tests)
    cache: TreeCache                    # the target's: every committed token but the root
    attention: TreeAttention            # the verification passes' masks, with parts kept across steps
    features: torch.Tensor | None       # [1, n, L·h]: target hidden states at the last tokens committed
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification pass

    @property
    def feature(self) -> torch.Tensor | None:
        """[1, L·h]: the target's hidden state that produced the root (a feature drafter's input)."""
        return None if self.features is None else self.features[:, -1]


def prefill_kwargs(target) -> dict:
    """``logits_to_keep=1`` where the model's forward takes it (transformers' causal LMs), else nothing."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


@torch.no_grad()
def generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter=None,
    tree: Tree | DynamicTree | dict | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    acceptance: str = "rejection",
    observer: StepTimer | None = None,
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``input_ids`` [1, P] with tree speculation.

    ``tree`` is the candidate tree: a Tree, a DynamicTree or a tree-spec dict (default: the drafter's
    ``default_tree``). Every argument is checked first (treespec/inputs.py). ``acceptance`` is
    "rejection" (lossless: greedy at temperature 0, rejection sampling otherwise) or "typical"
    (Medusa's typical acceptance: faster, NOT lossless). ``observer`` (a ``treespec.timing.StepTimer``)
    fills the result's target and draft times; ``wall_time`` is always measured.
    """
    inputs = check_inputs(target, input_ids, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, generator=generator,
                          acceptance=acceptance, observer=observer)
    uses_features = inputs.drafter is not None and inputs.drafter.needs_features
    run = Run(target, inputs.drafter, inputs.tree, inputs.sampling, acceptance, generator, inputs.eos, observer,
              feature_layers=tuple(inputs.drafter.feature_layers) if uses_features else ())
    start = clock(observer)
    state = prefill(run, inputs.input_ids, inputs.max_new_tokens)
    while state.root not in run.eos and state.length < state.end:
        step_tree = run.tree.truncate(state.end - state.length - 1)  # deeper nodes could never be committed
        if run.drafter is None or len(step_tree) == 0:
            plain_step(run, state, step_tree)
        else:
            speculative_step(run, state, step_tree)
    wall_time = clock(observer) - start
    spent = {} if observer is None else observer.seconds
    return GenerationResult(sequences=state.sequence[:, : state.length], prompt_length=inputs.input_ids.shape[1],
                            accept_lengths=state.accept_lengths, wall_time=wall_time,
                            target_time=spent.get(TARGET, 0.0), draft_time=spent.get(DRAFT, 0.0))


def prefill(run: Run, input_ids: torch.Tensor, max_new_tokens: int) -> DecodeState:
    """The target over the prompt [1, P], whose last logits choose the first token (the first root); then the
    drafter sees the prompt."""
    prompt_len = input_ids.shape[1]
    sequence = torch.empty(1, prompt_len + max_new_tokens, dtype=torch.long, device=input_ids.device)  # [1, L_max]
    sequence[:, :prompt_len] = input_ids
    cache = TreeCache(run.target.config)  # sliding-window layers too can be rolled back (treespec/cache.py)
    # only the last position's logits are needed (a full-prompt [P, V] projection costs as much as a few steps)
    logits, features = forward(run, cache, input_ids, **prefill_kwargs(run.target))  # features: [1, P, L·h]
    check_filled(cache, prompt_len, run.target)
    p_target = probs(logits[0, -1], run.sampling)  # [V]
    root = int(argmax(p_target) if run.sampling.greedy else sample(p_target, run.generator))
    sequence[0, prompt_len] = root
    if run.drafter is not None:
        with timed(run.observer, DRAFT):
            run.drafter.reset()
            run.drafter.prefill(input_ids, features)
    return DecodeState(sequence, prompt_len + 1, prompt_len + max_new_tokens, root, cache,
                       TreeAttention(run.target, cache), features)


def plain_step(run: Run, state: DecodeState, tree: Tree) -> None:
    """One pass over the root alone (no drafter, or no depth left to draft): one token."""
    proposal = Proposal(tree, NO_CANDIDATES)
    accepted, features = verify(run, state, proposal)
    commit(run, state, proposal, accepted, features)


def speculative_step(run: Run, state: DecodeState, tree: Tree | DynamicTree) -> None:
    """Draft a tree, verify it in one pass, commit the accepted path; the drafter then sees what was kept."""
    with timed(run.observer, DRAFT):  # the committed sequence ends with the root
        proposal = run.drafter.propose(state.sequence[:, : state.length], state.feature, tree, run.sampling,
                                       run.generator)
    accepted, features = verify(run, state, proposal)
    commit(run, state, proposal, accepted, features)
    with timed(run.observer, DRAFT):
        run.drafter.accept(accepted.path, state.features)


def verify(run: Run, state: DecodeState, proposal: Proposal) -> tuple[Walk, torch.Tensor | None]:
    """One target pass over the root and every candidate, and the walk over its logits → (the accepted path and
    next token, the target's hidden states at every node [1, N, L·h] or None)."""
    past = state.length - 1  # the root's position: the cache holds everything before it
    tokens = torch.cat([state.sequence[0, past : state.length], proposal.tokens.to(state.sequence.device)])  # [N]
    logits, features = forward(run, state.cache, tokens[None], **state.attention(proposal.tree, past))  # [1, N, V]
    return walk(logits[0], proposal, run.sampling, acceptance=run.acceptance, generator=run.generator), features


def commit(run: Run, state: DecodeState, proposal: Proposal, accepted: Walk, features: torch.Tensor | None) -> None:
    """Append the accepted path's tokens and the next token (up to the end and the first eos); keep the cache
    entries and the hidden states of the root and the accepted nodes."""
    # host lists: a handful of tiny tensor ops per step costs more than the lists
    path = accepted.path.tolist()  # accepted nodes in depth order, root excluded
    keep = [0, *path]  # tree-node offsets the caches keep, root first
    keep_tree_path(state.cache, state.length - 1, keep)
    drafted = proposal.tokens.tolist()
    new = until_eos([drafted[i - 1] for i in path] + [accepted.next_token], run.eos)[: state.end - state.length]
    state.sequence[0, state.length : state.length + len(new)] = torch.tensor(new, device=state.sequence.device)
    state.length += len(new)
    state.root = new[-1]
    state.accept_lengths.append(len(new))
    state.features = kept_rows(features, keep)  # [1, k + 1, L·h]: the root's, then the accepted nodes'


def forward(run: Run, cache: TreeCache, input_ids: torch.Tensor, **mask_inputs):
    """The target over ``input_ids`` [1, n] after what ``cache`` holds → (logits [1, n or 1, V], the drafter's
    features [1, n, L·h] or None)."""
    with timed(run.observer, TARGET):
        out = run.target(input_ids=input_ids, **cache_arg(cache), use_cache=True,
                         output_hidden_states=bool(run.feature_layers), **mask_inputs)
    return out.logits, stack_features(out.hidden_states, run.feature_layers) if run.feature_layers else None


def until_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def kept_rows(features: torch.Tensor | None, keep: list[int]) -> torch.Tensor | None:
    """features [1, N, L·h] → the rows of the tree nodes ``keep`` [1, k, L·h]: a chain prefix is a view, anything
    else a gather."""
    if features is None:
        return None
    if keep == list(range(len(keep))):
        return features[:, : len(keep)]
    return features[:, torch.tensor(keep, device=features.device)]
