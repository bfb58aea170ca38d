"""A drafter's data-scaling curve (``scripts/scaling_curve.py``): training runs' summaries and comparison runs read
back into one row per point, the log fit τ = a + b · ln(trained tokens) per τ column and its extrapolation to a goal,
the table and the plot. The script's docstring says what each input may be."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

DEPTHS = 6


def read_point(name: str, run: Path) -> dict:
    """One training run's summary (its folder, or the summary.json itself) → the curve's row for it."""
    path = run if run.suffix == ".json" else run / "summary.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: is {run} a finished scripts/train_heads.py run?")
    s = json.loads(path.read_text())
    if "data_trained_tokens" not in s:
        raise SystemExit(f"{path} has no data_trained_tokens: rerun its export with this version (chat data only)")
    row = {"point": name, "trained_tokens": int(s["data_trained_tokens"]),
           "conversations": s.get("data_train_conversations"), "steps": s.get("steps"),
           "tokens_seen": s.get("tokens_seen"), "train_s": round(s.get("train_wall_time_s", 0.0)),
           "tau_end_of_run": s.get("eval_mean_accept_length")}
    row.update({f"top1_d{d}": s.get(f"depth{d}_top1") for d in range(1, DEPTHS + 1)})
    return row


def read_comparison(folder: Path) -> tuple[list[dict], list[dict]]:
    """A comparison run's rows: summary.csv (each configuration's best) and, when there, results.csv (every tree)."""
    path = folder / "summary.csv"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: is {folder} a finished scripts/compare_trees.py run?")
    with path.open() as f:
        measured = list(csv.DictReader(f))
    grid = []
    if (folder / "results.csv").is_file():  # every configuration timed, not only each drafter's fastest
        with (folder / "results.csv").open() as f:
            grid = [r for r in csv.DictReader(f) if r["tau"]]
    return measured, grid


def add_comparison(rows: list[dict], label: str, folders: list[Path]) -> None:
    """Each point's best configuration (by speedup) in the comparison runs of ``label`` (the one that timed it): τ
    and speedup at it; and, from that run's results.csv when there, the highest τ over every tree timed
    (``taumax_<label>``) and that tree."""
    runs = {folder: read_comparison(folder) for folder in folders}
    for row in rows:
        timed = [folder for folder, (measured, _) in runs.items()
                 if any(r["drafter"] == row["point"] for r in measured)]
        if not timed:
            names = sorted({r["drafter"] for measured, _ in runs.values() for r in measured})
            raise SystemExit(f"{' and '.join(str(f / 'summary.csv') for f in folders)} has no drafter named "
                             f"{row['point']!r} (its drafters: {names})")
        if len(timed) > 1:
            raise SystemExit(f"point {row['point']!r} is timed in both {timed[0]} and {timed[1]}: give the "
                             "comparisons different labels, or name the point differently in one")
        measured, grid = runs[timed[0]]
        mine = [r for r in measured if r["drafter"] == row["point"]]
        best = max(mine, key=lambda r: float(r["speedup"]))
        row[f"tau_{label}"], row[f"speedup_{label}"] = float(best["tau"]), float(best["speedup"])
        row[f"tree_{label}"] = best["tree"]
        if grid:  # the fastest tree may be no speculation (auto declining, τ 1): acceptance shows in the highest τ
            top = max((r for r in grid if r["drafter"] == row["point"]), key=lambda r: float(r["tau"]))
            row[f"taumax_{label}"], row[f"taumax_tree_{label}"] = float(top["tau"]), top["tree"]


def tau_columns(row: dict) -> list[str]:
    """The τ columns a curve fits and plots: each comparison's fastest tree's τ and its highest τ."""
    return [c for c in row if (c.startswith("tau_") or c.startswith("taumax_")) and not c.startswith("taumax_tree")]


def fit_log(tokens: list[int], taus: list[float]) -> tuple[float, float] | None:
    """Least squares τ = a + b · ln(tokens) → (a, b), or None with fewer than two distinct sizes."""
    xs = [math.log(t) for t in tokens]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(taus) / len(taus)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, taus, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def tokens_for(goal: float, a: float, b: float) -> float | None:
    """The trained tokens at which the fitted line reaches ``goal`` (None if it never rises)."""
    return math.exp((goal - a) / b) if b > 0 else None


def fits(rows: list[dict], goal: float) -> list[str]:
    lines = []
    for column in tau_columns(rows[0]):
        points = [(r["trained_tokens"], r[column]) for r in rows if r.get(column) is not None]
        fit = fit_log([t for t, _ in points], [y for _, y in points])
        if fit is None:
            lines.append(f"- {column}: fewer than two data sizes, no fit")
            continue
        a, b = fit
        need = tokens_for(goal, a, b)
        reach = (f"τ {goal} at about {need / 1e6:.3g}M trained tokens ({need / points[-1][0]:.3g}× the largest "
                 "point), if the trend held" if need else
                 f"the slope is {b:.3f} ≤ 0: more data does not reach τ {goal}")
        lines.append(f"- {column}: τ = {a:.3f} + {b:.3f} · ln(tokens) over {len(points)} points; {reach}")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["trained_tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for d in range(1, DEPTHS + 1):
        left.plot(tokens, [r[f"top1_d{d}"] for r in rows], marker="o", label=f"depth {d}")
    left.set(xscale="log", xlabel="trained assistant tokens", ylabel="held-out top-1", title="acceptance by depth")
    left.legend(fontsize=8)
    for column in tau_columns(rows[0]):
        right.plot(tokens, [r[column] for r in rows], marker="o", label=column)
    right.set(xscale="log", xlabel="trained assistant tokens", ylabel="τ (tokens per target pass)",
              title="τ: fastest tree, and highest over trees")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_curve(rows: list[dict], goal: float, out: Path) -> str:
    """``curve.csv``, ``curve.md`` (the table and the fits) and ``curve.png`` under ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "curve.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    columns = list(rows[0])
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |"
              for r in rows]
    text = "\n".join(["# Data-scaling curve", "", *table, "", f"Fits (goal τ {goal}):", *fits(rows, goal)])
    (out / "curve.md").write_text(text + "\n")
    plot(rows, out / "curve.png")
    return text
