"""The comparison's report, from the harness's measurements (train/compare.py): results.md (stamp, summary,
peers, the full grid), results.csv, summary.csv, cost_curve.csv, the figures and the wandb run. Nothing here
measures anything: everything is rendered from results.json, so ``rerender(run_dir)`` rebuilds a run's
report (``python scripts/compare_trees.py report=PATH``) and ``compare_runs([A, B])`` sets runs side by side.

Uncertainty: per configuration the median speedup (per-prompt ratios to vanilla) and τ, each with a
bootstrap interval over prompts (train/stats.py). A configuration whose speedup interval overlaps the best
one's is "indistinguishable from the best in this run". Missing values print as "–", never "nan".
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .stamp import flatten
from .stats import Estimate, groups_of, median_interval, tau_interval

DASH = "–"
FIGURES = ("speedup_vs_nodes.png", "tau_vs_nodes.png", "accept_length_hist.png", "acceptance_heatmap.png")
BOOTSTRAP = {"samples": 2000, "level": 0.95, "seed": 0}


# ---------------------------------------------------------------------------------------------- formatting

def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and not math.isfinite(x))


def num(x, fmt: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted, or "–" when it does not apply (None, NaN, inf)."""
    return DASH if _missing(x) else f"{x:{fmt}}{suffix}"


def with_interval(e: Estimate | None, fmt: str = ".2f", suffix: str = "") -> str:
    """"1.51× (1.40–1.62)"; the point alone without an interval; "–" without a value."""
    if e is None or _missing(e.value):
        return DASH
    if not e.has_interval:
        return num(e.value, fmt, suffix)
    return f"{e.value:{fmt}}{suffix} ({e.lo:{fmt}}–{e.hi:{fmt}})"


def md_cell(text) -> str:
    return str(text).replace("|", "/")


def md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]


# ---------------------------------------------------------------------------------------------- analysis

def analyse(result: dict) -> dict:
    """Point estimates and bootstrap intervals for every configuration, each drafter's best, the run's best
    and who is indistinguishable from it, the peers' ratios. Deterministic (seeded) given results.json."""
    settings = result.get("settings", {})
    boot = {**BOOTSTRAP, **(settings.get("bootstrap") or {})}
    kw = {"samples": boot["samples"], "level": boot["level"], "seed": boot["seed"]}
    prompt_of_run = result.get("prompt_of_run")
    configs = {}
    for rec in result["records"]:
        runs = rec.get("runs")
        if runs and runs.get("speedup"):
            speedup = median_interval(groups_of(runs["speedup"], prompt_of_run), **kw)
            if rec["config"] == "vanilla":  # the baseline: 1 by definition, nothing to resample
                speedup, tau = Estimate(1.0), Estimate(1.0)
            else:
                tau = tau_interval(groups_of(runs["accept_lengths"], prompt_of_run), **kw)
        else:  # a results.json from before per-prompt values were kept: points only
            speedup, tau = Estimate(rec["speedup"]), Estimate(rec["tau"] if rec["tau"] is not None else math.nan)
        configs[rec["config"]] = {**rec, "speedup_est": speedup, "tau_est": tau}
    measured = [c for c in configs.values() if c["config"] != "vanilla"]
    best = max(measured, key=lambda c: c["speedup_est"].value) if measured else None
    for c in measured:
        if c is best:
            c["verdict"] = "best"
        elif not (c["speedup_est"].has_interval and best["speedup_est"].has_interval):
            c["verdict"] = None  # points only (one prompt, or an old results.json): no call either way
        else:
            c["verdict"] = "indistinguishable" if c["speedup_est"].overlaps(best["speedup_est"]) else "below"
    bests: dict[str, dict] = {}
    for c in measured:
        if c["drafter"] not in bests or c["speedup_est"].value > bests[c["drafter"]]["speedup_est"].value:
            bests[c["drafter"]] = c
    peers = []
    peer_pass = result.get("peer_pass") or {}
    for p in result.get("peers") or []:
        if p["name"] in configs:  # an old results.json listed treespec's vanilla and best among the peers
            continue
        entry = {"name": p["name"], "tokens_per_s": p["tokens_per_s"], "ratios": {}}
        runs = p.get("runs")
        entry["speedup_est"] = median_interval(groups_of(runs["speedup"], prompt_of_run), **kw) if runs else \
            Estimate(p["speedup_vs_vanilla"])
        for drafter, c in bests.items():
            mine = peer_pass.get(c["config"])
            if mine and runs:
                ratios = [a / b for a, b in zip(mine["tokens_per_s"], runs["tokens_per_s"], strict=True)]
                entry["ratios"][drafter] = median_interval(groups_of(ratios, prompt_of_run), **kw)
            elif c is best and p.get("treespec_best_over_this") is not None:
                entry["ratios"][drafter] = Estimate(p["treespec_best_over_this"])
        peers.append(entry)
    return {"configs": configs, "best": best, "bests": bests, "peers": peers, "bootstrap": boot,
            "settings": settings}


def _level(a: dict) -> str:
    return f"{100 * a['bootstrap']['level']:g}%"


VERDICT = {"best": "**best**", "indistinguishable": "≈ best", "below": "below"}
NOISY = 1.5  # vanilla's fastest ÷ slowest prompt run above which the report warns that the machine was busy


def vanilla_spread(a: dict) -> tuple[float, float, float] | None:
    """(min, median, max) of vanilla's tokens/s over the prompt runs; prompts differ a little in length, a
    busy machine a lot."""
    runs = (a["configs"].get("vanilla", {}).get("runs") or {}).get("tokens_per_s") or []
    runs = sorted(x for x in runs if not _missing(x) and x > 0)
    return (runs[0], runs[len(runs) // 2], runs[-1]) if runs else None


def summary_table(a: dict) -> tuple[list[str], list[list]]:
    peer_names = [p["name"] for p in a["peers"]]
    header = ["drafter", "best tree", "nodes", f"τ ({_level(a)} CI)", f"speedup ({_level(a)} CI)",
              "predicted speedup"] + [f"vs {n}" for n in peer_names] + ["vs the run's best"]
    rows = []
    for drafter, c in a["bests"].items():
        rows.append([drafter, c["tree"], c["nodes"], with_interval(c["tau_est"]), with_interval(c["speedup_est"],
                     suffix="×"), num(c["predicted_speedup"], suffix="×")]
                    + [with_interval(p["ratios"].get(drafter), suffix="×") for p in a["peers"]]
                    + [VERDICT.get(c["verdict"], DASH)])
    return header, rows


def summary_records(a: dict) -> list[dict]:
    """The summary table as numbers (summary.csv, wandb): None where a value does not apply."""
    out = []
    for drafter, c in a["bests"].items():
        row = {"drafter": drafter, "config": c["config"], "tree": c["tree"], "nodes": c["nodes"]}
        for key in ("tau", "speedup"):
            e = c[f"{key}_est"]
            row.update({key: e.value, f"{key}_lo": e.lo, f"{key}_hi": e.hi})
        row["predicted_speedup"] = c["predicted_speedup"]
        for p in a["peers"]:
            e = p["ratios"].get(drafter) or Estimate(math.nan)
            name = p["name"].replace("transformers ", "").replace(" ", "_")
            row.update({f"vs_{name}": e.value, f"vs_{name}_lo": e.lo, f"vs_{name}_hi": e.hi})
        row["vs_best"] = c["verdict"]
        out.append(row)
    return out


def grid_table(a: dict) -> tuple[list[str], list[list]]:
    header = ["drafter", "tree", "nodes", "depth", f"τ ({_level(a)} CI)", "predicted τ", "tokens/s",
              f"speedup ({_level(a)} CI)", "predicted speedup", "engine overhead", "vs the run's best"]
    rows = []
    for c in a["configs"].values():
        overhead = c.get("overhead_fraction")
        rows.append([c["drafter"] if c["config"] != "vanilla" else "vanilla (baseline)", c["tree"], c["nodes"],
                     num(c["depth"], "d") if isinstance(c["depth"], int) else DASH,
                     with_interval(c["tau_est"]), num(c["predicted_tau"]), num(c["tokens_per_s"], ".1f"),
                     with_interval(c["speedup_est"], suffix="×"), num(c["predicted_speedup"], suffix="×"),
                     DASH if _missing(overhead) else f"{100 * overhead:.1f}%", VERDICT.get(c.get("verdict"), DASH)])
    return header, rows


def peer_table(a: dict) -> tuple[list[str], list[list]]:
    best = a["best"]["drafter"] if a["best"] else None
    header = ["peer (transformers, same prompts)", "tokens/s", f"speedup vs treespec vanilla ({_level(a)} CI)",
              "treespec's best ÷ peer"]
    rows = [[p["name"], num(p["tokens_per_s"], ".1f"), with_interval(p["speedup_est"], suffix="×"),
             with_interval(p["ratios"].get(best), suffix="×")] for p in a["peers"]]
    return header, rows


# ---------------------------------------------------------------------------------------------- the stamp

def _short(h: str | None, n: int = 12) -> str:
    return h[:n] if h else DASH


def _model_line(m: dict | None) -> str:
    if not m:
        return DASH
    if m.get("weights", "") is None:
        return f"{m.get('source') or 'no source'}, no weights"
    files = ", ".join(f"{name} sha1 {_short(h)}" for name, h in (m.get("files") or {}).items())
    parts = [m.get("source") or "in-memory model", files, f"weights sha1 {_short(m.get('weights_sha1'))}"]
    return ", ".join(p for p in parts if p)


def stamp_lines(stamp: dict, result: dict, a: dict) -> list[str]:
    if not stamp:
        return ["- **stamp**: none (a results.json written before runs were stamped): command, code, versions, "
                "device, weights and prompts unknown"]
    s = result.get("settings", {})
    git = stamp.get("git") or {}
    if git.get("commit"):
        changed = len(git.get("changed", []))
        dirty = f"dirty: {changed} tracked files changed, diff sha1 {_short(git.get('diff_sha1'))}" \
            if git.get("dirty") else "clean"
        git_text = f"{git['commit'][:12]} ({dirty})"
    else:
        git_text = "not a git checkout"
    v = stamp.get("versions") or {}
    d = stamp.get("device") or {}
    pr = stamp.get("prompts") or {}
    sampling = "greedy" if not s.get("temperature") else f"temperature {s['temperature']}, top-p {s.get('top_p')}"
    b = a["bootstrap"]
    lines = [
        f"- **command**: `{stamp.get('command', DASH)}`",
        f"- **git**: {git_text}",
        "- **versions**: " + " · ".join(f"{k} {v.get(k) or DASH}" for k in ("treespec", "torch", "transformers",
                                                                               "python")),
        f"- **device**: {d.get('device', DASH)} ({d.get('cpu', DASH)}, {d.get('cpu_count', DASH)} cores), "
        f"{d.get('torch_threads', DASH)} torch threads, OMP_NUM_THREADS={d.get('OMP_NUM_THREADS') or 'unset'}"
        + (f", {d['gpu']}" if d.get("gpu") else ""),
        f"- **target**: {_model_line(stamp.get('target'))}",
        "- **drafters**: " + ("; ".join(f"{name}: {_model_line(m)}"
                                        for name, m in (stamp.get("drafters") or {}).items()) or DASH),
        f"- **prompts**: {pr.get('set', DASH)}: {s.get('prompts', DASH)} × {s.get('repeats', DASH)} repeat(s), "
        f"{s.get('max_new_tokens', DASH)} new tokens each, token ids sha1 {_short(pr.get('token_ids_sha1'))}; "
        f"{sampling}; seed {s.get('seed', stamp.get('seed', DASH))}",
        f"- **intervals**: bootstrap {_level(a)} over prompts ({b['samples']} resamples, seed {b['seed']}); "
        "a configuration whose speedup interval overlaps the best one's is *indistinguishable from the best in "
        "this run*",
        f"- **started**: {stamp.get('started', DASH)}, measuring took {num(result.get('wall_s'), '.0f', ' s')}",
    ]
    return lines


# ---------------------------------------------------------------------------------------------- markdown

def markdown(result: dict, a: dict) -> str:
    stamp = result.get("stamp") or {}
    s = result.get("settings", {})
    lines = ["# Which tree should I use here? Drafters × trees", ""]
    lines += stamp_lines(stamp, result, a) + [""]
    lines += ["## Summary: each drafter's best configuration", ""]
    lines += md_table(*summary_table(a))
    vanilla = a["configs"].get("vanilla")
    n_prompts = s.get("prompts", DASH)
    spread = vanilla_spread(a)
    lines += ["", f"Speedup: median over {n_prompts} prompts × {s.get('repeats', 1)} repeat(s) of the per-prompt ratio "
              "of tokens/s to treespec's vanilla decoding, interleaved in the same process"
              + (f" (vanilla: {vanilla['tokens_per_s']:.1f} tokens/s)" if vanilla else "") + ". "
              "τ: tokens committed per target pass, bonus token included. \"vs <peer>\": this drafter's best "
              "configuration's tokens/s ÷ the peer's, per prompt, measured again in one interleaved pass beside the "
              "peers. \"≈ best\": the speedup intervals overlap; this run cannot tell the two apart."]
    if spread and spread[2] / spread[0] > NOISY:
        lines += ["", f"**Warning: vanilla decoding ran at {spread[0]:.0f}–{spread[2]:.0f} tokens/s over this run's "
                  f"prompt runs ({spread[2] / spread[0]:.1f}× apart)**: the machine's speed changed during the run "
                  "(other processes, thread contention), so the intervals are wide for that reason and not only "
                  "because prompts differ. Rerun on an idle machine for tighter numbers."]
    if a["peers"]:
        lines += ["", "## Peers", ""] + md_table(*peer_table(a))
    lines += ["", "## All configurations", ""] + md_table(*grid_table(a))
    if result.get("skipped"):
        lines += ["", "Not measured (the drafter cannot fill the tree): "
                  + "; ".join(f"{k['config']} ({k['reason']})" for k in result["skipped"]) + "."]
    lines += ["", "## Figures", ""]
    lines += [f"![{name[:-4].replace('_', ' ')}]({name})" for name in FIGURES]
    config = stamp.get("config")
    if config:
        lines += ["", "<details><summary>resolved config</summary>", "", "```json",
                  json.dumps(config, indent=1, sort_keys=True, default=str), "```", "", "</details>"]
    return "\n".join(lines) + "\n"


def csv_rows(a: dict) -> list[dict]:
    out = []
    for c in a["configs"].values():
        sp, tau = c["speedup_est"], c["tau_est"]
        out.append({"config": c["config"], "drafter": c["drafter"], "tree": c["tree"], "nodes": c["nodes"],
                    "depth": c["depth"], "tau": tau.value, "tau_lo": tau.lo, "tau_hi": tau.hi,
                    "predicted_tau": c["predicted_tau"], "tokens_per_s": c["tokens_per_s"], "speedup": sp.value,
                    "speedup_lo": sp.lo, "speedup_hi": sp.hi, "predicted_speedup": c["predicted_speedup"],
                    "target_passes": c["target_passes"], "new_tokens": c["new_tokens"],
                    "overhead_fraction": c.get("overhead_fraction"), "vs_best": c.get("verdict")})
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    """Empty cells for values that do not apply (never "nan")."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows({k: "" if _missing(v) else v for k, v in r.items()} for r in rows)


# ---------------------------------------------------------------------------------------------- figure data

def frontier(a: dict, key: str) -> dict[str, list[dict]]:
    """Per drafter, its best configuration at each node count by ``key`` ("speedup" or "tau"), in node
    order: {drafter: [{nodes, config, tree, value, lo, hi, predicted}]}. Every measured drafter has a line."""
    out: dict[str, dict[int, dict]] = {}
    for c in a["configs"].values():
        if c["config"] == "vanilla":
            continue
        e = c[f"{key}_est"]
        if _missing(e.value):
            continue
        at = out.setdefault(c["drafter"], {})
        if c["nodes"] not in at or e.value > at[c["nodes"]]["value"]:
            at[c["nodes"]] = {"nodes": c["nodes"], "config": c["config"], "tree": c["tree"], "value": e.value,
                              "lo": e.lo if e.has_interval else e.value, "hi": e.hi if e.has_interval else e.value,
                              "predicted": c[f"predicted_{key}"]}
    return {d: [at[n] for n in sorted(at)] for d, at in out.items()}


def reference_lines(a: dict, key: str) -> list[dict]:
    """Horizontal lines: vanilla (1 for both speedup and τ) and, for speedup, every transformers peer."""
    lines = [{"label": "treespec vanilla", "value": 1.0}]
    if key == "speedup":
        lines += [{"label": p["name"], "value": p["speedup_est"].value} for p in a["peers"]
                  if not _missing(p["speedup_est"].value)]
    return lines


def accept_length_distributions(a: dict) -> dict[str, dict]:
    """Each drafter's best configuration's accept lengths as fractions of its passes, on one shared set of
    integer bins 1..K (K the longest accepted anywhere): {drafter: {config, bins, fractions, tau, passes}}."""
    lengths = {d: [n for run in (c.get("runs") or {}).get("accept_lengths", []) for n in run]
               for d, c in a["bests"].items()}
    top = max((max(v) for v in lengths.values() if v), default=1)
    bins = list(range(1, top + 1))
    out = {}
    for d, values in lengths.items():
        if not values:
            continue
        out[d] = {"config": a["bests"][d]["config"], "bins": bins, "passes": len(values),
                  "fractions": [sum(1 for v in values if v == b) / len(values) for b in bins],
                  "tau": sum(values) / len(values)}
    return out


def acceptance_grids(result: dict) -> dict[str, list[list[float | None]]]:
    """{drafter: acc[depth][rank]} padded with None to a rectangle: the measured acceptance rate of the
    rank-r sibling at draft depth d + 1, what accuracy-grown trees are grown from."""
    out = {}
    for d, acc in (result.get("accuracy") or {}).items():
        if not acc:
            continue
        width = max(len(row) for row in acc)
        out[d] = [[float(x) for x in row] + [None] * (width - len(row)) for row in acc]
    return out


# ---------------------------------------------------------------------------------------------- figures

def _colours(drafters: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
    return {d: palette[i % len(palette)] for i, d in enumerate(drafters)}


def _subtitle(result: dict, a: dict) -> str:
    s = result.get("settings", {})
    sampling = "greedy" if not s.get("temperature") else f"T={s['temperature']}"
    return (f"{s.get('prompts', '?')} prompts × {s.get('repeats', 1)} repeat(s) × {s.get('max_new_tokens', '?')} "
            f"tokens, {sampling}; bands: bootstrap {_level(a)} over prompts")


def _label_lines(ax, refs: list[dict], unit: str) -> None:
    """Name each horizontal line at the right edge, nudging labels apart so that close lines stay legible."""
    lo, hi = ax.get_ylim()
    order = sorted(refs, key=lambda r: r["value"])
    ys = [(r["value"] - lo) / (hi - lo) for r in order]
    for i in range(1, len(ys)):
        ys[i] = max(ys[i], ys[i - 1] + 0.045)
    shift = max(0.0, ys[-1] - 0.98) if ys else 0.0
    for r, y in zip(order, ys, strict=True):
        first = r is refs[0]
        ax.text(1.01, y - shift, f"{r['label']} {r['value']:.2f}{unit}", transform=ax.transAxes, fontsize=7,
                va="center", color="black" if first else "dimgrey")


def plot(result: dict, a: dict, out_dir: Path) -> list[Path]:
    import matplotlib  # heavy, and only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    drafters = list(a["bests"])
    colour = _colours(drafters)
    written = []
    for key, ylabel, fname, title in (
            ("speedup", "speedup over vanilla decoding (×)", "speedup_vs_nodes.png",
             "Speedup vs tree size: each drafter's best tree per node count"),
            ("tau", "τ: tokens committed per target pass", "tau_vs_nodes.png",
             "τ vs tree size: each drafter's best tree per node count")):
        lines = frontier(a, key)
        unit = "×" if key == "speedup" else ""
        fig, ax = plt.subplots(figsize=(8.5, 5.4))
        band_alpha = min(0.15, 0.6 / max(1, len(lines)))  # many overlapping bands stay readable
        for d in drafters:
            pts = lines.get(d, [])
            if not pts:
                continue
            x = [p["nodes"] for p in pts]
            top = max(pts, key=lambda p: p["value"])
            ax.fill_between(x, [p["lo"] for p in pts], [p["hi"] for p in pts], color=colour[d], alpha=band_alpha,
                            lw=0)
            ax.plot(x, [p["value"] for p in pts], "o-", color=colour[d], lw=1.8, ms=4,
                    label=f"{d}: best {top['tree']}, {top['value']:.2f}{unit}")
            pred = [(p["nodes"], p["predicted"]) for p in pts if not _missing(p["predicted"])]
            if pred:
                ax.plot(*zip(*pred, strict=True), "--", color=colour[d], lw=1.2, alpha=0.9)
            ax.plot([top["nodes"]], [top["value"]], "*", color=colour[d], ms=13, mec="black", mew=0.6, zorder=5)
        nodes = sorted({p["nodes"] for pts in lines.values() for p in pts}) or [1]
        refs = reference_lines(a, key)
        for i, ref in enumerate(refs):
            ax.axhline(ref["value"], **({"color": "black", "lw": 1.0} if i == 0 else
                                        {"color": "grey", "lw": 0.9, "ls": ":"}))
        ax.set_xscale("log", base=2)
        ticks = nodes if len(nodes) <= 12 else [2 ** k for k in range(math.ceil(math.log2(nodes[-1])) + 1)]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(min(nodes) / 1.25, max(nodes) * 1.25)
        # a busy machine can throw a band or a prediction far off; keep the medians and reference lines readable
        shown = [p["value"] for pts in lines.values() for p in pts] + [r["value"] for r in refs]
        low, high = ax.get_ylim()
        clipped = high > 1.6 * max(shown)
        if clipped:
            ax.set_ylim(low, 1.6 * max(shown))
        _label_lines(ax, refs, unit)
        ax.set_xlabel("tree nodes (candidates verified per pass)")
        ax.set_ylabel(ylabel)
        note = " (y cut at 1.6× the top median)" if clipped else ""
        ax.set_title(f"{title}{note}\n{_subtitle(result, a)}", fontsize=9)
        style_handles = [Line2D([], [], color="grey", marker="o", lw=1.8, ms=4, label="measured median"),
                         Patch(color="grey", alpha=0.25, label=f"{_level(a)} interval over prompts"),
                         Line2D([], [], color="grey", ls="--", lw=1.2, label="predicted (same tree)"),
                         Line2D([], [], color="grey", marker="*", ls="", ms=10, mec="black", mew=0.6,
                                label="the drafter's best")]
        handles, _ = ax.get_legend_handles_labels()
        ncol = 3 if len(handles) > 4 else 2
        fig.legend(handles=handles + style_handles, fontsize=7, loc="lower center", frameon=False, ncol=ncol)
        rows = math.ceil((len(handles) + len(style_handles)) / ncol)
        fig.tight_layout(rect=(0, min(0.35, 0.035 * rows + 0.02), 1, 1))
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
        written.append(out_dir / fname)

    dist = accept_length_distributions(a)
    n = max(1, len(dist))
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols + 0.6, 2.9 * nrows + 0.4), sharex=True,
                             sharey=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (d, h) in zip(flat, dist.items(), strict=False):
        ax.bar(h["bins"], h["fractions"], width=0.8, color=colour.get(d, "grey"))
        ax.axvline(h["tau"], color="black", ls="--", lw=0.9)
        ax.set_title(f"{h['config']}\nτ = {h['tau']:.2f} (dashed), {h['passes']} passes", fontsize=8)
    for ax in flat[len(dist):]:
        ax.set_axis_off()
    for i, ax in enumerate(flat[:len(dist)]):
        if i + ncols >= len(dist):  # the lowest panel of its column
            ax.set_xlabel("tokens committed per pass")
            ax.xaxis.set_tick_params(labelbottom=True)
    for row in axes:
        row[0].set_ylabel("fraction of passes")
    if dist:
        bins = next(iter(dist.values()))["bins"]
        flat[0].set_xticks(bins if len(bins) <= 12 else bins[:: math.ceil(len(bins) / 12)])
    fig.suptitle("Acceptance lengths of each drafter's best configuration", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "accept_length_hist.png", dpi=120)
    plt.close(fig)
    written.append(out_dir / "accept_length_hist.png")

    grids = acceptance_grids(result)
    n = max(1, len(grids))
    vmax = max((x for g in grids.values() for row in g for x in row if x is not None), default=1.0)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 1.2, 3.6), squeeze=False, layout="constrained")
    image = None
    for ax, (d, g) in zip(axes[0], grids.items(), strict=False):
        data = [[math.nan if x is None else x for x in row] for row in g]
        image = ax.imshow(data, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        for i, row in enumerate(g):
            for j, x in enumerate(row):
                if x is not None:
                    ax.text(j, i, f"{x:.2f}"[1:] if x < 1 else "1", ha="center", va="center", fontsize=6,
                            color="white" if x < 0.6 * vmax else "black")
        ax.set_xticks(range(len(g[0])), [str(r + 1) for r in range(len(g[0]))])
        ax.set_yticks(range(len(g)), [str(k + 1) for k in range(len(g))])
        ax.set_title(d, fontsize=9, color=colour.get(d, "black"))
    axes[0][0].set_ylabel("draft depth")
    if not grids:
        axes[0][0].text(0.5, 0.5, "no drafter with measured accuracies", ha="center", va="center")
        axes[0][0].set_axis_off()
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="acceptance rate", shrink=0.9)
    fig.suptitle("Measured acceptance rate by depth × sibling rank (what accuracy trees are grown from)",
                 fontsize=9)
    fig.supxlabel("sibling rank (1 = the drafter's top candidate)", fontsize=9)
    fig.savefig(out_dir / "acceptance_heatmap.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(out_dir / "acceptance_heatmap.png")
    return written


# ---------------------------------------------------------------------------------------------- outputs

def render(result: dict, out_dir: Path, figures: bool = True) -> dict:
    """Every file of the report from results.json's contents (the figures unless ``figures=False``); returns
    the analysis."""
    out_dir = Path(out_dir)
    a = analyse(result)
    _write_csv(out_dir / "results.csv", csv_rows(a))
    _write_csv(out_dir / "summary.csv", summary_records(a))
    with open(out_dir / "cost_curve.csv", "w") as f:
        f.write("tree_tokens,seconds\n" + "".join(f"{n},{t:.6f}\n" for n, t in result["cost_curve"].items()))
    (out_dir / "results.md").write_text(markdown(result, a))
    if figures:
        plot(result, a, out_dir)
    return a


def write_outputs(result: dict, out_dir: Path, logger=None, figures: bool = True) -> dict:
    out_dir = Path(out_dir)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=float))
    a = render(result, out_dir, figures)
    if logger is not None:
        log_wandb(logger, result, a, out_dir)
    return a


def load_result(path: str | Path) -> tuple[dict, Path]:
    """results.json's contents and its folder, from the file or the run folder holding it."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no results.json (give a comparison run's folder or its results.json)")
    result = json.loads(file.read_text())
    result["cost_curve"] = {int(n): t for n, t in result["cost_curve"].items()}
    return result, file.parent


def rerender(path: str | Path, out_dir: str | Path | None = None, figures: bool = True) -> Path:
    """Rebuild a run's report (tables, CSVs, figures) from its results.json, without measuring; in place
    unless ``out_dir`` is given."""
    result, folder = load_result(path)
    out = Path(out_dir) if out_dir is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    render(result, out, figures)
    return out


def compare_runs(paths: list[str | Path]) -> str:
    """Markdown setting two or more runs side by side: where their stamps differ, each drafter's best, and
    every configuration present in all of them (speedup with interval, and whether the intervals overlap)."""
    if len(paths) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(paths)}")
    runs = []
    for p in paths:
        result, folder = load_result(p)
        runs.append((str(folder), result, analyse(result)))
    tags = [chr(ord("A") + i) for i in range(len(runs))]
    lines = ["# Comparison runs side by side", ""]
    lines += md_table(["run", "folder", "command", "started", "best configuration"],
                      [[t, f"`{f}`", f"`{r.get('stamp', {}).get('command', DASH)}`", r.get("stamp", {}).get("started",
                        DASH), r.get("best", DASH)] for t, (f, r, _) in zip(tags, runs, strict=True)])
    flat = [flatten(r.get("stamp") or {}) for _, r, _ in runs]
    flat = [{**f, **flatten(r.get("settings") or {}, "settings")} for f, (_, r, _) in zip(flat, runs, strict=True)]
    keys = sorted(set().union(*flat))
    differ = [k for k in keys if len({f.get(k, DASH) for f in flat}) > 1 and k != "started"]
    lines += ["", "## Where the stamps differ", ""]
    if differ:
        lines += md_table(["key", *tags], [[k, *(_clip(f.get(k, DASH)) for f in flat)] for k in differ])
    else:
        lines += ["Nothing but the start time: same command, config, code, versions, device, weights and prompts."]
    lines += ["", "## Each drafter's best configuration", ""]
    drafters = list(dict.fromkeys(d for _, _, a in runs for d in a["bests"]))
    header = ["drafter"] + [h for t in tags for h in (f"{t}: best tree", f"{t}: τ", f"{t}: speedup")]
    rows = []
    for d in drafters:
        row = [d]
        for _, _, a in runs:
            c = a["bests"].get(d)
            row += [c["tree"], with_interval(c["tau_est"]), with_interval(c["speedup_est"], suffix="×")] if c \
                else [DASH] * 3
        rows.append(row)
    lines += md_table(header, rows)
    common = [name for name in runs[0][2]["configs"] if all(name in a["configs"] for _, _, a in runs[1:])]
    lines += ["", "## Configurations measured in every run", ""]
    header = ["config"] + [f"{t}: speedup" for t in tags] + [f"{t} ÷ A" for t in tags[1:]] + ["intervals overlap"]
    rows = []
    for name in common:
        ests = [a["configs"][name]["speedup_est"] for _, _, a in runs]
        ratios = [num(e.value / ests[0].value if ests[0].value else math.nan, ".2f") for e in ests[1:]]
        overlap = all(e.overlaps(ests[0]) for e in ests[1:])
        rows.append([name, *(with_interval(e, suffix="×") for e in ests), *ratios, "yes" if overlap else "**no**"])
    lines += md_table(header, rows)
    lines += ["", "Intervals: each run's own bootstrap over its prompts. Non-overlapping intervals on the same "
              "prompts, code and device point to a real change; on different devices or thread counts they "
              "need not."]
    return "\n".join(lines) + "\n"


def _clip(text: str, n: int = 70) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "…"


# ---------------------------------------------------------------------------------------------- wandb

def log_wandb(logger, result: dict, a: dict, out_dir: Path) -> None:
    records = result["records"]
    logger.log({f"compare/{rec['config']}/{k}": rec[k] for rec in records
                for k in ("tau", "tokens_per_s", "speedup") if not _missing(rec[k])})
    for rec in records[1:]:
        logger.histogram(f"accept_length/{rec['config']}",
                         [n for run in rec["runs"]["accept_lengths"] for n in run])
    summary = summary_records(a)
    logger.summary({"best": result["best"], "summary": summary, "records": csv_rows(a)})
    if logger.wandb is None:
        return
    import wandb  # optional: only when the run logs to wandb

    grid = csv_rows(a)
    peer_header, peer_rows = peer_table(a)
    stamp = {k: v for k, v in (result.get("stamp") or {}).items() if k != "config"}

    def send(run):
        run.config.update({"stamp": stamp}, allow_val_change=True)
        run.log({
            "compare/summary": _table(summary),
            "compare/results": _table(grid),
            **({"compare/peers": wandb.Table(columns=peer_header, data=[[str(c) for c in r] for r in peer_rows])}
               if peer_rows else {}),
            **{f"compare/{name[:-4]}": wandb.Image(str(out_dir / name)) for name in FIGURES
               if (out_dir / name).is_file()},
        })

    def _table(rows: list[dict]):
        return wandb.Table(columns=list(rows[0]), data=[[None if _missing(v) else v for v in r.values()]
                                                        for r in rows])

    logger._wandb_call(send)  # offline-safe: a wandb error disables wandb with a warning, the run goes on
