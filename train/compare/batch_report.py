"""The batch-size part of the comparison's report (train/compare/batch_compare.py measures it): per batch size B and
drafter, the best configuration's τ, tokens/s and speedups with bootstrap intervals over batches, what
tree=auto chose at that B, and where speculation stops paying; batch.md, batch.csv and the figure
speedup_vs_batch.png (train/compare/plots.py). Rendered from results.json's "batch" section, like the rest.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from treespec.train.compare.plots import level_text, plot_batch_sizes
from treespec.train.compare.stats import Estimate, groups_of, median_interval, tau_interval
from treespec.train.compare.tables import DASH, md_table, with_interval

PEER = "transformers batched"


def analyse_batches(section: dict, bootstrap: dict) -> dict:
    """{"sizes": [B...], "configs": {B: {name: record + estimates}}, "bests": {drafter: {B: config}},
    "auto": {drafter: {B: config}}, "stops": {drafter: B or None}}: estimates over batches (each batch one group).
    A drafter's best at B is its fastest configuration that speculates (a tree=auto that chose the empty tree
    is vanilla decoding: it shows in "auto" only)."""
    kw = {k: bootstrap[k] for k in ("samples", "level", "seed")}
    configs: dict[int, dict[str, dict]] = {}
    for rec in section["records"]:
        runs = rec["runs"]
        size = rec["batch_size"]
        entry = {**rec,
                 "speedup_est": median_interval(groups_of(runs["speedup"], None), **kw),
                 "peer_est": median_interval(groups_of(runs["speedup_vs_transformers"], None), **kw),
                 "tokens_est": median_interval(groups_of(runs["tokens_per_s"], None), **kw),
                 "tau_est": tau_interval(groups_of(runs["accept_lengths"], None), **kw)}
        if rec["config"] == "vanilla":
            entry["speedup_est"] = Estimate(1.0)
        configs.setdefault(size, {})[rec["config"]] = entry
    bests: dict[str, dict[int, dict]] = {}
    autos: dict[str, dict[int, dict]] = {}
    for size, by_name in configs.items():
        for c in by_name.values():
            if c["tree"] == "auto":
                autos.setdefault(c["drafter"], {})[size] = c
            if c["config"] in ("vanilla", PEER) or not c["nodes"]:  # an empty tree does not speculate
                continue
            best = bests.setdefault(c["drafter"], {})
            if size not in best or c["speedup_est"].value > best[size]["speedup_est"].value:
                best[size] = c
    stops = {}
    for drafter, by_size in bests.items():
        # the smallest batch size from which the drafter's best configuration is not surely faster than vanilla
        stops[drafter] = next((size for size in sorted(by_size) if not _surely_faster(by_size[size])), None)
    return {"sizes": sorted(configs), "configs": configs, "bests": bests, "auto": autos, "stops": stops,
            "bootstrap": bootstrap}


def _surely_faster(c: dict) -> bool:
    e = c["speedup_est"]
    return e.value > 1.0 and (not e.has_interval or e.lo > 1.0)


def batch_table(b: dict) -> tuple[list[str], list[list]]:
    level = level_text({"bootstrap": b["bootstrap"]})
    header = ["B", "drafter", "best tree", f"τ ({level} CI)", "tokens/s", f"speedup vs batched vanilla ({level} CI)",
              f"vs transformers batched ({level} CI)", "auto: nodes", "auto: speedup"]
    rows = []
    for size in b["sizes"]:
        by_name = b["configs"][size]
        for name in ("vanilla", PEER):
            if name in by_name:
                c = by_name[name]
                rows.append([size, "vanilla (treespec)" if name == "vanilla" else name, DASH, DASH,
                             with_interval(c["tokens_est"], ".1f"), with_interval(c["speedup_est"], suffix="×"),
                             with_interval(c["peer_est"], suffix="×") if name == "vanilla" else DASH, DASH, DASH])
        for drafter, by_size in b["bests"].items():
            if size not in by_size:
                continue
            c = by_size[size]
            auto = b["auto"].get(drafter, {}).get(size)
            rows.append([size, drafter, c["tree"], with_interval(c["tau_est"]), with_interval(c["tokens_est"], ".1f"),
                         with_interval(c["speedup_est"], suffix="×"), with_interval(c["peer_est"], suffix="×"),
                         DASH if auto is None else (auto["nodes"] or "0 (vanilla)"),
                         DASH if auto is None else with_interval(auto["speedup_est"], suffix="×")])
    return header, rows


def batch_markdown(section: dict, b: dict) -> list[str]:
    """results.md's section (and batch.md's body): the table, how to read it, where speculation stops paying."""
    lines = ["## Batch sizes", ""] + md_table(*batch_table(b))
    counts = section.get("batches_by_size") or {str(size): section["batches"] for size in b["sizes"]}
    batches = ", ".join(f"{n} at B = {size}" for size, n in counts.items())
    lines += ["", f"Batches of B held-out prompts ({batches}: every prompt at least once), {section['max_new_tokens']} "
              "new tokens per row, every configuration interleaved batch by batch. tokens/s: every row's new tokens ÷ "
              "the batch's wall time. Speedup: median over batches of the per-batch ratio to treespec's batched "
              "vanilla decoding at the same B (\"vs transformers batched\": to transformers' batched greedy "
              "generate on the same left-padded batch); intervals resample batches. \"best tree\": the drafter's "
              "fastest measured tree at that B; \"auto\": the tree predicted best at that B from its cost curve over "
              "B × N tokens (0: the empty tree, vanilla decoding); \"auto per B\": the table of its choices at every "
              "size up to B, which generate() follows as rows end (treespec/batch_trees.py)."]
    lines += prediction_lines(b)
    stops = [f"{d}: from B = {s}" if s is not None else f"{d}: still pays at B = {b['sizes'][-1]}"
             for d, s in b["stops"].items()]
    if stops:
        lines += ["", "Where speculation stops paying (the best configuration no longer surely faster than batched "
                  "vanilla decoding): " + "; ".join(stops) + "."]
    return lines


def prediction_errors(b: dict) -> dict[int, list[tuple[str, float, float]]]:
    """{B: [(config, predicted, measured speedup)]} for every configuration predicted at B (vanilla excluded)."""
    out = {}
    for size in b["sizes"]:
        out[size] = [(c["config"], c["predicted_speedup"], c["speedup_est"].value)
                     for c in b["configs"][size].values()
                     if c.get("predicted_speedup") is not None and c["config"] != "vanilla" and c["speedup_est"].value]
    return out


def prediction_lines(b: dict) -> list[str]:
    """How well whole-generation predictions matched at each B: every predicted configuration, and the median error."""
    errors = prediction_errors(b)
    if not any(errors.values()):
        return []
    lines = ["", "### Predicted against measured", "",
             "Predicted: whole generations of each batch (treespec/planning/batch_generation.py: rows drawing accept "
             "lengths from the tree's predicted distribution, the batch thinning out as rows end, each step at the "
             "cost of the rows left, the prefill in both), the median over batches; \"per step\": the per-step "
             "prediction at the full batch, as before whole generations were predicted.", ""]
    header = ["B", "configuration", "predicted", "per step", "measured", "predicted ÷ measured"]
    rows = []
    for size, entries in errors.items():
        for name, pred, meas in entries:
            step = b["configs"][size][name].get("predicted_step_speedup")
            rows.append([size, name, f"{pred:.2f}×", DASH if step is None else f"{step:.2f}×", f"{meas:.2f}×",
                         f"{pred / meas:.2f}"])
    lines += md_table(header, rows)
    summary = [f"B = {size}: {100 * statistics.median(abs(p / m - 1) for _, p, m in entries):.1f} % over "
               f"{len(entries)}" for size, entries in errors.items() if entries]
    lines += ["", "Median |predicted ÷ measured − 1|: " + "; ".join(summary) + "."]
    return lines


def batch_csv(b: dict) -> list[dict]:
    out = []
    for size in b["sizes"]:
        for c in b["configs"][size].values():
            sp, peer, tau = c["speedup_est"], c["peer_est"], c["tau_est"]
            out.append({"batch_size": size, "config": c["config"], "drafter": c["drafter"], "tree": c["tree"],
                        "nodes": c["nodes"], "tau": tau.value, "tokens_per_s": c["tokens_per_s"],
                        "speedup": sp.value, "speedup_lo": sp.lo, "speedup_hi": sp.hi,
                        "vs_transformers": peer.value, "vs_transformers_lo": peer.lo, "vs_transformers_hi": peer.hi,
                        "predicted_speedup": c.get("predicted_speedup"),
                        "predicted_step_speedup": c.get("predicted_step_speedup")})
    return out


def speedup_lines(b: dict) -> dict[str, list[dict]]:
    """The figure's data: per drafter, its best configuration's speedup at each B (value, lo, hi, tree), and
    transformers' batched generate against treespec's batched vanilla decoding."""
    lines = {}
    for drafter, by_size in b["bests"].items():
        lines[drafter] = [{"size": size, "value": c["speedup_est"].value, "lo": c["speedup_est"].lo,
                           "hi": c["speedup_est"].hi, "tree": c["tree"]} for size, c in sorted(by_size.items())]
    peer = [(size, b["configs"][size][PEER]["speedup_est"]) for size in b["sizes"] if PEER in b["configs"][size]]
    if peer:
        lines[PEER] = [{"size": size, "value": e.value, "lo": e.lo, "hi": e.hi, "tree": "vanilla"} for size, e in peer]
    return lines


def render_batches(result: dict, a: dict, out_dir: Path, text: str, write_csv, figures: bool = True) -> str:
    """batch.md, batch.csv and speedup_vs_batch.png when results.json has a "batch" section; returns results.md's
    ``text`` with the batch section before the full grid (and the figure listed), else ``text`` as it is."""
    section = result.get("batch")
    if not (section and section.get("records")):
        return text
    b = analyse_batches(section, a["bootstrap"])
    lines = batch_markdown(section, b)
    (out_dir / "batch.md").write_text("# Speculation across batch sizes\n\n" + "\n".join(lines[2:]) + "\n")
    write_csv(out_dir / "batch.csv", batch_csv(b))
    text = text.replace("\n## All configurations", "\n" + "\n".join(lines) + "\n\n## All configurations", 1)
    if figures:
        s = result.get("settings", {})
        sampling = "greedy" if not s.get("temperature") else f"T={s['temperature']}"
        plot_batch_sizes(speedup_lines(b), out_dir, level=level_text(a),
                         subtitle=f"{section['max_new_tokens']} tokens per row, {sampling}")
        text = text.replace("## Figures\n", "## Figures\n\n![speedup vs batch size](speedup_vs_batch.png)\n", 1)
    return text
