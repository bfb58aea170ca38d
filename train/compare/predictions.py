"""How well a comparison's predictions matched its measurements: predicted ÷ measured speedup per configuration,
the median |predicted ÷ measured − 1| over the predicted ones, and where ``tree=auto`` landed against the run's
best (train/compare/report.py shows them; ``python scripts/prediction_error.py RUN`` prints them for a run folder).

The predicted speedup is of whole generations (prefill, each prompt's length and answer length;
``autotree.predict_generation``) and the measured one the median of per-prompt ratios to vanilla, so both speak of
the same thing. Vanilla is 1 by definition on both sides and is left out.
"""

from __future__ import annotations

import statistics

from treespec.train.compare.tables import DASH, missing


def ratio(record: dict) -> float | None:
    """predicted ÷ measured speedup of one results.json record, or None where either is absent."""
    predicted, measured = record.get("predicted_speedup"), record.get("speedup")
    if record.get("config") == "vanilla" or missing(predicted) or missing(measured) or measured <= 0:
        return None
    return predicted / measured


def predicted_text(record: dict) -> str:
    """A record's predicted speedup as the report prints it: "1.23× (1.10–1.31)" with the interval its cost terms'
    spread gives (treespec/planning/uncertainty.py), the point alone without one, "–" without a prediction."""
    point, lo, hi = (record.get(k) for k in ("predicted_speedup", "predicted_speedup_lo", "predicted_speedup_hi"))
    if missing(point):
        return DASH
    return f"{point:.2f}×" + ("" if missing(lo) or missing(hi) else f" ({lo:.2f}–{hi:.2f})")


def summary(records: list[dict]) -> dict | None:
    """{"n", "median_abs_error", "median_ratio", "lo", "hi"} over the records with a prediction, or None."""
    ratios = [r for r in map(ratio, records) if r is not None]
    if not ratios:
        return None
    return {"n": len(ratios), "median_abs_error": statistics.median(abs(r - 1) for r in ratios),
            "median_ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios)}


def auto_against_best(records: list[dict]) -> list[dict]:
    """Each "auto" configuration's measured speedup ÷ the best measured speedup of the run (its drafter's and any
    drafter's): {"config", "speedup", "of_drafter_best", "of_run_best"}."""
    measured = [r for r in records if r.get("config") != "vanilla" and not missing(r.get("speedup"))]
    if not measured:
        return []
    best = max(r["speedup"] for r in measured)
    out = []
    for r in measured:
        if r.get("tree") != "auto":
            continue
        own = max(x["speedup"] for x in measured if x.get("drafter") == r.get("drafter"))
        out.append({"config": r["config"], "speedup": r["speedup"], "of_drafter_best": r["speedup"] / own,
                    "of_run_best": r["speedup"] / best})
    return out


def summary_line(records: list[dict]) -> str | None:
    """One sentence for results.md, or None when nothing was predicted."""
    s = summary(records)
    if s is None:
        return None
    spread = any(not missing(r.get("predicted_speedup_lo")) for r in records)
    return (f"Predictions: median |predicted ÷ measured − 1| = {100 * s['median_abs_error']:.1f} % over the "
            f"{s['n']} predicted configurations (predicted ÷ measured {s['lo']:.2f}–{s['hi']:.2f}, median "
            f"{s['median_ratio']:.2f})." + (" A predicted speedup's interval is how far the spread of the rounds its "
                                           "cost terms were timed in moves it (the machine's noise; not τ's)."
                                           if spread else ""))


def text(records: list[dict]) -> str:
    """What ``scripts/prediction_error.py`` prints: every predicted configuration's ratio, the median error, and
    where "auto" landed."""
    lines = [f"{'configuration':<48} {'predicted':>9} {'measured':>9} {'pred ÷ meas':>11}"]
    for r in records:
        x = ratio(r)
        if x is not None:
            lines.append(f"{r['config']:<48} {r['predicted_speedup']:>8.2f}× {r['speedup']:>8.2f}× {x:>11.2f}"
                         + ("" if missing(r.get("predicted_speedup_lo")) else
                            f"  (predicted {r['predicted_speedup_lo']:.2f}–{r['predicted_speedup_hi']:.2f})"))
    s = summary(records)
    lines.append(summary_line(records) if s else "no configuration has both a prediction and a measurement")
    if s:
        lines.append(f"median |predicted ÷ measured − 1|: {s['median_abs_error']:.3f}")
    for a in auto_against_best(records):
        lines.append(f"{a['config']}: measured {a['speedup']:.2f}×, {a['of_drafter_best']:.2f} of its drafter's best, "
                     f"{a['of_run_best']:.2f} of the run's best")
    return "\n".join(lines)
