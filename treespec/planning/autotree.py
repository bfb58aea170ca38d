"""Hardware-aware tree sizing: pick the tree that maximises predicted tokens/s on this device.

Verifying N tree tokens costs one target forward over N tokens, and that cost is flat only while the
device is memory-bound (on a CPU, a pass over tens of tokens costs a small multiple of a one-token pass).
A bigger tree commits more tokens per pass but each pass costs more; the best size depends on
the drafter's accuracy *and* the device. So:

    predicted speedup(tree) = τ(tree) / [(cost(N) + draft cost(tree)) / cost(1)]

with cost(N) from the measured cost curve and τ and the candidate trees from a τ source (one chooser, two
strategies): ``RankAccuracy``, the drafter's measured per-depth top-k accuracies
(analysis.expected_tree_tokens_from_rank_accuracy) with candidate trees grown greedily by accuracy
(analysis.grow_tree) at every node budget (Medusa's sparse trees, Cai et al. 2024; Sequoia, Chen et
al. 2024, optimises the same trade-off with a hardware-aware search); or ``ChainTable``, chains γ = 0..D with
each acceptance rule's τ measured in closed form on sampled drafts (treespec/planning/chain_tau.py: token-level
rejection, Sun et al. 2024's block verification), for drafters that sample their candidates. A third source,
``MeasuredTrees`` (treespec/planning/measured_tau.py), holds τ per tree measured by decoding, for drafters without
rank accuracies; it also knows the sizes its passes verified, which ``predict`` charges (``CostModel.expected_step``).

A whole generation also pays the prefill, which speculation does not shorten: ``predict_generation``
turns a per-step prediction into the speedup of one prompt's generation (its prompt length, its number
of new tokens), which is what a measured speedup is. The cost curve a drafter's "auto" tree is chosen
with in generate() is saved beside the drafter (``save_cost_curve``, cost_curve.json).

A step costs more than its target pass and its drafting calls: the engine walks the logits, compacts the cache,
builds the masks and runs its Python around them (``EngineCost``, measured in the loop itself by
treespec/planning/engine_cost.py; the drafting terms are measured in the loop too, by
treespec/planning/drafting_cost.py).
``CostModel`` holds every term, one object for generate()'s "auto" and the comparison:

    step(tree)  = T(N) + draft_fixed + depth · draft_per_depth + N · draft_per_node
                  + engine_fixed + engine_per_node · N
    vanilla     = T(1) + engine_vanilla                           (N: tree nodes, root included)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treespec.cache import TreeCache
from treespec.compat import prefill_kwargs
from treespec.dynamic_tree import DynamicTree
from treespec.io import atomic_write_json, read_json
from treespec.linear_kernels import path_changes
from treespec.planning.analysis import expected_tree_tokens_from_rank_accuracy, grow_tree
from treespec.planning.cost_records import check_cost_record
from treespec.planning.curve_rounds import cost_curve_rounds
from treespec.planning.robust import robust
from treespec.timing import median_time
from treespec.tree import Tree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
COST_CURVE_FILE = "cost_curve.json"


def measure_cost_curve(model, sizes=DEFAULT_SIZES, past_len: int = 256, repeats: int = 10,
                       before=None, batch: int = 1, spread: dict | None = None) -> dict[int, float]:
    """Seconds of one target forward over N new tokens per row after ``past_len`` cached ones, for ``batch`` rows (a
    batch's cost curve is over B × N tokens): each size the median of its rounds without the outliers
    (treespec/planning/curve_rounds.py, ``cost_curve_rounds``; robust.py), whose ``Spread`` goes into ``spread`` {N:
    Spread} when given. ``before``: a drafting call to run (untimed) ahead of each forward, so the curve is what
    verification costs while that drafter alternates with the target (its weights push the target's out of the
    caches). Where a linear kernel changes path within the sizes' range (``linear_kernels.path_changes``: after 16
    rows of the native or packed kernel, say), the sizes on both sides of that row count are measured too:
    interpolating across such a jump predicted batches too cheap (docs/batch.md)."""
    sizes = sorted({int(n) for n in sizes})
    if sizes:
        sizes = sorted(set(sizes) | {n for rows in path_changes(model) for n in (rows // batch, rows // batch + 1)
                                     if sizes[0] <= n <= sizes[-1]})
    spreads = {n: robust(t) for n, t in cost_curve_rounds(model, sizes, past_len, repeats, before, batch).items()}
    if spread is not None:
        spread.update(spreads)
    return {n: s.value for n, s in spreads.items()}


def prefill_time(model, n_tokens: int, repeats: int = 5, batch: int = 1) -> float:
    """Median seconds of generate()'s prefill over ``batch`` prompts of ``n_tokens`` (a fresh cache, the last
    logits)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (batch, max(1, n_tokens)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    kwargs = prefill_kwargs(model)

    @torch.no_grad()
    def run():
        model(input_ids=ids, cache=TreeCache(model.config), use_cache=True, **kwargs)

    return median_time(run, repeats, warmup=1)


def measure_prefill_curve(model, lengths, repeats: int = 5, batch: int = 1) -> dict[int, float]:
    """{prompt tokens: seconds} of the prefill of ``batch`` prompts at each length (``cost_at`` interpolates between
    them)."""
    return {int(n): prefill_time(model, int(n), repeats, batch) for n in sorted(set(lengths))}


def cost_at(curve: dict[int, float], n: int) -> float:
    """Cost of a forward over n tokens, linearly interpolated (and extrapolated) from the curve."""
    sizes = sorted(curve)
    if n in curve:
        return curve[n]
    if sizes and n <= sizes[0]:
        return curve[sizes[0]]
    if len(sizes) < 2:  # (was an IndexError) nothing to extrapolate from
        raise ValueError(f"a cost curve timed at {len(sizes)} size(s) {sizes} cannot give a pass over {n} tokens: "
                         "time it at two sizes or more")
    lo = max(s for s in sizes if s < n) if n < sizes[-1] else sizes[-2]
    hi = min(s for s in sizes if s > n) if n < sizes[-1] else sizes[-1]
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


@dataclass
class Prediction:
    tree: Tree | DynamicTree  # a dynamic one only where its τ was measured by decoding
    tau: float              # predicted tokens per verification pass
    step_cost: float        # predicted seconds per step (target verify + drafting + engine)
    speedup: float          # predicted tokens/s over vanilla decoding
    vanilla: float = math.nan  # predicted seconds per vanilla token (its target pass + the engine's step)


@dataclass(frozen=True)
class EngineCost:
    """Seconds a decoding step spends beyond its target pass (as the cost curve times it) and its timed drafting
    calls: the walk, the cache compaction, the masks, the Python around them. A vanilla step pays ``vanilla``, a
    speculative step over N tree nodes (root included) ``fixed + per_node · N``. Measured in the decoding loop
    itself (treespec/planning/engine_cost.py), so it also holds what a pass inside decoding costs beyond the curve's."""

    vanilla: float = 0.0
    fixed: float = 0.0
    per_node: float = 0.0

    def step(self, nodes: int) -> float:
        return self.fixed + self.per_node * nodes

    def record(self) -> dict:
        return {"engine_vanilla": float(self.vanilla), "engine_fixed": float(self.fixed),
                "engine_per_node": float(self.per_node)}

    @classmethod
    def from_record(cls, record: dict) -> EngineCost:
        """From a cost curve record; a record written before the engine was measured has none (zeros)."""
        return cls(*(float(record.get(k) or 0.0) for k in ("engine_vanilla", "engine_fixed", "engine_per_node")))


@dataclass(frozen=True)
class CostModel:
    """Every term of a step's predicted cost (module docstring): the target's ``curve`` {tree nodes: seconds} (timed
    after the drafter's calls where it drafts), the drafting costs, ``baseline`` (the target's one-token forward
    alone, vanilla's pass; None: the curve's) and the ``engine``."""

    curve: dict[int, float]
    draft_cost_fixed: float = 0.0
    draft_cost_per_depth: float = 0.0
    baseline: float | None = None
    engine: EngineCost = field(default_factory=EngineCost)
    draft_cost_per_node: float = 0.0  # seconds of drafting per tree node (root included; planning/drafting_cost.py)

    def vanilla(self) -> float:
        """Seconds per token of vanilla decoding."""
        return (cost_at(self.curve, 1) if self.baseline is None else self.baseline) + self.engine.vanilla

    def step(self, tree: Tree) -> float:
        """Seconds of one speculative step verifying ``tree``."""
        return self.expected_step(tree, {tree.num_nodes: 1.0})

    def expected_step(self, tree, sizes: dict[int, float]) -> float:
        """Seconds of one speculative step drafting ``tree`` whose passes verified N nodes (root included) in a
        share ``sizes[N]`` of them: a drafter that fills only part of its tree (prompt lookup without a match)
        pays the target and the engine for what it verifies, its drafting per depth for the tree it was asked."""
        per_size = sum(share * (cost_at(self.curve, n) + n * self.draft_cost_per_node + self.engine.step(n))
                       for n, share in sizes.items())
        return per_size + self.draft_cost_fixed + tree.depth * self.draft_cost_per_depth

    @classmethod
    def from_record(cls, record: dict) -> CostModel:
        """The cost model a ``cost_curve_record`` (cost_curve.json) holds."""
        if not isinstance(record, dict) or not isinstance(record.get("curve"), dict):  # else a bare AttributeError
            raise ValueError(f"CostModel.from_record takes a cost record ({{\"curve\": {{tree tokens: seconds}}, "
                             f"...}}, as cost_curve.json holds), got {type(record).__name__}: {str(record)[:80]}")
        return cls({int(n): float(t) for n, t in record["curve"].items()}, float(record.get("draft_cost_fixed") or 0.0),
                   float(record.get("draft_cost_per_depth") or 0.0), record.get("baseline"),
                   EngineCost.from_record(record), float(record.get("draft_cost_per_node") or 0.0))

    def record(self, **about) -> dict:
        return cost_curve_record(self.curve, draft_cost_fixed=self.draft_cost_fixed,
                                 draft_cost_per_depth=self.draft_cost_per_depth, baseline=self.baseline,
                                 engine=self.engine, draft_cost_per_node=self.draft_cost_per_node, **about)


def cost_model(curve, draft_cost_per_depth: float = 0.0, draft_cost_fixed: float = 0.0, baseline: float | None = None,
               engine: EngineCost | None = None, draft_cost_per_node: float = 0.0) -> CostModel:
    """``curve`` as is when it is a CostModel, else the CostModel of these terms."""
    if isinstance(curve, CostModel):
        return curve
    return CostModel(curve, draft_cost_fixed, draft_cost_per_depth, baseline, engine or EngineCost(),
                     draft_cost_per_node)


class RankAccuracy:
    """τ from per-depth top-k rank accuracies acc[d][r] (Medusa's estimate, depths independent): the trees are
    the accuracy-grown ones at every node budget 0..max_nodes (analysis.grow_tree)."""

    def __init__(self, accuracy):
        self.accuracy = accuracy

    def trees(self, max_nodes: int) -> list[Tree]:
        acc = self.accuracy
        max_paths = sum(math.prod(len(row) for row in acc[:d]) for d in range(1, len(acc) + 1))
        return [grow_tree(acc, b) for b in range(0, min(max_nodes, max_paths) + 1)]

    def predicts(self, tree) -> bool:
        # a static tree: expected_tree_tokens_from_rank_accuracy names one it cannot cover; a dynamic tree's shape
        # is grown per step, which no closed form here covers
        return isinstance(tree, Tree)

    def tau(self, tree: Tree) -> float:
        return expected_tree_tokens_from_rank_accuracy(tree, self.accuracy)


class ChainTable:
    """τ[γ] of chains γ = 0..D measured for one acceptance rule (treespec.planning.chain_tau: the closed form per
    sampled draft, averaged over drafts): the trees are those chains. Branching trees are not predicted (no closed form
    for traversal verification of a tree here)."""

    def __init__(self, tau: list[float], rule: str = ""):
        self.table, self.rule = [float(t) for t in tau], rule

    def trees(self, max_nodes: int) -> list[Tree]:
        return [Tree.chain(g) for g in range(0, min(max_nodes, len(self.table) - 1) + 1)]

    def predicts(self, tree: Tree) -> bool:
        return tree.is_chain and tree.depth < len(self.table)

    def tau(self, tree: Tree) -> float:
        if not self.predicts(tree):
            raise ValueError(f"{tree!r}: chain τ is measured for chains of depth <= {len(self.table) - 1} only")
        return self.table[tree.depth]


class RankChains(RankAccuracy):
    """RankAccuracy's estimate over chains only (γ = 0..D), for a rule that verifies chains (block verification)."""

    def trees(self, max_nodes: int) -> list[Tree]:
        return [Tree.chain(g) for g in range(0, min(max_nodes, len(self.accuracy)) + 1)]


def is_tau_source(x) -> bool:
    """Whether ``x`` is a τ source (``trees``, ``predicts``, ``tau``): RankAccuracy, ChainTable, or τ measured per
    tree by decoding (treespec/planning/measured_tau.py's MeasuredTrees), rather than rank accuracies acc[d][r]."""
    return all(callable(getattr(x, name, None)) for name in ("trees", "predicts", "tau"))


def tau_source(accuracy):
    """What τ predictions come from: a source as is, or rank accuracies acc[d][r] (RankAccuracy)."""
    return accuracy if is_tau_source(accuracy) else RankAccuracy(accuracy)


def chains_only(accuracy):
    """``tau_source(accuracy)`` choosing among chains only: what "auto" grows from under a rule that verifies
    chains (block), so it never picks a tree the rule refuses."""
    source = tau_source(accuracy)
    if isinstance(source, RankAccuracy) and not isinstance(source, RankChains):
        return RankChains(source.accuracy)
    return source.chains_only() if callable(getattr(source, "chains_only", None)) else source


def predict(tree: Tree, accuracy, curve: dict[int, float] | CostModel, draft_cost_per_depth: float = 0.0,
            draft_cost_fixed: float = 0.0, baseline: float | None = None, engine: EngineCost | None = None
            ) -> Prediction:
    """Predicted τ and speedup of ``tree``. ``accuracy``: rank accuracies acc[d][r], or a ``tau_source`` (a
    ``ChainTable`` for sampled chains). ``curve``: a ``CostModel``, or the target's curve with the other terms
    (``cost_model``): drafting costs ``draft_cost_fixed`` + depth × per-depth seconds (a draft model runs one
    forward per depth; Medusa heads one call in all), ``baseline`` the target's one-token forward alone (default
    the curve's one-token cost; pass it when ``curve`` was timed between drafting calls), ``engine`` the loop's own
    cost per step (none: zeros)."""
    costs = cost_model(curve, draft_cost_per_depth, draft_cost_fixed, baseline, engine)
    vanilla = costs.vanilla()
    if not len(tree):  # no candidates: nothing is drafted, so this is vanilla decoding
        return Prediction(tree, 1.0, vanilla, 1.0, vanilla)
    source = tau_source(accuracy)
    tau = source.tau(tree)
    # τ measured by decoding knows the sizes its passes verified (measured_tau.py); other sources fill their trees
    sizes = source.sizes(tree) if callable(getattr(source, "sizes", None)) else {tree.num_nodes: 1.0}
    step = costs.expected_step(tree, sizes)
    return Prediction(tree, tau, step, tau * vanilla / step, vanilla)


def predict_generation(pred: Prediction, prompt_tokens: int, new_tokens: int, prefill_curve: dict[int, float] | None,
                       baseline: float | None = None) -> float:
    """Predicted speedup of one whole generation: the prefill (``cost_at(prefill_curve, prompt_tokens)``; none
    without a curve) commits the first token in both cases, then vanilla decoding pays ``baseline`` per token
    (default ``pred.vanilla``: its pass and the engine's step) and speculation ``pred.step_cost`` per pass of
    ``pred.tau`` tokens. Short answers after long prompts gain little, whatever the per-step speedup."""
    baseline = pred.vanilla if baseline is None else baseline
    prefill = cost_at(prefill_curve, prompt_tokens) if prefill_curve else 0.0
    rest = max(0, new_tokens - 1)
    vanilla = prefill + rest * baseline
    speculative = prefill + rest / pred.tau * pred.step_cost
    return vanilla / speculative if speculative > 0 else 1.0


def choose_tree(accuracy, curve: dict[int, float] | CostModel, *, max_nodes: int = 64,
                draft_cost_per_depth: float = 0.0, draft_cost_fixed: float = 0.0, baseline: float | None = None,
                engine: EngineCost | None = None) -> tuple[Prediction, list[Prediction]]:
    """The candidate tree with the highest predicted speedup, and all candidates' predictions. ``accuracy``:
    rank accuracies (the accuracy-grown trees, budgets 0..max_nodes) or a ``tau_source`` (a ``ChainTable``:
    chains γ = 0..D); the costs as ``predict`` takes them. Budget 0 / γ = 0 is no speculation at all: when no
    tree is predicted to beat vanilla decoding (a drafter that rarely agrees with the target at this
    temperature), "auto" does not draft."""
    source = tau_source(accuracy)
    costs = cost_model(curve, draft_cost_per_depth, draft_cost_fixed, baseline, engine)
    preds = [predict(tree, source, costs) for tree in source.trees(max_nodes)]
    return max(preds, key=lambda p: p.speedup), preds


def auto_chooser(curve: dict[int, float] | CostModel, draft_cost_fixed: float = 0.0, draft_cost_per_depth: float = 0.0,
                 baseline: float | None = None, engine: EngineCost | None = None):
    """The ``choose(accuracy, max_nodes) -> Tree`` that tree_spec.build_tree needs for kind "auto" (``accuracy``:
    rank accuracies or a ``tau_source``, see ``choose_tree``; the costs a CostModel or its terms)."""
    costs = cost_model(curve, draft_cost_per_depth, draft_cost_fixed, baseline, engine)

    def choose(accuracy, max_nodes: int) -> Tree:
        best, _ = choose_tree(accuracy, costs, max_nodes=max_nodes)
        return best.tree

    return choose


# -- a saved cost curve (what "auto" chooses with in generate()) ------------------------------------------------
def cost_curve_record(curve: dict[int, float], *, draft_cost_fixed: float = 0.0, draft_cost_per_depth: float = 0.0,
                      baseline: float | None = None, engine: EngineCost | None = None,
                      draft_cost_per_node: float = 0.0, **about) -> dict:
    """What cost_curve.json holds: the curve {tree tokens: seconds}, the drafting costs (seconds per proposal, per
    depth, per node), the target's one-token forward alone (None: the curve's one-token cost), the engine's cost per
    step (``EngineCost.record``: engine_vanilla, engine_fixed, engine_per_node), and ``about`` (device,
    machine, context length) for the reader."""
    return {"curve": {int(n): float(t) for n, t in curve.items()}, "draft_cost_fixed": float(draft_cost_fixed),
            "draft_cost_per_depth": float(draft_cost_per_depth), "draft_cost_per_node": float(draft_cost_per_node),
            "baseline": baseline,
            **(engine or EngineCost()).record(), **about}


def save_cost_curve(folder, curve: dict[int, float], **kwargs) -> Path:
    """Write ``cost_curve_record(curve, **kwargs)`` to ``folder/cost_curve.json`` (beside a drafter's weights)."""
    return write_cost_record(Path(folder) / COST_CURVE_FILE, cost_curve_record(curve, **kwargs))


def write_cost_record(path, record: dict) -> Path:
    """``record`` (a ``cost_curve_record``) as JSON at ``path``, checked first (``check_cost_record``)."""
    record = check_cost_record(record, path, measured=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(Path(path), record, indent=1)


def read_cost_curve(folder) -> dict | None:
    """The record ``save_cost_curve`` wrote in ``folder``, or None when it holds none."""
    return read_cost_record(Path(folder) / COST_CURVE_FILE)


def read_cost_record(path) -> dict | None:
    """The ``cost_curve_record`` at ``path`` (fields it lacks, e.g. the engine's in an older file, as zeros), or
    None when there is no file (a folder or a broken link in its place is an error); checked (``check_cost_record``)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    data = check_cost_record(read_json(path, "cost curve file"), path)
    engine = EngineCost.from_record(data)
    return cost_curve_record(data["curve"], engine=engine,
                             **{k: v for k, v in data.items() if k != "curve" and k not in engine.record()})


def saved_chooser(record: dict):
    """``auto_chooser`` of the ``CostModel`` a ``cost_curve_record`` holds."""
    return auto_chooser(CostModel.from_record(record))
