"""The comparison's report, from the harness's measurements (train/compare/harness.py): results.md (stamp, summary,
peers, results by category, the full grid, how to use the best tree), results.csv, summary.csv,
by_category.csv, cost_curve.csv, best_tree.json, the figures (train/compare/plots.py) and the wandb run. Nothing here
measures anything: everything is rendered from results.json, so ``rerender(run_dir)`` rebuilds a run's report
(``python scripts/compare_trees.py report=PATH``); train/compare/side_by_side.py sets runs side by side. A results.json
saved while the run was still measuring (``"complete": false``) renders what it holds, marked as a partial
run at the top of results.md; one from before workloads renders without categories.

Uncertainty (the analysis: train/compare/estimates.py): per configuration the median speedup (per-prompt ratios to
vanilla) and τ, each with a bootstrap interval over prompts. A configuration whose speedup interval overlaps the best
one's is "indistinguishable from the best in this run". Missing values print as "–", never "nan".
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from treespec.planning.tree_spec import build_tree, save_tree
from treespec.train.compare import time_split
from treespec.train.compare.auto_across import drafter_of
from treespec.train.compare.auto_across_report import across_markdown
from treespec.train.compare.batch_report import render_batches
from treespec.train.compare.categories import category_markdown, category_rows, run_rows, usage_lines
from treespec.train.compare.estimates import analyse, vanilla_spread
from treespec.train.compare.plots import FIGURES, level_text, partial, plot
from treespec.train.compare.predictions import predicted_text, ratio, summary_line
from treespec.train.compare.results_file import load_result, save_result
from treespec.train.compare.specbench import csv_rows as specbench_rows
from treespec.train.compare.specbench import markdown as specbench_markdown
from treespec.train.compare.stamp_lines import stamp_lines
from treespec.train.compare.stats import Estimate
from treespec.train.compare.tables import DASH, md_table, missing, num, with_interval

# ---------------------------------------------------------------------------------------------- tables

VERDICT = {"best": "**best**", "indistinguishable": "≈ best", "below": "below"}
NOISY = 1.5  # vanilla's fastest ÷ slowest prompt run above which the report warns that the machine was busy


def summary_table(a: dict) -> tuple[list[str], list[list]]:
    peer_names = [p["name"] for p in a["peers"]]
    header = ["drafter", "best tree", "nodes", f"τ ({level_text(a)} CI)", f"speedup ({level_text(a)} CI)",
              "predicted speedup", "pred ÷ meas", "c"] + [f"vs {n}" for n in peer_names] + ["vs the run's best"]
    rows = []
    for drafter, c in a["bests"].items():
        rows.append([drafter, c["shown"], c["nodes"], with_interval(c["tau_est"]), with_interval(c["speedup_est"],
                     suffix="×"), predicted_text(c), num(ratio(c)), num(c.get("c"))]
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
        row["predicted_speedup_lo"], row["predicted_speedup_hi"] = c.get("predicted_speedup_lo"), \
            c.get("predicted_speedup_hi")
        row["predicted_over_measured"] = ratio(c)
        row["c"] = c.get("c")
        for p in a["peers"]:
            e = p["ratios"].get(drafter) or Estimate(math.nan)
            name = p["name"].replace("transformers ", "").replace(" ", "_")
            row.update({f"vs_{name}": e.value, f"vs_{name}_lo": e.lo, f"vs_{name}_hi": e.hi})
        row["vs_best"] = c["verdict"]
        out.append(row)
    return out


def grid_table(a: dict) -> tuple[list[str], list[list]]:
    header = ["drafter", "tree", "nodes", "depth", f"τ ({level_text(a)} CI)", "predicted τ", "tokens/s",
              f"speedup ({level_text(a)} CI)", "predicted speedup", "pred ÷ meas", "engine overhead", "walk ms/pass",
              "draft ms/depth", "c",
              "vs the run's best"]
    rows = []
    for c in a["configs"].values():
        overhead = c.get("overhead_fraction")
        rows.append([c["drafter"] if c["config"] != "vanilla" else "vanilla (baseline)", c["shown"], c["nodes"],
                     num(c["depth"], "d") if isinstance(c["depth"], int) else DASH,
                     with_interval(c["tau_est"]), num(c["predicted_tau"]), num(c["tokens_per_s"], ".1f"),
                     with_interval(c["speedup_est"], suffix="×"), predicted_text(c),
                     num(ratio(c)), DASH if missing(overhead) else f"{100 * overhead:.1f}%",
                     num(c.get("walk_ms_per_pass"), ".2f"),
                     num(c.get("draft_ms_per_depth")),
                     num(c.get("c")), VERDICT.get(c.get("verdict"), DASH)])
    return header, rows


def peer_table(a: dict) -> tuple[list[str], list[list]]:
    best = a["best"]["drafter"] if a["best"] else None
    header = ["peer (transformers, same prompts)", "tokens/s", f"speedup vs treespec vanilla ({level_text(a)} CI)",
              "treespec's best ÷ peer"]
    rows = [[p["name"], num(p["tokens_per_s"], ".1f"), with_interval(p["speedup_est"], suffix="×"),
             with_interval(p["ratios"].get(best), suffix="×")] for p in a["peers"]]
    return header, rows


# ---------------------------------------------------------------------------------------------- markdown

def markdown(result: dict, a: dict, folder=None) -> str:
    stamp = result.get("stamp") or {}
    s = result.get("settings", {})
    lines = ["# Which tree should I use here? Drafters × trees", ""]
    done = partial(result)
    if done:
        lines += [f"**partial run: {done[0]} of {done[1]} prompt runs measured**: the run stopped before it "
                  f"finished (or is still going), so every number and interval below is over those {done[0]} prompt "
                  "runs" + ("; the peers were not measured" if result.get("peers") is None else "") + ".", ""]
    if result.get("absent_fields"):
        lines += [f"**results.json lacks {'; '.join(result['absent_fields'])}**: those values show as –.", ""]
    lines += stamp_lines(stamp, result, a) + [""]
    lines += ["## Summary: each drafter's best configuration", ""]
    lines += md_table(*summary_table(a))
    vanilla = a["configs"].get("vanilla")
    n_prompts = s.get("prompts", DASH)
    spread = vanilla_spread(result, a)
    runs = f"{n_prompts} prompts × {s.get('repeats', 1)} repeat(s)"
    if done:
        runs = f"the {done[0]} prompt runs measured (of {runs} planned)"
    lines += ["", f"Speedup: median over {runs} of the per-prompt ratio of tokens/s to treespec's vanilla decoding, "
              "interleaved in the same process"
              + (f" (vanilla: {vanilla['tokens_per_s']:.1f} tokens/s)" if vanilla and not missing(
                  vanilla.get("tokens_per_s")) else "") + ". "
              "τ: tokens committed per target pass, bonus token included. \"vs <peer>\": this drafter's best "
              "configuration's tokens/s ÷ the peer's, per prompt, measured again in one interleaved pass beside the "
              "peers. \"≈ best\": the speedup intervals overlap; this run cannot tell the two apart. c: drafting "
              "time per draft depth ÷ one target forward over one token, as measured in this run's decoding (\"draft "
              "ms/depth\": the same time in milliseconds)."]
    if spread and spread["hi"] / spread["lo"] > NOISY:
        alike = f"{spread['runs']} prompt runs that generated their whole budget" + \
            (f" of {spread['budget']} tokens" if spread["budget"] is not None else "")
        lines += ["", f"**Warning: vanilla decoding ran at {spread['lo']:.0f}–{spread['hi']:.0f} tokens/s over this "
                  f"run's {alike} ({spread['hi'] / spread['lo']:.1f}× apart)**: the machine's speed changed during the "
                  "run (other processes, thread contention), so the intervals are wide for that reason and not only "
                  "because prompts differ. Rerun on an idle machine for tighter numbers."]
    if a["peers"]:
        lines += ["", "## Peers", ""] + md_table(*peer_table(a))
    lines += [""] + category_markdown(result, a)
    across = across_markdown(result, a)  # what "auto" across drafters chose, and how it paid per category
    lines += [""] + across if across else []
    specbench = specbench_markdown(result, a)  # Spec-Bench's own table when the prompts are its questions
    lines += [""] + specbench if specbench else []
    split = time_split.markdown(a)  # where each best configuration's pass time goes
    lines += [""] + split if split else []
    lines += ["", "## All configurations", ""] + md_table(*grid_table(a))
    predictions = summary_line(result["records"])
    if predictions:
        lines += ["", predictions + " \"pred ÷ meas\": the predicted speedup of whole generations (the cost model: "
                  "target pass, drafting and the engine's own work per step, prefill included) ÷ the measured one."]
    if result.get("skipped"):
        lines += ["", "Not measured (the drafter cannot fill the tree): "
                  + "; ".join(f"{k['config']} ({k['reason']})" for k in result["skipped"]) + "."]
    usage = usage_lines(result, a, folder)
    lines += ([""] + usage if usage else []) + ["", "## Figures", ""]
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
                    "predicted_speedup_lo": c.get("predicted_speedup_lo"),
                    "predicted_speedup_hi": c.get("predicted_speedup_hi"),
                    "predicted_over_measured": ratio(c), "target_passes": c["target_passes"],
                    "new_tokens": c["new_tokens"],
                    "overhead_fraction": c.get("overhead_fraction"),
                    "draft_ms_per_depth": c.get("draft_ms_per_depth"), "c": c.get("c"), "vs_best": c.get("verdict")})
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    """Empty cells for values that do not apply (never "nan")."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows({k: "" if missing(v) else v for k, v in r.items()} for r in rows)


# ---------------------------------------------------------------------------------------------- outputs

def render(result: dict, out_dir: Path, figures: bool = True) -> dict:
    """Every file of the report from results.json's contents (the figures unless ``figures=False``); returns
    the analysis."""
    out_dir = Path(out_dir)
    a = analyse(result)
    _write_csv(out_dir / "results.csv", csv_rows(a))
    _write_csv(out_dir / "summary.csv", summary_records(a))
    # seconds: the target alone; after_<drafter>: each forward timed right after that drafter's drafting call
    # (each curve also holds the sizes its own trees verify: blank where a curve was not timed at that size)
    curves = {"seconds": result["cost_curve"], **{f"after_{name}": c for name, c in
                                                  (result.get("cost_curves_after_drafting") or {}).items()}}
    curves = {column: {int(n): t for n, t in c.items()} for column, c in curves.items()}
    sizes = sorted(set().union(*map(set, curves.values())))
    _write_csv(out_dir / "cost_curve.csv", [{"tree_tokens": n, **{column: round(c[n], 6) if n in c else None
                                                                  for column, c in curves.items()}}
                                            for n in sizes])
    _write_csv(out_dir / "by_category.csv", category_rows(result, a))
    specbench = specbench_rows(result, a)
    if specbench:
        _write_csv(out_dir / "specbench.csv", specbench)
    best = a.get("best")
    if best and best.get("tree_spec"):  # the best configuration's tree, for generate(tree=Tree.load(...))
        save_tree(build_tree(best["tree_spec"]), out_dir / "best_tree.json", config=best["config"],
                  drafter=drafter_of(best), speedup=best["speedup_est"].value,
                  load=(result.get("drafter_entries") or {}).get(drafter_of(best)))
    text = render_batches(result, a, out_dir, markdown(result, a, out_dir), _write_csv, figures)
    (out_dir / "results.md").write_text(text)
    if figures:
        plot(result, a, out_dir)
    return a


def write_outputs(result: dict, out_dir: Path, logger=None, figures: bool = True) -> dict:
    """results.json, then the report rendered from it (and the wandb run's tables and figures)."""
    out_dir = Path(out_dir)
    save_result(result, out_dir)
    a = render(result, out_dir, figures)
    if logger is not None:
        log_wandb(logger, result, a, out_dir)
    return a


def rerender(path: str | Path, out_dir: str | Path | None = None, figures: bool = True) -> Path:
    """Rebuild a run's report (tables, CSVs, figures) from its results.json, without measuring; in place
    unless ``out_dir`` is given."""
    result, folder = load_result(path)
    out = Path(out_dir) if out_dir is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    render(result, out, figures)
    return out


# ---------------------------------------------------------------------------------------------- wandb

def log_wandb(logger, result: dict, a: dict, out_dir: Path) -> None:
    records = result["records"]
    logger.log({f"compare/{rec['config']}/{k}": rec[k] for rec in records
                for k in ("tau", "tokens_per_s", "speedup") if not missing(rec[k])})
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
    by_category, prompt_runs = category_rows(result, a), run_rows(result)  # each with a category column
    specbench = specbench_rows(result, a)
    stamp = {k: v for k, v in (result.get("stamp") or {}).items() if k != "config"}

    def send(run):
        run.config.update({"stamp": stamp}, allow_val_change=True)
        run.log({
            "compare/summary": _table(summary),
            "compare/results": _table(grid),
            **({"compare/peers": wandb.Table(columns=peer_header, data=[[str(c) for c in r] for r in peer_rows])}
               if peer_rows else {}),
            **({"compare/by_category": _table(by_category)} if by_category else {}),
            **({"compare/specbench": _table(specbench)} if specbench else {}),
            **({"compare/prompt_runs": _table(prompt_runs)} if prompt_runs else {}),
            **{f"compare/{name[:-4]}": wandb.Image(str(out_dir / name)) for name in FIGURES
               if (out_dir / name).is_file()},
        })

    def _table(rows: list[dict]):
        return wandb.Table(columns=list(rows[0]), data=[[None if missing(v) else v for v in r.values()]
                                                        for r in rows])

    logger._wandb_call(send)  # offline-safe: a wandb error disables wandb with a warning, the run goes on
