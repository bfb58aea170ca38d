"""τ as the training metric: the acceptance length a drafter's per-depth accuracies imply, measured every
``trainer.eval_every`` steps of a drafter run on the target's own continuations of held-out text.

Why those windows: decoding verifies the target's own text, and a drafter agrees with the target far more
there than on human-written text (train/training/data.py ``own_continuations``); accuracies measured on them predict
the τ decoding reaches, accuracies on human text underestimate it. The continuations are generated once
(greedy) at the start of the run, so each evaluation is one pass of the drafter over a small fixed set.

From the accuracies acc[d][r] (heads/training/accuracy.py: the drafter's rank-r token at depth d + 1 is the target's
argmax) the analysis (treespec.planning.analysis: Medusa's estimate, depths taken as independent) gives

- ``eval/acc_depth_k``: top-1 at depth k (k = 1..the drafter's measured depth);
- ``eval/expected_tau_chain``: a chain as deep as the measured depths, 1 + Σ_k Π_{j≤k} acc[j][0];
- ``eval/expected_tau_tree16``: the 16-node accuracy tree (``analysis.grow_tree``), the best static tree of that
  size under the estimate.

The end of the run decodes on the 16-node accuracy tree of the last accuracies too (train/training/drafter_job.py) and
sets its measured τ beside the expected one (``against_measured``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from treespec.planning.analysis import expected_tree_tokens_from_rank_accuracy, grow_tree
from treespec.train.training.data import own_continuations
from treespec.train.training.log import read_metrics
from treespec.tree import Tree

TREE_NODES = 16
# The analysis's stated accuracy (docs/results.md, "How well predictions match"): within ~10 % of the measured
# τ on chains; on trees the measured τ is usually lower (a depth's accuracy depends on the earlier ones).
STATED_ERROR = 0.10
STATED_ERROR_TEXT = "within ~10 % on chains; on trees the measured τ is usually lower"
PLOT_FILE = "expected_tau.png"


def accuracy_tree(acc: list[list[float]]) -> Tree:
    """The 16-node accuracy tree of acc (fewer nodes when acc holds fewer rank paths)."""
    available = sum(math.prod(len(row) for row in acc[:k]) for k in range(1, len(acc) + 1))  # every rank path
    return grow_tree(acc, min(TREE_NODES, available))


def expected_taus(acc: list[list[float]]) -> dict:
    """acc[d][r] → {"chain": expected τ of the chain as deep as acc, "tree16": of the 16-node accuracy tree}."""
    return {"chain": expected_tree_tokens_from_rank_accuracy(Tree.chain(len(acc)), acc),
            "tree16": expected_tree_tokens_from_rank_accuracy(accuracy_tree(acc), acc)}


def tau_metrics(acc: list[list[float]]) -> dict:
    """The logged metrics of one measurement (module docstring)."""
    tau = expected_taus(acc)
    return {"eval/expected_tau_chain": tau["chain"], "eval/expected_tau_tree16": tau["tree16"],
            **{f"eval/acc_depth_{k + 1}": row[0] for k, row in enumerate(acc)}}


class ExpectedTau:
    """The in-training τ probe: ``probe()`` measures ``rank_accuracy`` on the fixed continuation windows
    [n, lead + new_tokens] and returns ``tau_metrics``; ``accuracy`` keeps the last measurement."""

    def __init__(self, windows: torch.Tensor, rank_accuracy: Callable[[torch.Tensor], list]):
        self.windows, self.rank_accuracy = windows, rank_accuracy
        self.accuracy: list[list[float]] | None = None

    @classmethod
    def prepare(cls, target, held_out: torch.Tensor, rank_accuracy, *, windows: int, context: int, new_tokens: int,
                lead: int, seed: int = 0) -> ExpectedTau:
        """Greedy continuations by ``target`` of the first ``context`` tokens of up to ``windows`` held-out
        windows [n, S] (shorter windows shorten the context)."""
        context = min(int(context), held_out.shape[1])
        held_out = held_out[: int(windows)].long()
        return cls(own_continuations(target, held_out, context=context, new_tokens=int(new_tokens),
                                     lead=min(int(lead), context), seed=seed), rank_accuracy)

    def __call__(self) -> dict:
        self.accuracy = self.rank_accuracy(self.windows)
        return tau_metrics(self.accuracy)

    def last(self) -> list[list[float]]:
        """The last measured accuracies (measured now when there is none: a run resumed at its last step)."""
        if self.accuracy is None:
            self()
        return self.accuracy


def against_measured(acc: list[list[float]], tree16_tau: float, eval_tree, eval_tau: float) -> tuple[dict, list[str]]:
    """The end-of-run decoding evaluation beside the τ the last accuracies ``acc`` predict: ``tree16_tau`` measured
    on ``accuracy_tree(acc)``, and ``eval_tau`` on the evaluation's own ``eval_tree``, predicted too when it is
    static and within acc's depths and ranks (a dynamic tree is grown per step: no prediction). → (summary
    entries, lines of text)."""
    expected = expected_taus(acc)["tree16"]
    error = tree16_tau / expected - 1.0
    entries = {"eval_tau_tree16": tree16_tau, "expected_tau_error": error}
    lines = [f"{len(accuracy_tree(acc))}-node accuracy tree: measured {tree16_tau:.2f}, expected {expected:.2f} "
             f"({error:+.1%}; the analysis: {STATED_ERROR_TEXT})"]
    static = isinstance(eval_tree, Tree)
    if static and len(eval_tree) and int(eval_tree.depths.max()) <= len(acc) and \
            int(eval_tree.ranks.max()) < min(len(row) for row in acc):
        predicted = entries["expected_tau_eval_tree"] = expected_tree_tokens_from_rank_accuracy(eval_tree, acc)
        lines.append(f"evaluation tree ({len(eval_tree)} nodes): measured {eval_tau:.2f}, expected {predicted:.2f} "
                     f"({eval_tau / predicted - 1:+.1%})")
    else:
        why = "deeper or wider than the measured accuracies" if static else "dynamic, grown per step: not predicted"
        lines.append(f"evaluation tree ({eval_tree!r}): measured {eval_tau:.2f} ({why})")
    return entries, lines


def plot(run_dir, measured: float | None = None) -> Path | None:
    """Expected τ (chain, 16-node tree) and per-depth top-1 against the training step, from the run's
    metrics.jsonl, into ``<run_dir>/expected_tau.png`` (``measured``: the decoding evaluation's τ, marked at
    the last step: the end-of-run decoding on the 16-node accuracy tree). None when nothing was measured yet."""
    rows = [r for r in read_metrics(run_dir) if "eval/expected_tau_chain" in r.get("metrics", {})]
    if not rows:
        return None
    import matplotlib  # heavy: only when there is something to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (tau_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    depths = sorted({k for r in rows for k in r["metrics"] if k.startswith("eval/acc_depth_")},
                    key=lambda k: int(k.rsplit("_", 1)[1]))
    for key, label in (("chain", f"chain of {len(depths)}"), ("tree16", f"{TREE_NODES}-node accuracy tree")):
        tau_ax.plot(steps, [r["metrics"][f"eval/expected_tau_{key}"] for r in rows], "o-", ms=3,
                    label=f"expected, {label}")
    if measured is not None:
        tau_ax.plot([steps[-1]], [measured], "k*", ms=11, label=f"measured, {TREE_NODES}-node accuracy tree")
    tau_ax.set(xlabel="training step", ylabel="τ: tokens per target pass", title="expected acceptance length")
    tau_ax.legend(fontsize=8)
    for i, key in enumerate(depths):
        acc_ax.plot(steps, [r["metrics"].get(key, float("nan")) for r in rows], "o-", ms=2.5, lw=1.4,
                    color=plt.cm.viridis(i / max(1, len(depths) - 1)), label=f"depth {key.rsplit('_', 1)[1]}")
    acc_ax.set(xlabel="training step", ylabel="top-1 agreement with the target", ylim=(0, 1.03),
               title="per-depth accuracy (target's own continuations)")
    acc_ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(run_dir) / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
