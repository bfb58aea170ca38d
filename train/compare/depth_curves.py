"""Per-depth acceptance curves of comparison runs, drafters side by side on the same trees
(``scripts/acceptance_by_depth.py``).

For one configuration (a drafter on a tree), the curve is P(a verification pass accepts at least d drafted
tokens) for d = 1..the tree's depth, from the accept lengths the run measured (``results.json``: each pass
commits its accepted tokens plus one, so d drafted tokens accepted ⇔ accept length ≥ d + 1). On a chain it is
the product of the per-depth acceptance rates, the curve the analysis (treespec.planning.analysis) predicts from
per-depth accuracies; two drafters on the same tree differ exactly where their curves part.
"""

from __future__ import annotations

import json
from pathlib import Path


def survival(accept_lengths: list[int], depth: int) -> list[float]:
    """[P(accepted drafted tokens ≥ d) for d = 1..depth] of passes that committed ``accept_lengths`` tokens."""
    n = len(accept_lengths)
    return [sum(1 for a in accept_lengths if a >= d + 1) / n if n else float("nan") for d in range(1, depth + 1)]


def curves(results: list[dict], trees: list[str] | None = None) -> dict[str, dict[str, dict]]:
    """{tree label: {config name: {"depth", "passes", "tau", "survival"}}} over the runs' configurations on
    the same trees (``trees``: these tree labels only; default every tree at least two configurations share).
    Config names get their run's folder name when several runs are given."""
    by_tree: dict[str, dict[str, dict]] = {}
    for result in results:
        tag = f" ({result['_run']})" if len(results) > 1 else ""
        for rec in result["records"]:
            lengths = [n for run in (rec.get("runs") or {}).get("accept_lengths", []) for n in run]
            if rec["drafter"] == "vanilla" or not lengths or not rec.get("depth"):
                continue
            rule = f" | {rec['acceptance']}" if rec.get("acceptance") not in (None, "rejection") else ""
            by_tree.setdefault(rec["tree"] + rule, {})[rec["drafter"] + tag] = {
                "depth": rec["depth"], "passes": len(lengths), "tau": sum(lengths) / len(lengths),
                "survival": survival(lengths, rec["depth"])}
    return {t: c for t, c in by_tree.items() if (t in trees if trees else len(c) > 1)}


def load(run_dir) -> dict:
    result = json.loads((Path(run_dir) / "results.json").read_text())
    result["_run"] = Path(run_dir).name
    return result


def table(by_tree: dict[str, dict[str, dict]]) -> str:
    """Markdown: per tree, one row per configuration with P(≥ d) at each depth."""
    out = []
    for tree, configs in by_tree.items():
        depth = max(c["depth"] for c in configs.values())
        out += [f"**{tree}**", "", "| drafter | passes | τ | " + " | ".join(f"P(≥{d})" for d in range(1, depth + 1))
                + " |", "|---|---|---|" + "---|" * depth]
        out += [f"| {name} | {c['passes']} | {c['tau']:.2f} | " + " | ".join(f"{p:.3f}" for p in c["survival"]) + " |"
                for name, c in configs.items()]
        out.append("")
    return "\n".join(out)


def plot(by_tree: dict[str, dict[str, dict]], path, title: str) -> Path:
    """One panel per tree: each configuration's P(≥ d) against d."""
    import matplotlib  # heavy, only this figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(by_tree))
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols + 0.5, 2.8 * rows + 0.6), sharey=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (tree, configs) in zip(flat, by_tree.items(), strict=False):
        for name, c in configs.items():
            ax.plot(range(1, c["depth"] + 1), c["survival"], marker="o", label=f"{name} (τ {c['tau']:.2f})")
        ax.set_title(tree, fontsize=8)
        ax.set_xlabel("draft depth d")
        ax.legend(fontsize=7)
    for ax in flat[len(by_tree):]:
        ax.set_axis_off()
    for row in axes:
        row[0].set_ylabel("P(pass accepts ≥ d drafted)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
