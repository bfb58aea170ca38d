"""The engine's own cost per decoding step (``autotree.EngineCost``), measured in the decoding loop itself.

A step costs its target pass and its drafting calls, which the cost curve and the drafting costs time in
isolation, and the work of the loop around them: the walk over the pass's logits, the cache compaction, the
masks, the bookkeeping in Python. On a small, fast target that work is a large share of a step, and a cost model
without it under-predicts what speculation gains (vanilla pays it once per token, a tree once per τ tokens).

How it is measured: generate() decodes a random prompt of the curve's context length, once with no drafter
(vanilla) and once per calibration tree with ``PlaceholderDrafter``, which proposes that tree's shape with one
placeholder token everywhere and runs no model. A ``StepClock`` observer notes when each step's walk starts
(every step, plain or speculative, walks once), so consecutive starts are one whole step apart: no prefill, no
warm-up and no end-of-budget step is mixed in, and the median over steps stands up to a busy machine. A step's
time minus the curve's T(N) is the engine's cost at N nodes (what a pass inside decoding costs beyond the
curve's pass is part of it, which is what a prediction must add); ``fit_engine`` puts a line through the tree
sizes: ``fixed + per_node · N``, and vanilla's own value beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from treespec.autotree import EngineCost, cost_at
from treespec.drafter import Drafter, Proposals
from treespec.generate import generate
from treespec.inputs import max_positions
from treespec.timing import WALK, StepTimer
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


def step_times(target, prompt: torch.Tensor, steps: int, tree: Tree | None = None, drafter: Drafter | None = None
               ) -> list[float]:
    """Seconds of each of the first ``steps`` − 1 whole steps of generate() on ``prompt`` [b, P] with ``drafter``
    verifying ``tree`` (None: vanilla): the budget leaves the tree whole for every one of them (without
    acceptance; with it, the same steps commit more)."""
    clock = StepClock(synchronize=True, device=target.device)
    depth = tree.depth if tree is not None else 0
    generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=steps + depth + 1, observer=clock)
    return clock.step_seconds()[: steps - 1]


def fit_engine(vanilla_step: float, one_token: float, points: list[tuple[int, float]]) -> EngineCost:
    """The EngineCost of measured steps: ``vanilla_step`` (a vanilla step's seconds) beyond ``one_token`` (the
    curve's T(1)), and ``points`` (tree nodes N, a speculative step's seconds beyond the curve's T(N)) fitted by
    least squares as fixed + per_node · N. A slope below 0 is noise (a bigger tree never costs the loop less):
    then a flat line through their mean."""
    if not points:
        raise ValueError("fit_engine needs at least one (tree nodes, seconds) point")
    xs, ys = [float(n) for n, _ in points], [float(s) for _, s in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread > 0 else 0.0
    slope = max(0.0, slope)
    return EngineCost(vanilla=vanilla_step - one_token, fixed=mean_y - slope * mean_x, per_node=slope)


def engine_samples(target, *, past_len: int, trees=CALIBRATION_TREES, steps: int = 16, repeats: int = 3,
                   batch: int = 1, seed: int = 0) -> tuple[list[float], dict[Tree, list[float]]]:
    """(vanilla's step seconds, {tree: its step seconds}) over ``repeats`` rounds, vanilla and every tree
    interleaved in each, after one untimed round (lazy initialisation), on a random [batch, past_len] prompt."""
    vocab = target.get_output_embeddings().weight.shape[0]
    limit = max_positions(target.config)  # the prompt, the budget and the deepest tree must fit
    if limit is not None:
        past_len = max(1, min(past_len, limit - steps - max((t.depth for t in trees), default=0) - 2))
    prompt = torch.randint(0, vocab, (batch, past_len), generator=torch.Generator().manual_seed(seed))
    prompt = prompt.to(target.device)
    token = int(prompt[0, 0])  # a placeholder the target rarely continues with after itself
    drafters = {tree: PlaceholderDrafter(tree, token) for tree in trees}
    vanilla, by_tree = [], {tree: [] for tree in trees}
    for round_ in range(repeats + 1):
        keep = round_ > 0
        times = step_times(target, prompt, steps if keep else 3)
        vanilla += times if keep else []
        for tree, drafter in drafters.items():
            times = step_times(target, prompt, steps if keep else 3, tree, drafter)
            by_tree[tree] += times if keep else []
    return vanilla, by_tree


def measure_engine_cost(target, curve: dict[int, float], *, past_len: int = 256, trees=CALIBRATION_TREES,
                        steps: int = 16, repeats: int = 3, batch: int = 1, seed: int = 0) -> EngineCost:
    """The engine's cost per step on ``target`` (module docstring), beyond ``curve`` (the target's cost curve alone,
    measured at ``past_len`` cached tokens over ``batch`` rows, as ``autotree.measure_cost_curve`` measures it)."""
    vanilla, by_tree = engine_samples(target, past_len=past_len, trees=trees, steps=steps, repeats=repeats,
                                      batch=batch, seed=seed)
    points = [(tree.num_nodes, statistics.median(times) - cost_at(curve, tree.num_nodes))
              for tree, times in by_tree.items() if times]
    return fit_engine(statistics.median(vanilla), cost_at(curve, 1), points)
