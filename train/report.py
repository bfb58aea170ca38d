"""The comparison's report: results.csv / .md / .json, cost_curve.csv, plots and the wandb run, from the
harness's measurements (train/compare.py). Nothing here measures anything."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from treespec.bench import Row


def write_outputs(result: dict, out_dir: Path, logger=None) -> None:
    rows, meta, curve = result["rows"], result["meta"], result["cost_curve"]
    fields = ["config", "drafter", "tree", "nodes", "depth", "tau", "predicted_tau", "tokens_per_s", "speedup",
              "predicted_speedup", "target_passes", "new_tokens", "overhead_fraction"]
    records = [{"config": r.name, **meta[r.name], "tau": r.tau, "tokens_per_s": r.tokens_per_s, "speedup": r.speedup,
                "target_passes": r.target_passes, "new_tokens": r.new_tokens,
                "overhead_fraction": r.overhead_fraction} for r in rows]
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: rec[k] for k in fields} for rec in records)
    with open(out_dir / "cost_curve.csv", "w") as f:
        f.write("tree_tokens,seconds\n" + "".join(f"{n},{t:.6f}\n" for n, t in curve.items()))
    lines = ["| drafter | tree | nodes | τ | predicted τ | tokens/s | speedup | predicted speedup | engine overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        lines.append(f"| {rec['drafter']} | {rec['tree']} | {rec['nodes']} | {rec['tau']:.2f} | "
                     f"{rec['predicted_tau']:.2f} | {rec['tokens_per_s']:.1f} | {rec['speedup']:.2f}× | "
                     f"{rec['predicted_speedup']:.2f}× | {100 * rec['overhead_fraction']:.1f}% |")
    if result.get("peers"):
        lines += ["", "| peer (same prompts) | tokens/s | speedup vs treespec vanilla | treespec best ÷ peer |",
                  "|---|---|---|---|"]
        lines += [f"| {p['name'].replace('|', '/')} | {p['tokens_per_s']:.1f} | {p['speedup_vs_vanilla']:.2f}× | "
                  f"{p['treespec_best_over_this']:.2f} |" for p in result["peers"]]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"records": records, "peers": result.get("peers"), "best": result["best"],
         "cost_curve": {str(n): t for n, t in curve.items()},
         "accept_lengths": {r.name: r.accept_lengths for r in rows}}, indent=1, default=float))
    plot(records, rows, out_dir)
    if logger is not None:
        log_wandb(logger, records, rows, result, out_dir)


def plot(records: list[dict], rows: list[Row], out_dir: Path) -> None:
    import matplotlib  # heavy, and only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_drafter: dict[str, list[dict]] = {}
    for rec in records[1:]:
        by_drafter.setdefault(rec["drafter"], []).append(rec)
    for key, ylabel, fname in (("tau", "τ (tokens per target pass)", "tau_vs_nodes.png"),
                               ("speedup", "speedup over vanilla", "speedup_vs_nodes.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter, recs in by_drafter.items():
            recs = sorted(recs, key=lambda r: r["nodes"])
            ax.plot([r["nodes"] for r in recs], [r[key] for r in recs], "o", label=f"{drafter} measured")
            if not all(math.isnan(r[f"predicted_{key}"]) for r in recs):
                ax.plot([r["nodes"] for r in recs], [r[f"predicted_{key}"] for r in recs], "x", alpha=0.6,
                        label=f"{drafter} predicted")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes (candidates)")
        ax.set_ylabel(ylabel)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
    best_per_drafter = {}
    for row in rows[1:]:
        drafter = row.name.split(" | ")[0]
        if drafter not in best_per_drafter or row.speedup > best_per_drafter[drafter].speedup:
            best_per_drafter[drafter] = row
    fig, axes = plt.subplots(1, max(1, len(best_per_drafter)), figsize=(4 * max(1, len(best_per_drafter)), 3),
                             squeeze=False)
    for ax, row in zip(axes[0], best_per_drafter.values(), strict=False):
        top = max(row.accept_lengths, default=1)
        ax.hist(row.accept_lengths, bins=range(1, top + 2), align="left", rwidth=0.8)
        ax.set_title(f"{row.name}\nτ={row.tau:.2f}", fontsize=8)
        ax.set_xlabel("tokens committed per pass")
    fig.tight_layout()
    fig.savefig(out_dir / "accept_length_hist.png", dpi=120)
    plt.close(fig)


def log_wandb(logger, records, rows, result, out_dir: Path) -> None:
    logger.log({f"compare/{rec['config']}/{k}": rec[k] for rec in records for k in ("tau", "tokens_per_s", "speedup")})
    for row in rows[1:]:
        logger.histogram(f"accept_length/{row.name}", row.accept_lengths)
    logger.summary({"best": result["best"], "peers": result.get("peers"), "records": records})
    if logger.wandb is not None:
        import wandb  # optional: only when the run logs to wandb

        logger.wandb.log({"results": wandb.Table(columns=list(records[0]), data=[list(r.values()) for r in records]),
                          **{p.stem: wandb.Image(str(p)) for p in out_dir.glob("*.png")}})
