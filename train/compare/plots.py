"""The comparison's figures (train/compare/report.py renders them with the tables): speedup and τ against tree size
per drafter with bootstrap bands, predictions and reference lines; acceptance-length histograms of each
drafter's best configuration; the measured acceptance heat map by depth × sibling rank; per-category speedup
with intervals and τ by context length and by position in the generation (data: train/compare/categories.py).
Everything is drawn from results.json's contents and estimates.analyse's analysis; the figure data
(``frontier``, ``reference_lines``, ``accept_length_distributions``, ``acceptance_grids``) is kept apart from
the drawing so it can be tested. report.py imports this module (never the reverse).
"""

from __future__ import annotations

import math
from pathlib import Path

from treespec.train.compare.categories import acceptance_by_position, category_table
from treespec.train.compare.tables import missing

FIGURES = ("speedup_vs_nodes.png", "tau_vs_nodes.png", "accept_length_hist.png", "acceptance_heatmap.png",
           "speedup_by_category.png", "acceptance_by_position.png")


# ---------------------------------------------------------------------------- shared with the tables (report.py)

def level_text(a: dict) -> str:
    """The intervals' level as printed: "95%"."""
    return f"{100 * a['bootstrap']['level']:g}%"


def partial(result: dict) -> tuple[int, int] | None:
    """(prompt runs measured, prompt runs planned) of a run that stopped before it finished; None for a
    complete run (or one from before runs were saved as they went)."""
    if result.get("complete", True):
        return None
    s = result.get("settings", {})
    done = result.get("prompts_done", len(result.get("prompt_of_run") or []))
    return int(done), int(s.get("prompts", 0)) * int(s.get("repeats", 1))


# ---------------------------------------------------------------------------------------------- figure data

def frontier(a: dict, key: str) -> dict[str, list[dict]]:
    """Per drafter, its best configuration at each node count by ``key`` ("speedup" or "tau"), in node
    order: {drafter: [{nodes, config, tree, value, lo, hi, predicted}]}. Every measured drafter has a line."""
    out: dict[str, dict[int, dict]] = {}
    for c in a["configs"].values():
        if c["config"] == "vanilla":
            continue
        e = c[f"{key}_est"]
        if missing(e.value):
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
                  if not missing(p["speedup_est"].value)]
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
    done = partial(result)
    return (f"{s.get('prompts', '?')} prompts × {s.get('repeats', 1)} repeat(s) × {s.get('max_new_tokens', '?')} "
            f"tokens, {sampling}; bands: bootstrap {level_text(a)} over prompts"
            + (f"; partial run: {done[0]} of {done[1]} prompt runs" if done else ""))


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
            pred = [(p["nodes"], p["predicted"]) for p in pts if not missing(p["predicted"])]
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
                         Patch(color="grey", alpha=0.25, label=f"{level_text(a)} interval over prompts"),
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
    written += plot_categories(result, a, out_dir, plt, colour)
    return written


def plot_categories(result: dict, a: dict, out_dir: Path, plt, colour: dict) -> list[Path]:
    """speedup_by_category.png (bars per drafter and peer, intervals as error bars) and
    acceptance_by_position.png (τ by context length and by position in the generation)."""
    table = category_table(result, a)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(table["categories"]) + 3) if table else 6.0, 4.4))
    if table and table["rows"]:
        cats, rows = table["categories"], table["rows"]
        width = 0.8 / len(rows)
        for j, row in enumerate(rows):
            ests = [row["cells"][c]["speedup"] for c in cats]
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(cats))]
            values = [e.value for e in ests]
            err = [[e.value - e.lo if e.has_interval else 0 for e in ests],
                   [e.hi - e.value if e.has_interval else 0 for e in ests]]
            ax.bar(xs, values, width, yerr=err, capsize=2, label=f"{row['name']} ({row['tree']})"
                   if row["kind"] == "drafter" else row["name"], color=colour.get(row["name"], None),
                   alpha=1.0 if row["kind"] == "drafter" else 0.45)
        ax.axhline(1.0, color="black", lw=0.9)
        ax.set_xticks(range(len(cats)), [f"{c}\n({table['prompts'][c]} prompts)" for c in cats], fontsize=8)
        ax.set_ylabel("speedup over vanilla decoding (×)")
        ax.legend(fontsize=7, frameon=False)
    else:
        ax.text(0.5, 0.5, "no categories in this run", ha="center", va="center")
        ax.set_axis_off()
    ax.set_title(f"Speedup by category: each drafter's best configuration\n{_subtitle(result, a)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_by_category.png", dpi=120)
    plt.close(fig)

    by = acceptance_by_position(result, a)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, what, label in ((axes[0], "context", "context before the pass (prompt + generated tokens)"),
                            (axes[1], "position", "tokens generated before the pass")):
        for d, bins in by.items():
            pts = bins[what]
            if pts:
                ax.plot([p["lo"] for p in pts], [p["tau"] for p in pts], "o-", color=colour.get(d, "grey"), label=d)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{label}, power-of-two bins", fontsize=8)
    axes[0].set_ylabel("τ: tokens committed per pass")
    if by:
        axes[1].legend(fontsize=7, frameon=False)
    fig.suptitle("Acceptance by context length and by position in the generation (each drafter's best)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    return [out_dir / "speedup_by_category.png", out_dir / "acceptance_by_position.png"]


def plot_batch_sizes(lines: dict[str, list[dict]], out_dir: Path, *, level: str, subtitle: str,
                     peer: str = "transformers batched") -> Path:
    """speedup_vs_batch.png: each drafter's best measured speedup over treespec's batched vanilla decoding at
    every batch size, with its interval over batches (``batch_report.speedup_lines``), and transformers' batched
    generate against the same baseline; the line at 1 is batched vanilla."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = [d for d in lines if d != peer]
    colour = {**_colours(drafters), peer: "grey"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for d, pts in lines.items():
        x = [p["size"] for p in pts]
        value = [p["value"] for p in pts]
        lo = [p["value"] if missing(p["lo"]) else p["lo"] for p in pts]
        hi = [p["value"] if missing(p["hi"]) else p["hi"] for p in pts]
        style = {"ls": "--", "marker": "s"} if d == peer else {"ls": "-", "marker": "o"}
        ax.errorbar(x, value, yerr=[[v - a for v, a in zip(value, lo, strict=True)],
                                     [b - v for v, b in zip(value, hi, strict=True)]],
                    color=colour[d], lw=1.6, ms=5, capsize=3, label=d, **style)
        for p in pts:
            if d != peer:
                ax.annotate(p["tree"], (p["size"], p["value"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=6, color=colour[d])
    ax.axhline(1.0, color="black", lw=1.0)
    sizes = sorted({p["size"] for pts in lines.values() for p in pts}) or [1]
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size (prompts decoded at once)")
    ax.set_ylabel("speedup over batched vanilla decoding (×)")
    ax.set_title(f"Speedup vs batch size: each drafter's best tree per batch size\n{subtitle}; bars: bootstrap "
                 f"{level} over batches", fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    path = out_dir / "speedup_vs_batch.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
