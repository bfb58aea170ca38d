"""τ measured by decoding, per tree: the τ source of a drafter that has no rank accuracies (the model-free kinds:
prompt lookup, SuffixDecoding, Token Recycling, REST, Lookahead).

A model-free drafter has no fixed ranks to score, so nothing predicts its τ in closed form: how often an n-gram
matches, or a suffix index holds the continuation, is a property of the text. What it has instead is a short dry run
(treespec/planning/dry_run.py): a few held-out prompts decoded with the drafter itself over each candidate tree, at
the run's sampling and acceptance rule, counting what every pass committed. Each candidate becomes a ``TreeRun``: its
τ, the share of passes that verified each number of nodes (a model-free drafter often fills only part of its tree:
prompt lookup proposes nothing when no n-gram matches, so a pass verifies the root alone) and its drafting as a
fraction of a one-token pass. ``MeasuredTrees`` is the τ source over them, as ``autotree.RankAccuracy`` is over
accuracies: its trees are the measured ones (chains, the drafter's own template or dynamic budget) and the empty
tree, which "auto" weighs against them.

Predictions charge a measured tree by the sizes its passes verified (``CostModel.expected_step``), not by its
nominal size. Kept beside a profile as measured_trees.json (``save_measured_trees`` / ``read_measured_trees``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from treespec.dynamic_tree import DynamicTree
from treespec.io import atomic_write_json, read_measurements
from treespec.planning.tree_spec import build_tree, tree_to_spec
from treespec.sampling import Sampling
from treespec.tree import Tree
from treespec.walker import ACCEPTANCE_MODES

MEASURED_TREES_FILE = "measured_trees.json"


@dataclass(frozen=True)
class TreeRun:
    """One candidate tree's dry run: ``tau`` (tokens committed per pass, bonus included), ``sizes`` {nodes verified,
    root included: share of passes}, ``drafting`` (the drafter's proposal and updates per pass, as a fraction of a
    one-token target pass timed alongside) and the ``passes`` these come from."""

    tree: Tree | DynamicTree
    tau: float
    sizes: dict[int, float]
    drafting: float
    passes: int

    def __post_init__(self):
        # what "auto" weighs: a NaN τ once chose vanilla unsaid, shares summing to 5 or none a cost 5x or 1/0
        where, number = f"the dry run of {self.tree!r}", lambda v: isinstance(v, (int, float)) and not isinstance(
            v, bool) and math.isfinite(v)
        # no upper bounds from the tree: a drafter may verify more than the tree it is given (Combined merges its
        # members' proposals: 3 nodes at chain depth 1)
        if not (number(self.tau) and self.tau >= 1):
            raise ValueError(f"{where}: tau (tokens per pass) must be a number >= 1, got {self.tau!r}")
        shares = self.sizes.values() if isinstance(self.sizes, dict) else ()
        if not (shares and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.sizes)
                and all(number(v) and v >= 0 for v in shares) and abs(sum(shares) - 1) < 1e-6):
            raise ValueError(f"{where}: sizes must map nodes verified (root included, >= 1) to shares of passes "
                             f"summing to 1, got {self.sizes!r}")
        if not (number(self.drafting) and self.drafting >= 0):
            raise ValueError(f"{where}: drafting must be a fraction of a pass >= 0, got {self.drafting!r}")
        if isinstance(self.passes, bool) or not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"{where}: passes must be an integer >= 1, got {self.passes!r}")

    @property
    def mean_nodes(self) -> float:
        return sum(n * share for n, share in self.sizes.items())


class MeasuredTrees:
    """τ of the trees a dry run decoded with (module docstring), at ``sampling`` under acceptance ``rule``."""

    def __init__(self, runs: list[TreeRun], sampling: Sampling | None = None, rule: str = "rejection"):
        if rule not in ACCEPTANCE_MODES:
            raise ValueError(f"a measured-trees rule must be one of {ACCEPTANCE_MODES}, got {rule!r}")
        self.runs, self.sampling, self.rule = list(runs), sampling or Sampling(0.0), rule
        self._by_tree = {run.tree: run for run in self.runs}
        if len(self._by_tree) < len(self.runs):  # the later one was read, unsaid
            raise ValueError(f"a measured-trees record holds a tree twice: {[r.tree for r in self.runs]}")

    def __repr__(self) -> str:
        return f"MeasuredTrees({len(self.runs)} trees, {self.rule}, T={self.sampling.temperature})"

    def __eq__(self, other) -> bool:
        return isinstance(other, MeasuredTrees) and (self.runs, self.sampling, self.rule) == (
            other.runs, other.sampling, other.rule)

    def serves(self, sampling: Sampling | None, rule: str) -> bool:
        """Whether it predicts decoding at ``sampling`` (None: any) under ``rule``: measured there, or at greedy under
        another rule (under greedy decoding every rule is the greedy walk: the same tokens per pass)."""
        if sampling is not None and sampling != self.sampling:
            return False
        return rule == self.rule or self.sampling.greedy

    def trees(self, max_nodes: int) -> list[Tree | DynamicTree]:
        """The empty tree (no speculation) and every measured tree of at most ``max_nodes`` candidates."""
        return [Tree.chain(0)] + [run.tree for run in self.runs if len(run.tree) <= max_nodes]

    def predicts(self, tree) -> bool:
        return tree in self._by_tree or (isinstance(tree, Tree) and not len(tree))

    def tau(self, tree) -> float:
        if not len(tree):
            return 1.0
        return self._run(tree).tau

    def sizes(self, tree) -> dict[int, float]:
        """{nodes verified: share of passes} of ``tree`` as decoding met it."""
        return self._run(tree).sizes

    def chains_only(self) -> MeasuredTrees:
        """The measured chains alone: what "auto" chooses among under a rule that verifies chains (block)."""
        return MeasuredTrees([r for r in self.runs if isinstance(r.tree, Tree) and r.tree.is_chain], self.sampling,
                             self.rule)

    def _run(self, tree) -> TreeRun:
        if tree not in self._by_tree:
            measured = ", ".join(map(repr, self._by_tree)) or "none"
            raise ValueError(f"{tree!r} was not measured in this drafter's dry run (measured: {measured}); a drafter "
                             "without rank accuracies is predicted on the trees it decoded with only")
        return self._by_tree[tree]

    # -- files -----------------------------------------------------------------------------------------------
    def record(self, **about) -> dict:
        return {"sampling": asdict(self.sampling), "rule": self.rule,
                "trees": [{"tree": tree_to_spec(r.tree), "tau": r.tau, "sizes": {str(n): s for n, s in r.sizes.items()},
                           "drafting": r.drafting, "passes": r.passes} for r in self.runs], **about}

    @classmethod
    def from_record(cls, data: dict) -> MeasuredTrees:
        try:
            runs = [TreeRun(build_tree(r["tree"]), float(r["tau"]), {int(n): float(s) for n, s in r["sizes"].items()},
                            float(r["drafting"]), int(r["passes"])) for r in data["trees"]]
            return cls(runs, Sampling(**data["sampling"]), str(data["rule"]))
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"a measured-trees record holds sampling, rule and trees of {{tree, tau, sizes, drafting, "
                             f"passes}} ({type(err).__name__}: {err})") from None


def save_measured_trees(folder, measured: list[MeasuredTrees], **about) -> Path:
    """Write ``measured`` (one per sampling and rule) to ``folder``/measured_trees.json."""
    return atomic_write_json(Path(folder) / MEASURED_TREES_FILE,
                             {"measurements": [m.record(**about) for m in measured]}, indent=1)


def read_measured_trees(folder) -> list[MeasuredTrees]:
    """The measurements ``save_measured_trees`` wrote in ``folder`` (none: [])."""
    return read_measurements(Path(folder) / MEASURED_TREES_FILE, "measured trees file", MeasuredTrees.from_record)


def serving(measured: list[MeasuredTrees], sampling: Sampling | None, rule: str) -> MeasuredTrees | None:
    """The first measurement that ``serves`` ``sampling`` and ``rule``, or None."""
    return next((m for m in measured if m.serves(sampling, rule)), None)
