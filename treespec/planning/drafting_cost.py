"""A drafter's cost per decoding step, measured in the decoding loop itself (``DraftingCost``), as the engine's own
cost is (treespec/planning/engine_cost.py).

Why in the loop: a drafter's calls timed alone miss how decoding drives them. An EAGLE step's first call feeds
the tokens the last step accepted (τ of them), and every later depth only the frontier (one node on a chain), while a
timing call feeds a fixed number; a call timed ten times in a row also finds its weights warm where decoding finds
them pushed out by a target pass. Timed alone, an EAGLE depth came out well above what decoding spent on it, and
every speedup was predicted low (docs/results.md, "Drafting measured in the loop").

How: generate() decodes a few real prompts with the drafter itself, once per calibration tree (chains and
branching trees), a ``CallTimer`` timing each of the drafter's calls: a step's proposal (the median over the steps
that drafted the whole tree) and its updates. Right before each generation the target's one-token pass is timed
alone, and each generation's drafting per pass is taken as a fraction of it, so a machine that speeds up or slows
down between this and the cost curve moves neither.
The fractions are fitted as fixed + per_depth · depth + per_node · nodes (``fit_drafting``), each term ≥ 0, and put
on the cost model's own pass (``DraftingCost.on``).

The decoding itself is ``dry_run``: any trees (a model-free drafter's dynamic budgets too), at any sampling and rule,
keeping per tree its τ and the sizes its passes verified as well (treespec/planning/measured_tau.py's ``TreeRun``),
which is how a drafter without rank accuracies is predicted (treespec/planning/model_free.py).
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from contextlib import contextmanager
from typing import NamedTuple

import torch

from treespec.drafter import Drafter
from treespec.generate import decode
from treespec.planning.bench import own_copy
from treespec.planning.measured_tau import TreeRun
from treespec.planning.robust import robust_median
from treespec.sampling import Sampling
from treespec.timing import DRAFT, UPDATE, StepTimer, forward_time
from treespec.tree import Tree

#: the trees drafting is timed on (depth, nodes with the root): chains 2 and 6, a binary tree of depth 3, and a
#: wide shallow one, so that depth and width each move the fit
DRAFTING_TREES = (Tree.chain(2), Tree.chain(6), Tree.full(2, 3), Tree.full(4, 2))


class DraftingCost(NamedTuple):
    """A drafter's cost per decoding step as fractions of the target's one-token pass timed alongside, and that
    pass's seconds then: ``fixed`` per step, ``per_depth`` per drafted depth, ``per_node`` per tree node (root
    included). ``on(t)``: the three in seconds beside a one-token pass of ``t`` seconds."""

    fixed: float
    per_depth: float
    target_pass: float  # seconds of the one-token pass timed alongside
    per_node: float = 0.0

    def on(self, one_token_pass: float | None = None) -> tuple[float, float, float]:
        t = self.target_pass if one_token_pass is None else one_token_pass
        return self.fixed * t, self.per_depth * t, self.per_node * t


NO_DRAFTING = DraftingCost(0.0, 0.0, 0.0)


def fit_drafting(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(fixed, per_depth, per_node) of points (tree depth, tree nodes, drafting per step) by least squares, every
    term ≥ 0: among the fits of each subset of the terms whose coefficients are all ≥ 0, the one with the smallest
    residual (a drafter that fills its tree at once has no per-depth cost, a chain-only drafter no per-node one)."""
    if not points:
        raise ValueError("fit_drafting needs at least one (depth, nodes, seconds) point")
    columns = {"fixed": [1.0] * len(points), "per_depth": [float(d) for d, _, _ in points],
               "per_node": [float(n) for _, n, _ in points]}
    y = torch.tensor([[float(s)] for _, _, s in points], dtype=torch.float64)
    best, best_residual = {}, float(y.square().sum())  # no term at all: nothing is charged
    for size in (1, 2, 3):
        for terms in itertools.combinations(columns, size):
            x = torch.tensor([list(row) for row in zip(*(columns[t] for t in terms), strict=True)], dtype=torch.float64)
            coef = torch.linalg.lstsq(x, y, driver="gelsd").solution[:, 0]
            if (coef < 0).any():
                continue
            residual = float((x @ coef[:, None] - y).square().sum())
            if residual < best_residual - 1e-15:
                best, best_residual = dict(zip(terms, coef.tolist(), strict=True)), residual
    return best.get("fixed", 0.0), best.get("per_depth", 0.0), best.get("per_node", 0.0)


def calibration_trees(max_depth: int | None = None, trees=DRAFTING_TREES) -> list[Tree]:
    """``trees`` cut to a drafter's deepest tree (Medusa: its heads); a chain deeper than that becomes a chain of
    that depth, a full tree keeps its width."""
    if max_depth is None:
        return list(trees)
    out = []
    for tree in trees:
        depth = min(tree.depth, max_depth)
        fitted = tree if depth == tree.depth else Tree.chain(depth) if tree.is_chain else \
            Tree.full(len(tree.children[0]), depth)
        if fitted not in out:
            out.append(fitted)
    return out


class CallTimer(StepTimer):
    """A StepTimer that also keeps each timed call's seconds, in order, per part: generate()'s drafter calls are
    its prefill, then one proposal per verification pass (and, as rows retire, ``keep_rows``)."""

    def __init__(self, synchronize: bool = True, device=None):
        super().__init__(synchronize, device)
        self.calls = {part: [] for part in self.seconds}

    @contextmanager
    def timing(self, part: str):
        before = self.seconds[part]
        with super().timing(part):
            yield
        self.calls[part].append(self.seconds[part] - before)


def whole_tree_steps(accept_lengths: list[int], depth: int, max_new_tokens: int) -> list[int]:
    """The steps (0-based) that drafted the whole tree: generate() cuts a step's tree to the tokens its budget has
    left (``step_tree_of``), so near the end a step drafts less, which is not the cost of the tree."""
    committed, steps = 1, []  # the prefill commits the first token
    for i, accepted in enumerate(accept_lengths):
        if max_new_tokens - committed - 1 >= depth:
            steps.append(i)
        committed += accepted
    return steps


class DryRun(NamedTuple):
    """What decoding held-out prompts over each tree measured (``dry_run``): each tree's ``TreeRun`` and the
    median seconds of the one-token target pass timed alongside."""

    runs: list[TreeRun]
    target_pass: float


@contextmanager
def proposal_sizes(drafter: Drafter, sizes: list[int]):
    """``sizes`` gets the nodes (root included) of every pass ``drafter`` proposes for, while inside: a model-free
    drafter often fills part of its tree, and a pass costs what it verifies. The instance's ``propose`` is wrapped
    (the loop is not told), and the class's is back after."""
    propose = drafter.propose

    def recording(*args, **kwargs):
        proposals = propose(*args, **kwargs)
        sizes.append(proposals.num_nodes)  # the largest row's tree: what a batched pass verifies
        return proposals

    drafter.propose = recording
    try:
        yield sizes
    finally:
        del drafter.propose


def dry_run(target, drafter: Drafter, prompts: list[torch.Tensor], *, trees=DRAFTING_TREES, max_new_tokens: int = 32,
            batch: int = 1, sampling: Sampling | None = None, acceptance: str = "rejection", seed: int = 0) -> DryRun:
    """Decode each of ``prompts`` ([1, P] token ids; each as ``batch`` rows) with ``drafter`` once per tree of
    ``trees`` (Trees or DynamicTrees), at ``sampling`` (None: greedy) under ``acceptance``, after one untimed
    generation (lazy initialisation), timing each of the drafter's calls (``CallTimer``); ``drafter`` itself learns
    nothing (``bench.own_copy``). Over the steps that drafted the whole tree: τ, the sizes the passes verified, and
    drafting per pass (the median proposal, plus the updates per pass; the prefill's drafting call is not a step's) as
    a fraction of the one-token pass timed right before that generation, the median over prompts (without outliers:
    robust.py). A tree no step drafted whole is left out."""
    if not prompts:
        raise ValueError("a dry run needs at least one prompt to decode")
    for i, p in enumerate(prompts):  # a batch or a list once failed inside torch (expand, .to)
        if not (isinstance(p, torch.Tensor) and (p.dim() == 1 or p.dim() == 2 and p.shape[0] == 1)):
            raise ValueError(f"a dry run's prompts are token ids [1, P] (or [P]) each; prompt {i} is "
                             f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    if not trees:
        raise ValueError("a dry run needs at least one tree to decode with, got none")
    prompts = [p.reshape(1, -1) for p in prompts]
    sampling = sampling or Sampling(0.0)
    rows = [p.to(target.device).expand(batch, -1) for p in prompts]
    warm = own_copy(drafter)
    decode(target, rows[0], drafter=warm, tree=trees[0], max_new_tokens=8)  # untimed: lazy initialisation
    warm.reset()
    # a drafter that learns from every generation (SuffixDecoding, Token Recycling) gets a copy per tree, which meets
    # the prompts one after another as a comparison's configuration does: one drafter decoding a prompt once per tree
    # would have seen that prompt's answer by its second tree
    drafters = {tree: own_copy(drafter) for tree in trees}
    fractions, lengths, verified, passes = {t: [] for t in trees}, {t: [] for t in trees}, {t: [] for t in trees}, []
    generator = torch.Generator().manual_seed(seed)
    for prompt in rows:
        for tree in trees:
            alone = forward_time(target, n_tokens=1, past_len=prompt.shape[1], repeats=8, batch=batch)
            timer, sizes = CallTimer(synchronize=True, device=target.device), []
            with proposal_sizes(drafters[tree], sizes):
                result = decode(target, prompt, drafter=drafters[tree], tree=tree, max_new_tokens=max_new_tokens,
                                observer=timer, temperature=sampling.temperature, top_p=sampling.top_p,
                                acceptance=acceptance, generator=None if sampling.greedy else generator)
            drafters[tree].reset()
            proposals = timer.calls[DRAFT][1 : 1 + result.target_passes]  # after the prefill's call
            accepted = result.rows[0].accept_lengths
            whole = whole_tree_steps(accepted, tree.depth, max_new_tokens)
            if not whole:
                continue
            drafting = statistics.median(proposals[i] for i in whole)
            updates = timer.seconds[UPDATE] / max(1, result.target_passes)  # accept (and observe_pass) per pass
            fractions[tree].append((drafting + updates) / alone)
            lengths[tree] += [accepted[i] for i in whole]
            verified[tree] += [sizes[i] for i in whole]
            passes.append(alone)
    runs = [TreeRun(tree, sum(lengths[tree]) / len(lengths[tree]),
                    {n: c / len(verified[tree]) for n, c in sorted(Counter(verified[tree]).items())},
                    robust_median(fractions[tree]), len(lengths[tree])) for tree in trees if fractions[tree]]
    if not runs:
        raise ValueError(f"max_new_tokens={max_new_tokens} left no step of any tree whole: raise it")
    return DryRun(runs, statistics.median(passes))


CALIBRATION_TOKENS = 32  # new tokens each calibration prompt is decoded for, per tree


def measure_drafting_cost(target, drafter: Drafter, prompts: list[torch.Tensor], *, trees=DRAFTING_TREES,
                          max_new_tokens: int = CALIBRATION_TOKENS, batch: int = 1) -> DraftingCost:
    """``drafter``'s DraftingCost (module docstring) on ``target``: a greedy ``dry_run`` over the calibration trees
    (cut to the drafter's depth), each tree's drafting fraction fitted by depth and nodes verified."""
    if not prompts:
        raise ValueError("measure_drafting_cost needs at least one prompt to decode")
    return drafting_fit(dry_run(target, drafter, prompts, trees=calibration_trees(drafter.max_tree_depth, trees),
                                max_new_tokens=max_new_tokens, batch=batch))


def drafting_fit(measured: DryRun) -> DraftingCost:
    """The DraftingCost of a dry run's trees: fixed + per depth + per node verified (``fit_drafting``)."""
    fixed, per_depth, per_node = fit_drafting([(r.tree.depth, r.mean_nodes, r.drafting) for r in measured.runs])
    return DraftingCost(fixed, per_depth, measured.target_pass, per_node)


def own_text_prompts(target, count: int = 2, seed_tokens: int = 16, length: int = 96, seed: int = 0
                     ) -> list[torch.Tensor]:
    """``count`` prompts ([1, ``seed_tokens`` + ``length``]) of text the target writes itself, greedily, after a few
    random tokens: where no real prompt is at hand (a drafter's first use in generate()), decoding goes on from the
    target's own text, which a drafter trained on it accepts as it will in use, where random tokens it would not."""
    vocab = target.get_output_embeddings().weight.shape[0]
    out = []
    for i in range(count):
        start = torch.randint(0, vocab, (1, seed_tokens), generator=torch.Generator().manual_seed(seed + i))
        out.append(decode(target, start.to(target.device), max_new_tokens=length).sequences)
    return out
