"""The one decoding loop: prefill → draft → target pass → commit, over a batch of rows (one prompt: b = 1).

    prefill       target(prompts)                        → each row's first token (its root); drafter.prefill
    draft         drafter.propose(committed, feature)    → each row's candidate tree (tokens, q_draft)
    target_pass   target([root] + tree, tree mask)       → logits at every node of every row, one pass
                  walk_rows(logits, proposals)           → each row's accepted path + next token, on the
                                                           device, read back once: the step's one host read
    commit        RowSlots.keep(cache); drafter.accept   → caches hold each row's prefix + accepted path
    retire        rows at eos or at their budget leave the batch (target cache, slots, drafter.keep_rows)

Invariant between steps: the target's cache holds every committed token of a row except its last one,
the root, which is fed at the start of the next verification pass. Rows accept different numbers of
tokens, so they grow at different rates on one shared slot axis (treespec/cache.py, "A batch of rows";
treespec/rows.py). ``drafter=None`` runs the same loop with an empty tree: plain autoregressive decoding,
the baseline every speedup is measured against (batched vanilla decoding for a batch).

What the rows carry from step to step is a ``DecodeState``; what stays fixed for the call is a ``Run``.
Timing is an optional observer (treespec/timing.py): without one the loop waits for the device once a step, when
it reads the accepted tokens back (treespec/host_reads.py counts the reads; docs/design.md, "Host reads per
step"); the rest of what it keeps on the host is bookkeeping it already knows.

The loop runs a resolved tree (``decode``): it never imports treespec/planning/, which turns tree specs into trees
and measures what they need (chain τ, costs) by decoding itself. The public ``treespec.generate`` plans first, then
calls ``decode`` (docs/design.md, "Planning apart from decoding").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from treespec.cache import TreeCache, decoding_cache
from treespec.compat import cache_arg, prefill_kwargs
from treespec.drafter import Committed, Drafter, Proposals, in_use, stack_features
from treespec.dynamic_tree import DynamicTree
from treespec.inputs import Inputs, check_inputs
from treespec.layer_types import check_filled, is_hybrid
from treespec.recurrent import TargetRows
from treespec.result import GenerationResult, RowResult
from treespec.rows import RowSlots, gather_last, gather_positions, right_aligned
from treespec.sampling import Sampling, argmax, probs, sample
from treespec.static_pass import StaticPass, compiled_steps, static_capacity, target_body
from treespec.timing import DRAFT, TARGET, UPDATE, WALK, StepTimer, clock, timed
from treespec.tree import Tree
from treespec.visibility import TreeAttention
from treespec.walker import walk_rows
from treespec.walker_batch import Accepted, accepted

__all__ = ["GenerationResult", "RowResult", "decode"]


@dataclass(frozen=True)
class Run:
    """What stays fixed during one decode() call (checked by treespec/inputs.py)."""

    target: torch.nn.Module
    drafter: Drafter | None             # None: plain decoding (no drafter, or an empty tree)
    tree: Tree | DynamicTree            # the tree every step verifies, truncated near the end
    sampling: Sampling
    acceptance: str
    generator: torch.Generator | None
    eos: frozenset[int]
    observer: StepTimer | None          # timing, only when asked for
    feature_layers: tuple[int, ...]     # the target hidden states the drafter takes; () for none
    static: StaticPass | None = None    # the target's tree pass compiled as a static graph (compile=True), or None
    whole_trees: bool = False           # the last steps verify the whole tree too (step_tree_of)


@dataclass
class DecodeState:
    """What decoding a batch carries from step to step. Lists and tensors are over the rows still decoding,
    in order; ``rows`` maps them to the prompts, and a finished row's tokens move to ``done``."""

    rows: list[int]                     # the prompt each row decodes
    tokens: torch.Tensor                # LongTensor [b, L]: row b's committed tokens (its prompt without padding,
    #                                     then generated ones) in its first lengths[b] entries, the root last
    lengths: list[int]                  # tokens committed per row, prompt included
    ends: list[int]                     # prompt + max_new_tokens: no token of a row is committed at or after it
    roots: list[int]                    # each row's root token, on the host (eos tests; on the device: tokens)
    cache: TreeCache | DynamicCache     # the target's: every committed token of a row but its root
    slots: RowSlots                     # which of the cache's slots hold each row's tokens
    attention: TreeAttention            # the verification passes' masks, with parts kept across steps
    recurrent: TargetRows | None        # a hybrid target's passes (treespec/recurrent.py), else None
    features: torch.Tensor | None       # [b, k, L·h]: target hidden states at the last tokens each row committed
    feature_counts: list[int]           # row b's entries of ``features`` (the root's feature is the last)
    accept_lengths: list[list[int]]     # per prompt: tokens committed per verification pass
    done: dict[int, torch.Tensor] = field(default_factory=dict)  # prompt → its committed tokens, once finished
    passes: int = 0                     # batched verification passes

    @property
    def committed(self) -> Committed:
        return Committed(self.tokens, self.lengths)

    @property
    def feature(self) -> torch.Tensor | None:
        """[b, L·h]: the target's hidden state that produced each root (a feature drafter's input)."""
        return None if self.features is None else gather_last(self.features, self.feature_counts)


@torch.no_grad()
def decode(
    target,
    input_ids,
    *,
    attention_mask: torch.Tensor | None = None,
    drafter=None,
    tree: Tree | DynamicTree | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | torch.Tensor | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    acceptance: str = "rejection",
    observer: StepTimer | None = None,
    compile: bool | dict = False,
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after each prompt with tree speculation, verifying ``tree``: a Tree or a
    DynamicTree, resolved already (None: the drafter's ``default_tree``). The public ``treespec.generate`` takes
    the same arguments, also a tree-spec dict and a ``profile``: it resolves the spec first
    (treespec/planning/resolve.py, which documents every argument) and then calls this. Nothing here plans or
    measures, so a measurement that decodes (a chain τ, a cost) calls this directly and no decoding ever runs inside
    another. Every argument is checked first (treespec/inputs.py)."""
    inputs = check_inputs(target, input_ids, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, generator=generator,
                          acceptance=acceptance, observer=observer, attention_mask=attention_mask,
                          pad_token_id=pad_token_id, compile=compile)
    uses_features = inputs.drafter is not None and inputs.drafter.needs_features
    feature_layers = tuple(inputs.drafter.feature_layers) if uses_features else ()
    # a static pass's cache slots: the prompts, every new token and one tree pass, rounded up so that prompts of
    # similar lengths share graphs (a ragged batch may still outgrow them)
    capacity = static_capacity(inputs.input_ids.shape[1] + inputs.max_new_tokens + inputs.tree.num_nodes)
    static = None if inputs.compile is None else \
        StaticPass(target_body, inputs.compile, target, feature_layers, capacity=capacity)
    run = Run(target, inputs.drafter, inputs.tree, inputs.sampling, acceptance, generator, inputs.eos, observer,
              feature_layers, static, inputs.whole_trees)
    start = clock(observer)
    # one generation at a time per drafter (it holds the rows' state); with compile, its depth steps compiled too
    with in_use(run.drafter), compiled_steps(run.drafter, inputs.compile, capacity):
        state = prefill(run, inputs)
        prefill_parts = {} if observer is None else dict(observer.seconds)  # kept out of the per-pass split
        prefill_time = clock(observer) - start
        retire(run, state)
        while state.rows:
            step_tree = step_tree_of(run, state)
            if run.drafter is None or len(step_tree) == 0:
                plain_step(run, state, step_tree)
            else:
                speculative_step(run, state, step_tree)
            retire(run, state)
    sequences, rows = outputs(inputs, state)
    wall_time = clock(observer) - start
    spent = {} if observer is None else observer.seconds
    return GenerationResult(sequences=sequences, prompt_length=inputs.given.shape[1],
                            accept_lengths=[n for row in rows for n in row.accept_lengths], wall_time=wall_time,
                            target_time=spent.get(TARGET, 0.0),
                            draft_time=spent.get(DRAFT, 0.0) + spent.get(UPDATE, 0.0),
                            update_time=spent.get(UPDATE, 0.0), walk_time=spent.get(WALK, 0.0), rows=rows,
                            passes=state.passes, tree=inputs.tree, prefill_time=prefill_time,
                            prefill_target_time=prefill_parts.get(TARGET, 0.0),
                            prefill_draft_time=prefill_parts.get(DRAFT, 0.0))


def prefill(run: Run, inputs: Inputs) -> DecodeState:
    """The target over the prompts [b, P], whose last logits choose each row's first token (its first root);
    then the drafter sees the prompts."""
    input_ids, mask, lengths = inputs.input_ids, inputs.attention_mask, inputs.prompt_lengths
    batch, width = input_ids.shape
    device = input_ids.device
    # sliding-window layers too can be rolled back (treespec/cache.py); a hybrid's recurrent layers keep
    # transformers' own cache layers, verified by treespec/recurrent.py
    hybrid = is_hybrid(run.target.config)
    cache = decoding_cache(run.target.config)
    # only the last position's logits are needed (a full-prompt [P, V] projection costs as much as a few steps)
    kwargs = prefill_kwargs(run.target)
    if mask is not None:  # left padding: transformers' own padding mask and positions (a row counts from 0)
        kwargs.update(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    logits, features = forward(run, cache, input_ids, **kwargs)  # features: [b, P, L·h]
    check_filled(cache, width, run.target)
    slots = RowSlots(batch, device)
    slots.append_prompts(mask, width)
    p_target = probs(logits[:, -1], run.sampling)  # [b, V]
    roots = argmax(p_target) if run.sampling.greedy else sample(p_target, run.generator)  # [b]
    tokens = torch.zeros(batch, max(lengths) + inputs.max_new_tokens, dtype=torch.long, device=device)  # [b, L_max]
    tokens[:, : max(lengths)] = right_aligned(input_ids, lengths)
    tokens[torch.arange(batch, device=device), torch.tensor(lengths, device=device)] = roots.to(device)
    if run.drafter is not None:
        with timed(run.observer, DRAFT):
            run.drafter.reset()
            run.drafter.prefill(input_ids, features, mask)
    feature_counts = [width] * batch  # the prompts' last features produced the roots (left padding)
    ends = [n + inputs.max_new_tokens for n in lengths]
    attention = TreeAttention(run.target, cache, explicit=run.static is not None)  # a static pass: masks always
    return DecodeState(list(range(batch)), tokens, [n + 1 for n in lengths], ends, roots.tolist(), cache, slots,
                       attention, TargetRows(run.target, cache) if hybrid else None,
                       features, feature_counts, [[] for _ in range(batch)])


def step_tree_of(run: Run, state: DecodeState) -> Tree | DynamicTree:
    """The tree a step verifies: without nodes deeper than any row can still commit (a shallower row's commit stops
    at its end), or under a static pass the whole tree, which keeps its graph (the commit stops at the end all the
    same, and inputs.py checks that the deepest positions stay in range)."""
    if run.whole_trees:
        return run.tree
    return run.tree.truncate(max(e - n for e, n in zip(state.ends, state.lengths, strict=True)) - 1)


def plain_step(run: Run, state: DecodeState, tree: Tree) -> None:
    """One pass over each row's root alone (no drafter, or no depth left to draft): one token per row."""
    proposals = Proposals.shared(tree, state.tokens.new_empty(len(state.rows), 0))
    commit(run, state, *target_pass(run, state, proposals))


def speculative_step(run: Run, state: DecodeState, tree: Tree | DynamicTree) -> None:
    """Draft each row's tree, verify them in one pass, commit each row's accepted path; the drafter then sees
    what was kept."""
    with timed(run.observer, DRAFT):  # each row's committed tokens end with its root
        proposals = run.drafter.propose(state.committed, state.feature, tree, run.sampling, run.generator)
    rows, committed, features = target_pass(run, state, proposals)
    commit(run, state, rows, committed, features)
    with timed(run.observer, UPDATE):
        run.drafter.accept([torch.tensor(row.path, dtype=torch.long) for row in rows], state.features)


def check_draft_finite(run: Run, state: DecodeState, rows: list[Accepted]) -> None:
    """Refuse, at the step that meets it, a q_draft holding NaN or inf when sampling (flagged in the step's one host
    read): rejection sampling against it does not give the target's distribution (it once decoded on, with a
    warning at the end). Greedy verification reads no q."""
    if any(row.flags and row.flags[0] for row in rows):
        raise ValueError(f"{type(run.drafter).__name__} proposed draft probabilities (q_draft) holding NaN or inf at "
                         f"verification pass {state.passes + 1} (temperature {run.sampling.temperature}): the output "
                         "would not follow the target's distribution; check the drafter's weights (NaN?) and dtype")


def target_pass(run: Run, state: DecodeState, proposals: Proposals
                ) -> tuple[list[Accepted], torch.Tensor, torch.Tensor | None]:
    """One target pass over every row's root and candidates, and the walk over each row's logits → (each row's
    accepted path and committed tokens, read back at once; those tokens on the device [b, D + 1]; the target's
    hidden states at every node [b, N, L·h] or None)."""
    device = state.tokens.device
    tokens = torch.cat([last_tokens(state), proposals.tokens.to(device)], dim=1)  # [b, N]
    if state.recurrent is not None:  # a hybrid: root-to-leaf paths as rows (one prompt)
        logits, features = state.recurrent.tree_pass(lambda ids: forward(run, state.cache, ids), tokens,
                                                     proposals.trees[0])
    elif run.static is not None:  # one static graph per tree shape
        masked = state.attention(proposals, state.slots)  # explicit mask and positions, chains too
        with timed(run.observer, TARGET):
            logits, features = run.static(state.cache, masked["attention_mask"], masked["position_ids"], tokens)
    else:
        logits, features = forward(run, state.cache, tokens, **state.attention(proposals, state.slots))  # [b, N, V]
    if run.drafter is not None and run.drafter.observes_logits:  # every node's logits, rejected ones' too
        with timed(run.observer, UPDATE):
            run.drafter.observe_pass(tokens, proposals.trees, logits)
    with timed(run.observer, WALK):
        # every row on the device, with its draws from the one generator; a q_draft holding NaN/inf is flagged
        verdicts = walk_rows(logits, proposals, run.sampling, acceptance=run.acceptance, generator=run.generator)
        flags = () if proposals.q_draft is None or run.sampling.greedy else (
            (~torch.isfinite(proposals.q_draft)).flatten(1).any(-1),)
        rows = accepted(verdicts.packed(*flags).tolist(), run.sampling, len(flags))  # the step's one host read
    check_draft_finite(run, state, rows)
    return rows, verdicts.tokens, features


def commit(run: Run, state: DecodeState, rows: list[Accepted], committed: torch.Tensor,
           features: torch.Tensor | None) -> None:
    """Append each row's accepted path's tokens and its next token (up to its end and its first eos: ``rows``, on
    the host; ``committed`` [b, D + 1], the same tokens on the device, is what is copied); keep the cache entries
    and the hidden states of each row's root and accepted nodes."""
    keeps = []
    for b, row in enumerate(rows):
        keeps.append([0, *row.path])  # tree-node offsets the caches keep, root first
        new = until_eos(row.tokens, run.eos)[: state.ends[b] - state.lengths[b]]
        length = state.lengths[b]
        state.tokens[b, length : length + len(new)] = committed[b, : len(new)]  # device to device: no upload
        state.lengths[b] += len(new)
        state.roots[b] = new[-1]
        state.accept_lengths[state.rows[b]].append(len(new))
    if state.recurrent is not None:
        state.recurrent.keep(lambda ids: replay(run, state.cache, ids), keeps[0])
        state.slots.append(len(keeps[0]))
    else:
        state.slots.keep(state.cache, keeps)
    state.features = kept_entries(features, keeps)  # [b, 1 + k_max, L·h]: each row's root's, then its accepted nodes'
    state.feature_counts = [len(keep) for keep in keeps]
    state.passes += 1


def last_tokens(state: DecodeState) -> torch.Tensor:
    """LongTensor [b, 1]: each row's root, from its committed tokens on the device."""
    first = state.lengths[0]
    if all(n == first for n in state.lengths):
        return state.tokens[:, first - 1 : first]
    return state.tokens.gather(1, torch.tensor(state.lengths, device=state.tokens.device)[:, None] - 1)


def retire(run: Run, state: DecodeState) -> None:
    """Rows whose root is an eos or that reached their budget leave the batch: their tokens move to
    ``state.done``, and the target's cache, the slots, the features and the drafter keep the other rows."""
    finished = [b for b, (root, n, end) in enumerate(zip(state.roots, state.lengths, state.ends, strict=True))
                if root in run.eos or n >= end]
    if not finished:
        return
    for b in finished:
        state.done[state.rows[b]] = state.tokens[b, : state.lengths[b]]
    keep = [b for b in range(len(state.rows)) if b not in finished]
    if not keep:
        state.rows = []
        return
    rows = torch.tensor(keep)  # on the host: who reads it (the slots, a drafter's row lists) waits for nothing
    state.slots.select(rows, state.cache)
    state.tokens = state.tokens.index_select(0, rows.to(state.tokens.device))
    if state.features is not None:
        state.features = state.features.index_select(0, rows.to(state.features.device))
    for name in ("rows", "lengths", "ends", "roots", "feature_counts"):
        values = getattr(state, name)
        setattr(state, name, [values[b] for b in keep])
    if run.drafter is not None:
        with timed(run.observer, DRAFT):
            run.drafter.keep_rows(rows)


def outputs(inputs: Inputs, state: DecodeState) -> tuple[torch.Tensor, list[RowResult]]:
    """(sequences [b, P + T] as transformers' generate returns them: the prompts as given, each row's new tokens,
    the pad id after a row's eos up to T, the longest row's new tokens; each row's RowResult)."""
    given = inputs.given.to(inputs.input_ids.device)
    new = [state.done[r][n:] for r, n in enumerate(inputs.prompt_lengths)]
    sequences = torch.full((given.shape[0], given.shape[1] + max(len(t) for t in new)), inputs.pad_token_id,
                           dtype=torch.long, device=given.device)
    sequences[:, : given.shape[1]] = given
    for r, tokens in enumerate(new):
        sequences[r, given.shape[1] : given.shape[1] + len(tokens)] = tokens
    rows = [RowResult(n, len(t), lengths) for n, t, lengths in zip(inputs.prompt_lengths, new, state.accept_lengths,
                                                                   strict=True)]
    return sequences, rows


def forward(run: Run, cache: TreeCache, input_ids: torch.Tensor, **mask_inputs):
    """The target over ``input_ids`` [b, n] after what ``cache`` holds → (logits [b, n or 1, V], the drafter's
    features [b, n, L·h] or None)."""
    with timed(run.observer, TARGET):
        out = run.target(input_ids=input_ids, **cache_arg(cache), use_cache=True,
                         output_hidden_states=bool(run.feature_layers), **mask_inputs)
    return out.logits, stack_features(out.hidden_states, run.feature_layers) if run.feature_layers else None


def replay(run: Run, cache, input_ids: torch.Tensor) -> None:
    """The target over ``input_ids`` [1, n] after what ``cache`` holds, for its state only (a hybrid's replay of
    the accepted path: treespec/recurrent.py)."""
    with timed(run.observer, TARGET):
        run.target(input_ids=input_ids, **cache_arg(cache), use_cache=True, **prefill_kwargs(run.target))


def until_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def kept_entries(features: torch.Tensor | None, keeps: list[list[int]]) -> torch.Tensor | None:
    """features [b, N, L·h] → each row's entries at its tree nodes ``keeps[b]``, first [b, max len, L·h] (a shorter
    row's tail repeats its last): a view when every row keeps a chain prefix, else a gather."""
    if features is None:
        return None
    width = max(len(keep) for keep in keeps)
    if all(keep == list(range(len(keep))) for keep in keeps):
        return features[:, :width]
    if all(keep == keeps[0] for keep in keeps[1:]):
        return features[:, torch.tensor(keeps[0], device=features.device)]
    index = torch.tensor([keep + keep[-1:] * (width - len(keep)) for keep in keeps], device=features.device)
    return gather_positions(features, index)
