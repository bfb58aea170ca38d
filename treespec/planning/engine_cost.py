"""The engine's own cost per decoding step (``autotree.EngineCost``), measured in the decoding loop itself.

A step costs its target pass and its drafting calls, which the cost curve and the drafting costs time in
isolation, and the work of the loop around them: the walk over the pass's logits, the cache compaction, the
masks, the bookkeeping in Python. On a small, fast target that work is a large share of a step, and a cost model
without it under-predicts what speculation gains (vanilla pays it once per token, a tree once per τ tokens).

How it is measured: generate() decodes a random prompt of the curve's context length, once with no drafter
(vanilla) and once per calibration tree with ``PlaceholderDrafter``, which proposes that tree's shape with one
placeholder token everywhere and runs no model. A ``StepClock`` observer notes when each step's walk starts
(every step, plain or speculative, walks once), so consecutive starts are one whole step apart: no prefill, no
warm-up and no end-of-budget step is mixed in, and the median over steps stands up to a busy machine. Right
before each such generation the target's pass over the same N tokens is timed alone (``pass_time``, as the cost
curve times it); the step's median minus that pass is the engine's cost at N nodes, so a machine that speeds up
or slows down between the curve and the calibration moves neither. What a pass inside decoding costs beyond the
pass alone is part of it, which is what a prediction must add. ``fit_engine`` puts a line through the tree sizes,
``fixed + per_node · N``, and keeps vanilla's own value beside it; each size's value is the median over rounds,
rounds beyond k·MAD dropped (robust.py). A result that cannot be (``implausible``: a vanilla step's loop work above a
speculative step's, a term below 0) is a slow spell's mark: more rounds are timed and pooled, and it is fitted again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from treespec.drafter import Drafter, Proposals
from treespec.generate import decode
from treespec.inputs import max_positions
from treespec.planning.autotree import EngineCost
from treespec.planning.robust import robust
from treespec.timing import WALK, StepTimer, forward_time
from treespec.tree import Tree

#: the trees the engine is timed on: N = 3, 9, 31 and 73 nodes (root included), chains and branching trees
CALIBRATION_TREES = (Tree.chain(2), Tree.chain(8), Tree.full(2, 4), Tree.full(8, 2))


class StepClock(StepTimer):
    """A StepTimer that also notes the start of every walk (one per decoding step): ``step_seconds()`` are the
    times between consecutive starts, each one whole step."""

    def __init__(self, synchronize: bool = True, device=None, now: Callable[[], float] = time.perf_counter):
        super().__init__(synchronize, device)
        self.now, self.walk_starts = now, []

    @contextmanager
    def timing(self, part: str):
        with super().timing(part):
            if part == WALK:
                self.walk_starts.append(self.now())
            yield

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.walk_starts, self.walk_starts[1:], strict=False)]


class PlaceholderDrafter(Drafter):
    """Proposes ``tree``'s shape every step, every node the placeholder ``token``, with no model: a step of the
    loop around a tree of that size, drafting excluded."""

    def __init__(self, tree: Tree, token: int = 0):
        self.default_tree, self.token, self._tokens = tree, token, {}

    def propose(self, committed, feature, tree, sampling, generator=None) -> Proposals:
        key = (len(committed.lengths), len(tree), committed.tokens.device)
        if key not in self._tokens:  # made once: the drafting a real drafter does is not what is timed here
            self._tokens[key] = torch.full(key[:2], self.token, dtype=torch.long, device=key[2])
        return Proposals.shared(tree, self._tokens[key])


class ReplayDrafter(Drafter):
    """Rows that accept different lengths, as real rows do, with no model: row b proposes its known continuation
    (the target's own greedy tokens, ``continuation`` [b, T] after prompts of ``prompt_lengths``) on the tree's
    first-rank path down to depth k and another token everywhere else, k cycling over 0 .. depth by row and step. A
    ragged batch's step: holes on the slot axis, explicit masks, per-row compaction. Its own work, which the step's
    time includes, is a few tensor ops: the tree's layout is made once."""

    per_row = ("continuation", "prompt_lengths", "row_ids")

    def __init__(self, tree: Tree, continuation: torch.Tensor, prompt_lengths: list[int], vocab: int):
        self.default_tree, self.continuation, self.prompt_lengths = tree, continuation, list(prompt_lengths)
        self.row_ids = torch.arange(len(self.prompt_lengths), device=continuation.device)  # [b]
        self.vocab, self.steps, self._layouts = vocab, 0, {}

    def _layout(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """(each node's depth [n], whether its path takes rank 0 at every depth [n]), made once per tree."""
        if tree not in self._layouts:
            device = self.continuation.device
            self._layouts[tree] = (tree.depths[1:].to(device), torch.tensor(
                [all(r == 0 for r in path) for path in tree.paths], dtype=torch.bool, device=device))
        return self._layouts[tree]

    def propose(self, committed, feature, tree, sampling, generator=None) -> Proposals:
        self.steps += 1
        depths, spine = self._layout(tree)  # [n], [n]
        made = torch.tensor([n - p for n, p in zip(committed.lengths, self.prompt_lengths, strict=True)],
                            device=depths.device)  # [b]: tokens generated, the root the last
        accepts = (self.row_ids + self.steps) % (tree.depth + 1)  # [b]
        index = (made[:, None] - 1 + depths[None]).clamp(max=self.continuation.shape[1] - 1)  # [b, n]
        right = self.continuation.gather(1, index)  # [b, n]
        chosen = spine[None] & (depths[None] <= accepts[:, None])
        return Proposals.shared(tree, torch.where(chosen, right, (right + 1) % self.vocab).to(committed.tokens.device))


def step_times(target, prompt: torch.Tensor, steps: int, tree: Tree | None = None, drafter: Drafter | None = None,
               attention_mask: torch.Tensor | None = None, max_new_tokens: int | None = None) -> list[float]:
    """Seconds of each of the first ``steps`` − 1 whole steps of generate() on ``prompt`` [b, P] (left-padded where
    ``attention_mask`` says) with ``drafter`` verifying ``tree`` (None: vanilla): the budget (default: the tree whole
    for every one of them without acceptance) leaves the tree whole for every one of them."""
    clock = StepClock(synchronize=True, device=target.device)
    depth = tree.depth if tree is not None else 0
    decode(target, prompt, attention_mask=attention_mask, drafter=drafter, tree=tree,
           max_new_tokens=max_new_tokens or steps + depth + 1, observer=clock)
    return clock.step_seconds()[: steps - 1]


def fit_engine(vanilla: float, points: list[tuple[int, float]]) -> EngineCost:
    """The EngineCost of measured steps: ``vanilla`` (a vanilla step's seconds beyond its pass) and ``points`` (tree
    nodes N, a speculative step's seconds beyond its pass over N tokens) fitted by least squares as fixed +
    per_node · N. A slope below 0 is noise (a bigger tree never costs the loop less): then a flat line through their
    mean."""
    if not points:
        raise ValueError("fit_engine needs at least one (tree nodes, seconds) point")
    xs, ys = [float(n) for n, _ in points], [float(s) for _, s in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread > 0 else 0.0
    slope = max(0.0, slope)
    return EngineCost(vanilla=vanilla, fixed=mean_y - slope * mean_x, per_node=slope)


def pass_time(target, nodes: int, past_len: int, batch: int = 1, repeats: int = 8) -> float:
    """Median seconds of the target's pass alone over ``nodes`` tokens per row after ``past_len`` cached ones (the
    cost curve's timing, ``autotree.measure_cost_curve``)."""
    return forward_time(target, n_tokens=nodes, past_len=past_len, repeats=repeats, batch=batch)


def engine_samples(target, *, past_len: int, trees=CALIBRATION_TREES, steps: int = 16, repeats: int = 3,
                   batch: int = 1, seed: int = 0, ragged: bool = False) -> tuple[list[float], dict[Tree, list[float]]]:
    """(vanilla's engine seconds per step, {tree: its engine seconds per step}), one value per round: the median
    step minus the pass alone timed right before it (module docstring). ``repeats`` rounds, vanilla and every
    tree interleaved in each, after one untimed round (lazy initialisation), on a random [batch, past_len]
    prompt. ``ragged`` (batch > 1): rows as a real batch has them, prompts of different lengths (left padding) and
    different lengths accepted every step (``ReplayDrafter``), so masks, holes and per-row compaction are paid."""
    vocab = target.get_output_embeddings().weight.shape[0]
    deepest = max((t.depth for t in trees), default=0)
    ragged = ragged and batch > 1
    budget = (steps + 1) * (deepest + 1) + 2 if ragged else steps + deepest + 1
    limit = max_positions(target.config)  # the prompt, the budget and the deepest tree must fit
    if limit is not None:
        past_len = max(2, min(past_len, limit - budget - deepest - 2))
    prompt = torch.randint(0, vocab, (batch, past_len), generator=torch.Generator().manual_seed(seed))
    prompt, mask = prompt.to(target.device), None
    if ragged:  # row b's prompt a quarter shorter than the longest at most, left-padded
        lengths = [past_len - (b * past_len) // (4 * batch) for b in range(batch)]
        mask = (torch.arange(past_len)[None] >= torch.tensor([past_len - n for n in lengths])[:, None]).long()
        mask = mask.to(target.device)
        continuation = decode(target, prompt, attention_mask=mask, max_new_tokens=budget).sequences[:, past_len:]
        configs = [(None, None)] + [(tree, lambda tree=tree: ReplayDrafter(tree, continuation, lengths, vocab))
                                    for tree in trees]
    else:
        token = int(prompt[0, 0])  # a placeholder the target rarely continues with after itself
        configs = [(None, None)] + [(tree, lambda tree=tree: PlaceholderDrafter(tree, token)) for tree in trees]
    samples = {tree: [] for tree, _ in configs}
    for round_ in range(repeats + 1):
        for tree, drafter in configs:
            nodes = 1 if tree is None else tree.num_nodes
            alone = pass_time(target, nodes, past_len, batch)
            times = step_times(target, prompt, steps if round_ else 3, tree, drafter and drafter(), mask,
                               budget if ragged and tree is not None else None)
            if round_ and times:
                samples[tree].append(statistics.median(times) - alone)
    vanilla = samples.pop(None)
    return vanilla, samples


def implausible(cost: EngineCost) -> str | None:
    """Why ``cost`` cannot be what the loop costs, or None: a vanilla step's loop work above a speculative step's over
    one node (the same walk, commit and Python, less the drafter's calls), or a term below 0 (a pass inside decoding
    never costs less than the pass alone). Each is what a slow spell over some rounds leaves behind."""
    if cost.vanilla > cost.step(1):
        return (f"the vanilla step's {1e3 * cost.vanilla:.2f} ms is above a speculative step's "
                f"{1e3 * cost.step(1):.2f} ms over one node")
    negative = [name for name, value in (("vanilla", cost.vanilla), ("fixed", cost.fixed)) if value < 0]
    if negative:
        return f"the {' and '.join(negative)} term below 0"
    return None


def consistent(cost: EngineCost) -> EngineCost:
    """The nearest terms that can both be right, when timing again did not make them so. A vanilla step above a
    speculative step over one node: both become their mean (the least-squares fit under vanilla <= step(1), isotonic
    regression's pooling: nothing says which of the two the slow spell hit, and keeping a vanilla term as measured
    moves every prediction: docs/results.md, "How well predictions match"). First a term below 0 is 0, as a cost
    record keeps it (planning/cost_records.py): below 0, every speculative step would look cheaper than its own pass."""
    vanilla, fixed, per_node = max(0.0, cost.vanilla), max(0.0, cost.fixed), cost.per_node
    if vanilla > fixed + per_node:
        pooled = (vanilla + fixed + per_node) / 2
        vanilla, fixed = pooled, max(0.0, pooled - per_node)
    return EngineCost(vanilla, fixed, per_node)


def engine_from(vanilla: list[float], by_tree: dict[Tree, list[float]], bounds: dict | None = None) -> EngineCost:
    """The EngineCost of the rounds' samples: each term the robust median of its rounds (robust.py), a line through
    the trees' (``fit_engine``). ``bounds`` gets ``engine_vanilla`` and ``engine_fixed`` as (lo, hi): the same fit
    through the kept rounds' lows and highs."""
    v = robust(vanilla)
    spreads = {tree: robust(values) for tree, values in by_tree.items() if values}
    cost = fit_engine(v.value, [(tree.num_nodes, s.value) for tree, s in spreads.items()])
    if bounds is not None:
        low = fit_engine(v.lo, [(tree.num_nodes, s.lo) for tree, s in spreads.items()]).fixed
        high = fit_engine(v.hi, [(tree.num_nodes, s.hi) for tree, s in spreads.items()]).fixed
        bounds.update(engine_vanilla=(v.lo, v.hi), engine_fixed=(min(low, high), max(low, high)))
    return cost


def measure_engine_cost(target, *, past_len: int = 256, trees=CALIBRATION_TREES, steps: int = 16, repeats: int = 3,
                        batch: int = 1, seed: int = 0, retries: int = 2, bounds: dict | None = None,
                        ragged: bool = False, log=print) -> EngineCost:
    """The engine's cost per step on ``target`` (module docstring), at ``past_len`` cached tokens over ``batch`` rows,
    beyond the target's pass as ``autotree.measure_cost_curve`` times it (``ragged``: over rows of different
    prompt lengths accepting different lengths, ``engine_samples``). When it is ``implausible``, ``repeats``
    rounds more are timed and pooled with the first, up to ``retries`` times (then ``consistent`` makes its terms
    agree, with a warning).
    ``bounds``: filled with each term's (lo, hi) over its kept rounds (``engine_from``)."""
    if steps < 2 or repeats < 1 or not trees:
        raise ValueError(f"measure_engine_cost times steps >= 2 in repeats >= 1 rounds over at least one tree, got "
                         f"steps={steps}, repeats={repeats}, {len(trees)} trees")
    vanilla, by_tree = engine_samples(target, past_len=past_len, trees=trees, steps=steps, repeats=repeats,
                                      batch=batch, seed=seed, ragged=ragged)
    cost = engine_from(vanilla, by_tree, bounds)
    for attempt in range(retries + 1):
        why = implausible(cost)
        if why is None:
            break
        if attempt == retries:
            kept = consistent(cost)
            log(f"warning: the engine's cost is still implausible after {retries} re-measures ({why}); kept as the "
                f"nearest terms that can both be right ({1e3 * kept.vanilla:.2f} ms per vanilla step, "
                f"{1e3 * kept.fixed:.2f} ms fixed per speculative step): measure again on an idle machine")
            return kept
        log(f"the engine's cost looks implausible ({why}): timing {repeats} more rounds")
        more_vanilla, more = engine_samples(target, past_len=past_len, trees=trees, steps=steps, repeats=repeats,
                                            batch=batch, seed=seed, ragged=ragged)
        vanilla += more_vanilla
        for tree, values in more.items():
            by_tree[tree] += values
        cost = engine_from(vanilla, by_tree, bounds)
    return cost
