"""The one decoding loop: prefill → draft → target pass → commit, over a batch of rows (one prompt: b = 1).

    prefill       target(prompts)                        → each row's first token (its root); drafter.prefill
    draft         drafter.propose(committed, feature)    → each row's candidate tree (tokens, q_draft)
    target_pass   run.passes.verify([root] + tree)       → logits at every node of every row, one pass
                  walk_rows(logits, proposals)           → each row's accepted path + next token, walked on the
                                                           device and read back once: the step's one host read
    commit        rows.commit; run.passes.keep           → caches hold each row's prefix + accepted path
                  drafter.accept
    retire        rows.retire; drafter.keep_rows         → rows at eos or at their budget leave the batch

Invariant between steps: the target's cache holds every committed token of a row except its last one,
the root, which is fed at the start of the next verification pass. Rows accept different numbers of
tokens, so they grow at different rates on one shared slot axis (treespec/cache.py, "A batch of rows").
``drafter=None`` runs the same loop with an empty tree: plain autoregressive decoding, the baseline every speedup
is measured against (batched vanilla decoding for a batch).

What the rows carry from step to step has one owner, a ``BatchRows`` (treespec/rows.py: each row's tokens and
bookkeeping, the target's features and the target cache's slots, committed and selected as one); what stays fixed
for the call is a ``Run``, whose ``passes`` (treespec/target_passes.py: eager, static or a hybrid's path rows) is
chosen once, before the prefill. Timing is an optional observer (treespec/timing.py): without one the loop waits for
the device once a step, when it reads the accepted tokens back (treespec/host_reads.py counts the reads;
docs/design.md, "Host reads per step"); the rest of what it keeps on the host is bookkeeping it already knows.

The loop runs a resolved tree (``decode``): it never imports treespec/planning/, which turns tree specs into trees
and measures what they need (chain τ, costs) by decoding itself. The public ``treespec.generate`` plans first, then
calls ``decode`` (docs/design.md, "Planning apart from decoding").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.batch_trees import TreesByBatch
from treespec.cache import decoding_cache
from treespec.compat import prefill_kwargs
from treespec.drafter import Drafter, Proposals, in_use
from treespec.dynamic_tree import DynamicTree
from treespec.inputs import Inputs, check_inputs
from treespec.layer_types import check_filled
from treespec.result import GenerationResult, RowResult
from treespec.rows import BatchRows, RowSlots, left_aligned
from treespec.sampling import Sampling, argmax, probs, sample
from treespec.static_pass import StaticPass, compiled_steps, static_capacity, target_body
from treespec.target_passes import TargetPasses, target_passes
from treespec.timing import DRAFT, TARGET, UPDATE, WALK, StepTimer, clock, timed
from treespec.tree import Tree
from treespec.walker import walk_rows
from treespec.walker_batch import Walked

__all__ = ["GenerationResult", "RowResult", "decode"]


@dataclass(frozen=True)
class Run:
    """What stays fixed during one decode() call (checked by treespec/inputs.py)."""

    target: torch.nn.Module
    drafter: Drafter | None             # None: plain decoding (no drafter, or an empty tree)
    tree: Tree | DynamicTree | TreesByBatch  # what every step verifies (a table: per rows left), truncated near the end
    sampling: Sampling
    acceptance: str
    generator: torch.Generator | None
    eos: frozenset[int]
    observer: StepTimer | None          # timing, only when asked for
    passes: TargetPasses                # the target's passes over the run's cache: eager, static or path rows
    whole_trees: bool = False           # the last steps verify the whole tree too (step_tree_of)


@torch.no_grad()
def decode(
    target,
    input_ids,
    *,
    attention_mask: torch.Tensor | None = None,
    drafter=None,
    tree: Tree | DynamicTree | TreesByBatch | None = None,
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
    """Decode up to ``max_new_tokens`` after each prompt with tree speculation, verifying ``tree``: a Tree, a
    DynamicTree or a TreesByBatch (treespec/batch_trees.py: a tree per number of rows left), resolved already (None:
    the drafter's ``default_tree``). The public ``treespec.generate`` takes
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
    start = clock(observer)  # the cache is made in the prefill's time, as the prefill fills it
    # sliding-window layers too can be rolled back (treespec/cache.py); a hybrid's recurrent layers keep
    # transformers' own cache layers, verified by treespec/recurrent.py
    cache = decoding_cache(target.config)
    run = Run(target, inputs.drafter, inputs.tree, inputs.sampling, acceptance, generator, inputs.eos, observer,
              target_passes(target, cache, feature_layers, observer, static), inputs.whole_trees)
    # one generation at a time per drafter (it holds the rows' state); with compile, its depth steps compiled too
    with in_use(run.drafter), compiled_steps(run.drafter, inputs.compile, capacity):
        rows = prefill(run, inputs)
        drafter_behind = False  # a table's plain steps leave the drafter behind (resume_drafter)
        prefill_parts = {} if observer is None else dict(observer.seconds)  # kept out of the per-pass split
        prefill_time = clock(observer) - start
        retire(run, rows)
        while rows:
            step_tree = step_tree_of(run, rows)
            if run.drafter is None or len(step_tree) == 0:
                plain_step(run, rows, step_tree)
                drafter_behind = run.drafter is not None
            else:
                if drafter_behind:
                    resume_drafter(run, rows)
                    drafter_behind = False
                speculative_step(run, rows, step_tree)
            retire(run, rows)
    sequences, results = outputs(inputs, rows)
    wall_time = clock(observer) - start
    spent = {} if observer is None else observer.seconds
    return GenerationResult(sequences=sequences, prompt_length=inputs.given.shape[1],
                            accept_lengths=[n for row in results for n in row.accept_lengths], wall_time=wall_time,
                            target_time=spent.get(TARGET, 0.0),
                            draft_time=spent.get(DRAFT, 0.0) + spent.get(UPDATE, 0.0),
                            update_time=spent.get(UPDATE, 0.0), walk_time=spent.get(WALK, 0.0), rows=results,
                            passes=rows.passes, tree=inputs.tree, prefill_time=prefill_time,
                            prefill_target_time=prefill_parts.get(TARGET, 0.0),
                            prefill_draft_time=prefill_parts.get(DRAFT, 0.0))


def prefill(run: Run, inputs: Inputs) -> BatchRows:
    """The target over the prompts [b, P], whose last logits choose each row's first token (its first root);
    then the drafter sees the prompts."""
    input_ids, mask = inputs.input_ids, inputs.attention_mask
    cache = run.passes.cache
    # only the last position's logits are needed (a full-prompt [P, V] projection costs as much as a few steps)
    kwargs = prefill_kwargs(run.target)
    if mask is not None:  # left padding: transformers' own padding mask and positions (a row counts from 0)
        kwargs.update(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    logits, features = run.passes.forward(input_ids, **kwargs)  # features: [b, P, L·h]
    check_filled(cache, input_ids.shape[1], run.target)
    slots = RowSlots(input_ids.shape[0], input_ids.device, cache)
    slots.append_prompts(mask, input_ids.shape[1])
    p_target = probs(logits[:, -1], run.sampling)  # [b, V]
    roots = argmax(p_target) if run.sampling.greedy else sample(p_target, run.generator)  # [b]
    if run.drafter is not None:
        with timed(run.observer, DRAFT):
            run.drafter.reset()
            run.drafter.prefill(input_ids, features, mask)
    # the prompts' last features produced the roots (left padding); a table that pauses drafting keeps every
    # committed token's features, from which the drafter starts again (resume_drafter)
    keeps_history = isinstance(run.tree, TreesByBatch) and run.tree.pauses and features is not None
    return BatchRows(input_ids, inputs.prompt_lengths, roots, inputs.max_new_tokens, slots, features,
                     history=inputs.tree.depth + 1 if keeps_history else None)


def step_tree_of(run: Run, rows: BatchRows) -> Tree | DynamicTree:
    """The tree a step verifies (a TreesByBatch's for the rows left): without nodes deeper than any row can still
    commit (a shallower row's commit stops at its end), or under a static pass the whole tree, which keeps its graph
    (the commit stops at the end all the same, and inputs.py checks that the deepest positions stay in range)."""
    tree = run.tree.at(len(rows)) if isinstance(run.tree, TreesByBatch) else run.tree
    if run.whole_trees:
        return tree
    return tree.truncate(rows.headroom() - 1)


def resume_drafter(run: Run, rows: BatchRows) -> None:
    """After plain steps of a TreesByBatch (no tree at a larger batch), the drafter has not seen the tokens they
    committed: it starts again as after a prefill whose prompts are each row's committed tokens before its root,
    with the target's features at each of them (kept by ``BatchRows`` since the prefill). Its proposals change
    nothing the walk accepts but how many (the loop is lossless whatever is proposed)."""
    lengths = [row.length - 1 for row in rows.rows]  # committed tokens before each root
    ids, mask = left_aligned(rows.tokens, lengths)  # [b, m], [b, m]
    features = None if rows.history is None else left_aligned(rows.history, lengths)[0]  # [b, m, L·h]
    with timed(run.observer, DRAFT):
        run.drafter.reset()
        run.drafter.prefill(ids, features, None if len(set(lengths)) == 1 else mask.long())  # no read back


def plain_step(run: Run, rows: BatchRows, tree: Tree) -> None:
    """One pass over each row's root alone (no drafter, or no depth left to draft): one token per row."""
    proposals = Proposals.shared(tree, rows.tokens.new_empty(len(rows), 0))
    commit(run, rows, *target_pass(run, rows, proposals))


def speculative_step(run: Run, rows: BatchRows, tree: Tree | DynamicTree) -> None:
    """Draft each row's tree, verify them in one pass, commit each row's accepted path; the drafter then sees
    what was kept."""
    with timed(run.observer, DRAFT):  # each row's committed tokens end with its root
        proposals = run.drafter.propose(rows.committed, rows.feature, tree, run.sampling, run.generator)
    walked, features = target_pass(run, rows, proposals)
    commit(run, rows, walked, features)
    with timed(run.observer, UPDATE):
        run.drafter.accept([torch.tensor(row.path, dtype=torch.long) for row in walked.rows], rows.features)


def target_pass(run: Run, rows: BatchRows, proposals: Proposals) -> tuple[Walked, torch.Tensor | None]:
    """One target pass over every row's root and candidates, and the walk over each row's logits → (what each row
    commits, read back at once; the target's hidden states at every node [b, N, L·h] or None)."""
    tokens = torch.cat([rows.roots(), proposals.tokens.to(rows.tokens.device)], dim=1)  # [b, N]
    logits, features = run.passes.verify(rows.slots, tokens, proposals)  # [b, N, V]
    if run.drafter is not None and run.drafter.observes_logits:  # every node's logits, rejected ones' too
        with timed(run.observer, UPDATE):
            run.drafter.observe_pass(tokens, proposals.trees, logits)
    with timed(run.observer, WALK):
        # every row on the device, with its draws from the one generator; the step's one host read
        walked = walk_rows(logits, proposals, run.sampling, acceptance=run.acceptance, generator=run.generator)
    if walked.draft_not_finite:
        # rejection sampling against a q_draft holding NaN or inf does not give the target's distribution (it once
        # decoded on, with a warning at the end); greedy verification reads no q
        raise ValueError(f"{type(run.drafter).__name__} proposed draft probabilities (q_draft) holding NaN or inf at "
                         f"verification pass {rows.passes + 1} (temperature {run.sampling.temperature}): the output "
                         "would not follow the target's distribution; check the drafter's weights (NaN?) and dtype")
    return walked, features


def commit(run: Run, rows: BatchRows, walked: Walked, features: torch.Tensor | None) -> None:
    """Each row commits its walk (up to its end and its first eos); the target's cache keeps each row's root and
    accepted nodes."""
    run.passes.keep(rows.slots, rows.commit(walked, features, run.eos))


def retire(run: Run, rows: BatchRows) -> None:
    """Rows whose root is an eos or that reached their budget leave the batch (``BatchRows.retire``: their tokens,
    features, slots and target cache entries), and the drafter's state of them."""
    kept = rows.retire(run.eos)
    if kept is not None and run.drafter is not None:
        with timed(run.observer, DRAFT):
            run.drafter.keep_rows(kept)


def outputs(inputs: Inputs, rows: BatchRows) -> tuple[torch.Tensor, list[RowResult]]:
    """(sequences [b, P + T] as transformers' generate returns them: the prompts as given, each row's new tokens,
    the pad id after a row's eos up to T, the longest row's new tokens; each row's RowResult)."""
    given = inputs.given.to(inputs.input_ids.device)
    new = [rows.done[r][n:] for r, n in enumerate(inputs.prompt_lengths)]
    sequences = torch.full((given.shape[0], given.shape[1] + max(len(t) for t in new)), inputs.pad_token_id,
                           dtype=torch.long, device=given.device)
    sequences[:, : given.shape[1]] = given
    for r, tokens in enumerate(new):
        sequences[r, given.shape[1] : given.shape[1] + len(tokens)] = tokens
    results = [RowResult(n, len(t), lengths) for n, t, lengths in zip(inputs.prompt_lengths, new, rows.accept_lengths,
                                                                      strict=True)]
    return sequences, results
