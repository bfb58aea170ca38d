"""The comparison's report (train/compare/report.py, train/compare/plots.py, train/compare/stats.py,
train/compare/stamp.py) on synthetic measurements: the figures' data, intervals, tables without holes, partial
runs, re-rendering and side-by-side
comparison. No model runs."""

import copy
import csv
import importlib.util
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treespec.train.compare import plots, report, side_by_side
from treespec.train.compare.job import run_job
from treespec.train.compare.stamp import collect, flatten, prompts_digest
from treespec.train.compare.stats import Estimate, groups_of, median_interval, tau_interval

from .helpers import compose_cfg, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
# drafter → [(tree, nodes, depth, mean τ, median speedup, predicted)]; prompt lookup and dynamic trees have no
# prediction, prompt lookup no accuracies (no heat map)
PLAN = {
    "draft": [("chain γ=1", 1, 1, 1.5, 0.95, True), ("chain γ=2", 2, 2, 1.7, 1.0, True),
              ("full 2×2", 6, 2, 2.2, 1.1, True), ("accuracy 6", 6, 3, 2.3, 1.05, True)],
    "prompt_lookup": [("chain γ=2", 2, 2, 2.1, 1.6, False), ("chain γ=4", 4, 4, 2.8, 2.2, False)],
    "eagle": [("chain γ=4", 4, 4, 3.5, 1.5, True), ("dynamic 16/5/4", 16, 5, 4.6, 1.3, False)],
}
PEERS = {"transformers greedy": 0.45, "transformers assisted": 0.3, "transformers prompt lookup": 0.8}


def _lengths(rng, tau: float, passes: int) -> list[int]:
    top = max(2, round(2 * tau))
    return [max(1, min(top, round(rng.gauss(tau, 0.8)))) for _ in range(passes)]


def _ratios(tps: list[float], base: list[float]) -> list[float]:
    return [t / b for t, b in zip(tps, base, strict=True)]


def synthetic_result(seed: int = 0, prompts: int = 5, repeats: int = 2, commit: str = "a" * 40) -> dict:
    rng = random.Random(seed)
    runs = prompts * repeats
    prompt_of_run = [i % prompts for i in range(runs)]
    vanilla_tps = [100 * (1 + 0.05 * rng.random()) for _ in range(runs)]
    records = [{"config": "vanilla", "drafter": "none", "tree": "vanilla", "nodes": 0, "depth": 0,
                "predicted_tau": 1.0, "predicted_speedup": 1.0, "tau": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
                "target_passes": runs * 16, "new_tokens": runs * 16, "overhead_fraction": 0.04,
                "draft_ms_per_depth": None, "c": None,
                "runs": {"tokens_per_s": vanilla_tps, "speedup": [1.0] * runs, "accept_lengths": [[1] * 16] * runs}}]
    prompt_effect = [rng.uniform(0.85, 1.15) for _ in range(prompts)]
    for drafter, trees in PLAN.items():
        for tree, nodes, depth, tau, speedup, predicted in trees:
            ratios = [speedup * prompt_effect[p] * rng.uniform(0.97, 1.03) for p in prompt_of_run]
            lengths = [_lengths(rng, tau, 12) for _ in range(runs)]
            records.append({
                "config": f"{drafter} | {tree}", "drafter": drafter, "tree": tree, "nodes": nodes, "depth": depth,
                "predicted_tau": tau * 0.9 if predicted else None,
                "predicted_speedup": speedup * 0.8 if predicted else None,
                "tau": sum(map(sum, lengths)) / sum(map(len, lengths)), "tokens_per_s": 100 * speedup,
                "speedup": sorted(ratios)[len(ratios) // 2], "target_passes": 12 * runs, "new_tokens": 16 * runs,
                "overhead_fraction": None if tree.startswith("dynamic") else 0.03,
                "draft_ms_per_depth": 0.5 * nodes, "c": 0.05 * nodes,
                "step_ms": {"target": 8.0 + nodes / 4, "draft": 0.5 * depth, "update": 0.1, "walk": 0.3,
                            "other": 1.0},
                "runs": {"tokens_per_s": [100 * r for r in ratios], "speedup": ratios, "accept_lengths": lengths}})
    bests = {}
    for rec in records[1:]:
        if rec["drafter"] not in bests or rec["speedup"] > bests[rec["drafter"]]["speedup"]:
            bests[rec["drafter"]] = rec
    best = max(records[1:], key=lambda r: r["speedup"])["config"]
    pass_vanilla = [100.0 * rng.uniform(0.98, 1.02) for _ in range(runs)]
    peer_pass = {"vanilla": {"tokens_per_s": pass_vanilla, "speedup": [1.0] * runs}}
    for rec in bests.values():
        tps = [v * rec["speedup"] * rng.uniform(0.95, 1.05) for v in pass_vanilla]
        peer_pass[rec["config"]] = {"tokens_per_s": tps, "speedup": _ratios(tps, pass_vanilla)}
    peers = []
    for name, speed in PEERS.items():
        tps = [v * speed * rng.uniform(0.95, 1.05) for v in pass_vanilla]
        peers.append({"name": name, "tokens_per_s": sorted(tps)[runs // 2], "speedup_vs_vanilla": speed,
                      "treespec_best_over_this": 2.0,
                      "runs": {"tokens_per_s": tps, "speedup": _ratios(tps, pass_vanilla)}})
    stamp = {"command": "python scripts/compare_trees.py", "started": "2025-01-01 00:00:00 +0000",
             "git": {"commit": commit, "dirty": False, "changed": []},
             "versions": {"treespec": "0.1.0", "torch": "2.13.0", "transformers": "5.0", "python": "3.11"},
             "device": {"device": "cpu", "cpu": "test cpu", "cpu_count": 2, "torch_threads": 2,
                        "OMP_NUM_THREADS": None},
             "target": {"source": "reference:target", "files": {"model.safetensors": "b" * 40},
                        "weights_sha1": "c" * 40},
             "drafters": {"draft": {"source": "reference:draft", "files": {}, "weights_sha1": "d" * 40},
                          "prompt_lookup": {"source": None, "weights": None},
                          "eagle": {"source": "reference:eagle", "files": {}, "weights_sha1": "e" * 40}},
             "prompts": {"set": "synthetic", "count": prompts, "token_ids_sha1": "f" * 40}, "seed": 0,
             "config": {"prompts": prompts, "repeats": repeats, "max_new_tokens": 16}}
    return {"format": 2, "stamp": stamp,
            "settings": {"prompts": prompts, "repeats": repeats, "max_new_tokens": 16, "temperature": 0.0,
                         "top_p": 1.0, "seed": 0, "bootstrap": {"samples": 500, "level": 0.95, "seed": 0}},
            "prompt_of_run": prompt_of_run, "cost_curve": {1: 0.01, 4: 0.012, 16: 0.02},
            "records": records, "skipped": [{"config": "prompt_lookup | accuracy 6", "drafter": "prompt_lookup",
                                             "tree": "accuracy 6", "reason": "no measured accuracies"}],
            "best": best, "accuracy": {"draft": [[0.6, 0.2, 0.1], [0.5, 0.15]], "eagle": [[0.7, 0.1], [0.7, 0.1]]},
            "peers": peers, "peer_pass": peer_pass, "wall_s": 12.0}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One synthetic run written and rendered once (the figures take a second or two)."""
    out = tmp_path_factory.mktemp("run")
    result = synthetic_result()
    analysis = report.write_outputs(copy.deepcopy(result), out)
    return result, analysis, out


# ------------------------------------------------------------------------------------------- intervals

def test_bootstrap_interval_contains_the_median_and_is_reproducible():
    rng = random.Random(1)
    for n_prompts, repeats in [(3, 1), (4, 2), (7, 3), (20, 1)]:
        values = [rng.lognormvariate(0, 0.3) for _ in range(n_prompts * repeats)]
        groups = groups_of(values, [i % n_prompts for i in range(len(values))])
        e = median_interval(groups, samples=500, seed=3)
        assert e.lo <= e.value <= e.hi and e.n == n_prompts
        assert e.value == pytest.approx(sorted(values)[len(values) // 2] if len(values) % 2 else
                                        sum(sorted(values)[len(values) // 2 - 1: len(values) // 2 + 1]) / 2)
        assert median_interval(groups, samples=500, seed=3) == e
    wide = median_interval([[v] for v in (0.5, 1.0, 2.0, 1.5, 0.7)], samples=500)
    narrow = median_interval([[v] for v in (0.99, 1.0, 1.01, 1.0, 1.0)], samples=500)
    assert wide.half_width() > 5 * narrow.half_width()


def test_tau_interval_resamples_prompts_with_their_passes():
    groups = [[[1, 2, 3], [2, 2]], [[4, 4, 4, 4]], [[1, 1]]]
    e = tau_interval(groups, samples=500)
    assert e.value == pytest.approx((6 + 4 + 16 + 2) / 11) and e.lo <= e.value <= e.hi and e.n == 3
    assert 1 <= e.lo and e.hi <= 4


def test_degenerate_inputs_give_points_or_nothing():
    assert not median_interval([[1.2]]).has_interval and median_interval([[1.2]]).value == 1.2
    one_prompt = median_interval([[1.0, 1.2, 0.9, 1.1]], samples=200)  # repeats of one prompt are resampled
    assert one_prompt.has_interval and one_prompt.lo <= one_prompt.value <= one_prompt.hi
    assert math.isnan(median_interval([]).value) and math.isnan(tau_interval([[[]]]).value)
    assert Estimate(1.0, 0.9, 1.1).overlaps(Estimate(1.2, 1.05, 1.3))
    assert not Estimate(1.0, 0.9, 1.1).overlaps(Estimate(1.3, 1.2, 1.4))
    with pytest.raises(ValueError, match="prompt indices"):
        groups_of([1.0, 2.0], [0])


# ------------------------------------------------------------------------------------------- figure data

def test_acceptance_lengths_are_fractions_over_shared_integer_bins(rendered):
    result, a, _ = rendered
    dist = plots.accept_length_distributions(a)
    assert set(dist) == set(PLAN)
    bins = {tuple(h["bins"]) for h in dist.values()}
    assert len(bins) == 1, "one shared axis"
    (shared,) = bins
    assert shared == tuple(range(1, len(shared) + 1)) and all(isinstance(b, int) for b in shared)
    longest = max(n for rec in result["records"] for run in rec["runs"]["accept_lengths"] for n in run
                  if rec["config"] in {c["config"] for c in a["bests"].values()})
    assert shared[-1] == longest
    for h in dist.values():
        assert sum(h["fractions"]) == pytest.approx(1.0) and all(0 <= f <= 1 for f in h["fractions"])
        assert h["tau"] == pytest.approx(sum(b * f for b, f in zip(h["bins"], h["fractions"], strict=True)))


def test_every_drafter_has_a_line_with_its_band_and_prediction(rendered):
    _, a, _ = rendered
    for key in ("speedup", "tau"):
        lines = plots.frontier(a, key)
        assert set(lines) == set(PLAN)
        for drafter, pts in lines.items():
            nodes = [p["nodes"] for p in pts]
            assert nodes == sorted(set(nodes)), "one point per node count, in order"
            for p in pts:
                assert p["lo"] <= p["value"] <= p["hi"]
                # the drafter's best tree at that node count
                same = [c for c in a["configs"].values() if c["drafter"] == drafter and c["nodes"] == p["nodes"]]
                assert p["value"] == max(c[f"{key}_est"].value for c in same)
        assert {p["tree"] for p in lines["draft"] if p["nodes"] == 6} <= {"full 2×2", "accuracy 6"}
        assert all(p["predicted"] is None for p in lines["prompt_lookup"])
        assert all(p["predicted"] is not None for p in lines["draft"])
    refs = plots.reference_lines(a, "speedup")
    assert [r["label"] for r in refs] == ["treespec vanilla", *PEERS] and refs[0]["value"] == 1.0
    assert [r["label"] for r in plots.reference_lines(a, "tau")] == ["treespec vanilla"]


def test_heat_map_data_per_drafter_with_accuracies(rendered):
    result, _, _ = rendered
    grids = plots.acceptance_grids(result)
    assert set(grids) == {"draft", "eagle"}  # prompt lookup measures none
    assert grids["draft"] == [[0.6, 0.2, 0.1], [0.5, 0.15, None]]


def test_every_figure_is_written(rendered):
    _, _, out = rendered
    for name in plots.FIGURES:
        assert (out / name).stat().st_size > 5000, name


# ------------------------------------------------------------------------------------------- tables

def test_tables_have_no_holes_and_say_what_is_best(rendered):
    result, a, out = rendered
    md = (out / "results.md").read_text()
    for name in ("results.md", "results.csv", "summary.csv"):
        assert "nan" not in (out / name).read_text().lower(), name
    assert md.index("## Summary") < md.index("## All configurations")
    header, rows = report.summary_table(a)
    assert [r[0] for r in rows] == list(PLAN) and "vs transformers greedy" in header
    best = a["best"]
    assert best["config"] == result["best"] and best["verdict"] == "best"
    for c in a["configs"].values():
        if c["config"] == "vanilla":
            continue
        e = c["speedup_est"]
        assert e.lo <= e.value <= e.hi
        assert c["verdict"] == ("best" if c is best else "indistinguishable" if e.hi >= best["speedup_est"].lo
                                else "below")
    assert any(c.get("verdict") == "below" for c in a["configs"].values())
    # missing predictions and overheads print as a dash
    grid = md.split("## All configurations")[1]
    row = next(line for line in grid.splitlines() if "dynamic 16/5/4" in line)
    assert row.count(" – ") >= 2
    # peer ratios carry intervals: each drafter's best ÷ each peer, same prompts
    for drafter in PLAN:
        ratio = a["peers"][0]["ratios"][drafter]
        assert ratio.has_interval and ratio.lo <= ratio.value <= ratio.hi
    assert "git**: aaaaaaaaaaaa (clean)" in md and "target**: reference:target" in md


def test_point_only_results_json_renders_with_dashes(tmp_path):
    """A results.json from before per-prompt values were kept: points, no intervals, still no "nan"."""
    result = synthetic_result()
    for rec in result["records"]:
        del rec["runs"]
    for p in result["peers"]:
        del p["runs"]
    del result["peer_pass"], result["stamp"]
    for rec in result["records"]:  # nor the drafting cost (kept since): dashes and empty cells
        del rec["draft_ms_per_depth"], rec["c"]
    report.render(result, tmp_path, figures=False)
    md = (tmp_path / "results.md").read_text()
    assert "nan" not in md.lower()
    header, rows = md_table_of(md, "All configurations")
    assert {row[header.index(col)] for row in rows for col in ("draft ms/depth", "c")} == {"–"}
    header, rows = md_table_of(md, "Summary")
    assert {row[header.index("c")] for row in rows} == {"–"}
    assert {r["c"] for r in csv.DictReader(open(tmp_path / "results.csv"))} == {""}


def md_table_of(md: str, section: str) -> tuple[list[str], list[list[str]]]:
    """The first table under the heading starting with ``section``: (header, rows of cells)."""
    lines = md.split(f"## {section}", 1)[1].split("\n", 1)[1].strip().splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines)]
    return cells[0], cells[2:]


def test_every_table_names_the_rule_and_the_candidates_when_a_run_compares_several(tmp_path):
    """Two acceptance rules and two candidate modes: rows that would read "eagle | chain γ=4" twice say which is
    which, in the summary, the full grid and the category table; one rule and one mode keep the tree alone."""
    result = synthetic_result()
    twin = copy.deepcopy(next(r for r in result["records"] if r["config"] == "eagle | chain γ=4"))
    twin.update({"config": "eagle | chain γ=4 | block", "acceptance": "block", "speedup": twin["speedup"] * 2})
    twin["runs"]["speedup"] = [x * 2 for x in twin["runs"]["speedup"]]
    result["records"].append(twin)
    for rec in result["records"][1:-1]:
        rec["acceptance"] = "rejection"
    result["drafter_entries"] = {"eagle": {"candidates": "sample"}, "draft": {"candidates": "topk"}}
    report.render(with_categories(result), tmp_path, figures=False)
    md = (tmp_path / "results.md").read_text()
    header, rows = md_table_of(md, "All configurations")
    shown = [row[header.index("tree")] for row in rows if row[0] == "eagle"]
    assert "chain γ=4, block, sample candidates" in shown and "chain γ=4, rejection, sample candidates" in shown
    assert len(set(shown)) == len(shown)
    header, rows = md_table_of(md, "Summary")
    assert dict((row[0], row[1]) for row in rows)["eagle"] == "chain γ=4, block, sample candidates"
    assert "| eagle | chain γ=4, block, sample candidates |" in md.split("## By category", 1)[1]
    plain = tmp_path / "plain"
    plain.mkdir()
    report.render(synthetic_result(), plain, figures=False)
    header, rows = md_table_of((plain / "results.md").read_text(), "All configurations")
    assert {row[header.index("tree")] for row in rows if row[0] == "eagle"} == {"chain γ=4", "dynamic 16/5/4"}


def test_tables_show_the_drafting_cost_with_dashes_where_it_does_not_apply(rendered):
    result, a, out = rendered
    md = (out / "results.md").read_text()
    header, rows = md_table_of(md, "All configurations")
    ms, c = header.index("draft ms/depth"), header.index("c")
    assert len(rows) == len(result["records"])
    by_config = {(row[0], row[1]): row for row in rows}
    assert by_config["vanilla (baseline)", "vanilla"][ms] == by_config["vanilla (baseline)", "vanilla"][c] == "–"
    for rec in result["records"][1:]:
        row = by_config[rec["drafter"], rec["tree"]]
        assert (row[ms], row[c]) == (f"{rec['draft_ms_per_depth']:.2f}", f"{rec['c']:.2f}"), rec["config"]
    header, rows = md_table_of(md, "Summary")
    assert [row[header.index("c")] for row in rows] == [f"{a['bests'][row[0]]['c']:.2f}" for row in rows]
    saved = {r["config"]: r for r in csv.DictReader(open(out / "results.csv"))}
    assert saved["vanilla"]["c"] == saved["vanilla"]["draft_ms_per_depth"] == ""
    for rec in result["records"][1:]:
        assert float(saved[rec["config"]]["c"]) == pytest.approx(rec["c"])
        assert float(saved[rec["config"]]["draft_ms_per_depth"]) == pytest.approx(rec["draft_ms_per_depth"])
    summary = list(csv.DictReader(open(out / "summary.csv")))
    assert [float(r["c"]) for r in summary] == pytest.approx([c["c"] for c in a["bests"].values()])


def test_time_per_pass_opens_up_each_best_configurations_pass(rendered):
    """The "Time per pass" table: each drafter's best configuration, its parts in ms with their shares, summing to
    the pass; a results.json without the split (older runs) renders no such section."""
    result, a, out = rendered
    md = (out / "results.md").read_text()
    assert md.index("## Summary") < md.index("## Time per pass") < md.index("## All configurations")
    header, rows = md_table_of(md, "Time per pass")
    assert [row[0] for row in rows] == list(a["bests"])
    for row in rows:
        parts = a["bests"][row[0]]["step_ms"]
        total = sum(parts.values())
        assert row[header.index("ms per pass")] == f"{total:.2f}"
        update = parts["update"]
        assert row[header.index("index / state update")] == f"{update:.2f} ({100 * update / total:.0f}%)"
        tau = float(row[header.index("τ")])
        assert float(row[header.index("ms per token")]) == pytest.approx(total / tau, abs=0.01 + total * 0.01)
    older = copy.deepcopy(result)
    for rec in older["records"]:
        rec.pop("step_ms", None)
    assert "## Time per pass" not in report.markdown(older, report.analyse(older))


def truncated(result: dict, k: int, prompt_of_run_too: bool = True) -> dict:
    """``result`` as saved while measuring, after its first ``k`` prompt runs: no peers yet."""
    out = copy.deepcopy(result)
    for rec in out["records"]:
        rec["runs"] = {key: values[:k] for key, values in rec["runs"].items()}
    out.update(complete=False, prompts_done=k, peers=None)
    del out["peer_pass"]
    if prompt_of_run_too:
        out["prompt_of_run"] = out["prompt_of_run"][:k]
    return out


def test_partial_results_json_renders_what_it_holds_and_says_so(rendered, tmp_path):
    result, _, out = rendered
    assert "partial run" not in (out / "results.md").read_text()
    part = truncated(result, 3)  # 3 of 5 prompts × 2 repeats
    report.save_result(part, tmp_path)
    job = run_job(compose_cfg("compare", [f"report={tmp_path}", "logger=none"]), tmp_path / "unused")
    md = job["markdown"]
    notice = md.splitlines()[2]
    assert notice.startswith("**partial run: 3 of 10 prompt runs measured**") and "peers were not measured" in notice
    assert "nan" not in md.lower() and "## Peers" not in md and "the 3 prompt runs measured" in md
    for name in plots.FIGURES:
        assert (tmp_path / name).stat().st_size > 0, name
    a = report.analyse(report.load_result(tmp_path)[0])
    for rec in part["records"][1:]:  # intervals over the 3 prompts measured, nothing else
        e = a["configs"][rec["config"]]["speedup_est"]
        assert e.n == 3 and e.value == pytest.approx(statistics.median(rec["runs"]["speedup"]))
    # set beside the complete run, the partial one is flagged
    both = side_by_side.compare_runs([out, tmp_path])
    assert "| A |" in both and "| complete |" in both
    assert "**partial: 3 of 10 prompt runs**" in both
    # a results.json whose prompt_of_run still lists every planned run: the same analysis
    other = report.analyse(truncated(result, 3, prompt_of_run_too=False))
    assert {k: c["speedup_est"] for k, c in other["configs"].items()} == \
        {k: c["speedup_est"] for k, c in a["configs"].items()}


def test_busy_machine_is_flagged(tmp_path):
    result = synthetic_result()
    result["records"][0]["runs"]["tokens_per_s"][3] = 30.0
    report.render(result, tmp_path, figures=False)
    assert "Warning: vanilla decoding ran at 30–" in (tmp_path / "results.md").read_text()


def test_vanilla_speed_is_compared_between_alike_runs_only(tmp_path):
    """Prompts that end early (an end token) pay the prefill over fewer tokens: slower on an idle machine too."""
    result = with_categories(synthetic_result())
    vanilla = result["records"][0]["runs"]
    for i in (1, 3, 6):  # ended after 3 tokens: a third of the speed, and no busy machine
        vanilla["tokens_per_s"][i], vanilla["accept_lengths"][i] = 30.0, [1, 1]
    spread = report.vanilla_spread(result, report.analyse(result))
    assert (spread["left_out"], spread["runs"], spread["budget"]) == (3, 7, 16) and spread["hi"] / spread["lo"] < 1.1
    report.render(result, tmp_path, figures=False)
    assert "Warning: vanilla" not in (tmp_path / "results.md").read_text()
    vanilla["tokens_per_s"][0] = 30.0  # one that ran its whole budget that slowly: the machine was busy
    report.render(result, tmp_path, figures=False)
    assert "Warning: vanilla decoding ran at 30–" in (tmp_path / "results.md").read_text()
    assert "over this run's 7 prompt runs that generated their whole budget of 16 tokens" in \
        (tmp_path / "results.md").read_text()
    # budgets differ (per category): each budget's runs are compared among themselves
    for p in result["prompt_info"]:
        p["max_new_tokens"] = 16 if p["category"] == "code" else 8
    vanilla["tokens_per_s"][0] = vanilla["tokens_per_s"][2]
    for i, p in enumerate(result["prompt_of_run"]):
        if result["prompt_info"][p]["category"] == "chat":
            vanilla["tokens_per_s"][i], vanilla["accept_lengths"][i] = 50.0, [1] * 7
    spread = report.vanilla_spread(result, report.analyse(result))
    assert spread["hi"] / spread["lo"] < 1.1


def test_report_of_a_results_json_lacking_values_renders_what_is_there(tmp_path):
    result = with_categories(synthetic_result())
    for p in result["prompt_info"]:
        del p["category"]
    for rec in result["records"]:
        del rec["tau"], rec["speedup"]
    report.save_result(result, tmp_path)
    md = (report.rerender(tmp_path, figures=False) / "results.md").read_text()
    assert "**results.json lacks 'tau' in 9 of 9 configurations; 'speedup' in 9 of 9 configurations; " \
           "'category' in 5 of 5 prompts (counted in 'all')**" in md
    assert "| all speedup | all τ |" in md and "nan" not in md.lower()
    points = synthetic_result()  # points only (no per-prompt runs), and those missing: dashes, no best
    for rec in points["records"]:
        del rec["runs"], rec["speedup"], rec["tau"]
    del points["peer_pass"]
    report.save_result(points, tmp_path)
    md = (report.rerender(tmp_path, figures=False) / "results.md").read_text()
    header, rows = md_table_of(md, "All configurations")
    assert {row[header.index("vs the run's best")] for row in rows} == {"–"} and "nan" not in md.lower()
    del points["records"][2]["drafter"]  # what names a configuration cannot be filled in: the file and field
    report.save_result(points, tmp_path)
    with pytest.raises(ValueError, match=r"results.json .*results.json: record 2 \('draft \| chain γ=2'\) has no "
                                         r"'drafter'"):
        report.rerender(tmp_path, figures=False)


def test_a_time_split_lacking_a_part_renders_without_it_and_a_string_prediction_is_named(tmp_path):
    result = synthetic_result()
    best = next(r for r in result["records"] if r["config"] == result["best"])
    del best["step_ms"]["update"]  # was a KeyError in the report's "Time per pass"
    report.save_result(result, tmp_path)
    md = (report.rerender(tmp_path, figures=False) / "results.md").read_text()
    assert "a number for each of target, draft, update, walk, other in 'step_ms' of 1 configurations" in md
    assert "## Time per pass" in md and "nan" not in md.lower()  # the other configurations' splits still shown
    result["records"][2]["predicted_speedup"] = "1.5"  # was a TypeError in scripts/prediction_error.py
    report.save_result(result, tmp_path)
    message = r"results.json .*: record 2 \('draft \| chain γ=2'\) has predicted_speedup = '1.5', not a number"
    with pytest.raises(ValueError, match=message):
        report.rerender(tmp_path, figures=False)
    script = subprocess.run([sys.executable, "scripts/prediction_error.py", str(tmp_path)], capture_output=True,
                            text=True, cwd=ROOT)
    assert script.returncode == 1 and "predicted_speedup = '1.5', not a number" in script.stderr


def test_the_best_tree_is_named_relative_to_where_the_run_started(tmp_path, monkeypatch):
    result = synthetic_result()
    for rec in result["records"][1:]:
        rec["tree_spec"] = {"kind": "chain", "depth": 2}
    out = tmp_path / "runs" / "compare" / "run1"
    out.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    report.render(copy.deepcopy(result), out, figures=False)  # the harness gives an absolute folder
    assert 'tree = Tree.load("runs/compare/run1/best_tree.json")' in (out / "results.md").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a folder outside the current one: its path as it is
    report.render(copy.deepcopy(result), out, figures=False)
    assert f'tree = Tree.load("{out}/best_tree.json")' in (out / "results.md").read_text()


# ------------------------------------------------------------------------------------------- re-render, compare

def test_report_rerenders_identical_tables(rendered, tmp_path):
    _, _, out = rendered
    again = report.rerender(out / "results.json", tmp_path, figures=False)
    for name in ("results.md", "results.csv", "summary.csv", "cost_curve.csv"):
        assert (again / name).read_text() == (out / name).read_text(), name


def test_report_and_compare_modes_of_the_job(rendered, tmp_path):
    _, _, out = rendered
    other = tmp_path / "other"
    other.mkdir()
    b = synthetic_result(seed=1, prompts=6, commit="9" * 40)
    b["stamp"]["device"]["torch_threads"] = 1
    report.write_outputs(b, other, figures=False)
    job = run_job(compose_cfg("compare", [f"compare=[{out},{other}]", "logger=none"]), tmp_path / "cmp")
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert job["mode"] == "compare" and text == job["markdown"]
    differ = text.split("## Where the stamps differ")[1].split("##")[0]
    assert "git.commit" in differ and "device.torch_threads" in differ and "settings.prompts" in differ
    assert "versions.torch" not in differ
    assert all(f"| {d} |" in text for d in PLAN)
    common = text.split("## Configurations measured in every run")[1]
    assert all(f"| {c['config'].replace('|', '/')} |" in common for c in b["records"])
    assert "nan" not in text.lower()
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    (copy_dir / "results.json").write_text((out / "results.json").read_text())
    job = run_job(compose_cfg("compare", [f"report={copy_dir}", "logger=none"]), tmp_path / "unused")
    assert job["mode"] == "report" and (copy_dir / "results.md").read_text() == (out / "results.md").read_text()
    assert not (tmp_path / "unused").exists()
    with pytest.raises(ValueError, match="not both"):
        run_job(compose_cfg("compare", [f"report={out}", f"compare=[{out},{other}]"]), tmp_path)
    with pytest.raises(FileNotFoundError, match="no results.json"):
        report.rerender(tmp_path / "nowhere")


def _script():
    spec = importlib.util.spec_from_file_location("compare_trees", ROOT / "scripts" / "compare_trees.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_paths_given_with_a_comma_reach_hydra_as_a_list(rendered, tmp_path):
    quote = _script().quote_compare_paths
    assert quote(["compare=runs/a,runs/b", "logger=none"]) == ["compare=['runs/a','runs/b']", "logger=none"]
    assert quote(["compare=[a,b]", "report=x"]) == ["compare=[a,b]", "report=x"]
    _, _, out = rendered
    done = subprocess.run([sys.executable, "scripts/compare_trees.py", f"compare={out},{out}", "logger=none",
                           f"run_dir={tmp_path / 'cmp'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Nothing but the start time" in (tmp_path / "cmp" / "comparison.md").read_text()


# ------------------------------------------------------------------------------------------- the stamp

def test_stamp_names_code_versions_device_weights_and_prompts():
    target = tiny_llama(seed=0)
    prompts = [torch.arange(5)[None], torch.arange(3)[None]]
    stamp = collect(target=target, prompts=prompts, prompt_set="test", command="python x.py a=1",
                    config={"a": 1}, seed=3)
    assert stamp["command"] == "python x.py a=1" and stamp["seed"] == 3 and stamp["config"] == {"a": 1}
    assert stamp["git"]["commit"] is None or len(stamp["git"]["commit"]) == 40
    assert {"treespec", "torch", "transformers"} <= set(stamp["versions"])
    assert stamp["device"]["torch_threads"] == torch.get_num_threads()
    assert len(stamp["target"]["weights_sha1"]) == 40
    assert stamp["prompts"]["token_ids_sha1"] == prompts_digest(prompts) != prompts_digest(prompts[::-1])
    json.dumps(stamp)
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": {}}) == {"a.b": "1", "a.c": "[1, 2]", "d": "{}"}


# ------------------------------------------------------------------------------------------- categories

def with_categories(result: dict) -> dict:
    """The synthetic run as a workload run: prompts 0, 2, 4 are "code", 1 and 3 "chat"."""
    result = copy.deepcopy(result)
    result["prompt_info"] = [{"id": str(p), "category": "code" if p % 2 == 0 else "chat", "turn": 1,
                              "prompt_tokens": 40 + 30 * p, "max_new_tokens": 16, "answer_tokens": 16}
                             for p in range(result["settings"]["prompts"])]
    result["settings"]["held_out"] = "the target's own continuations of 2 held-out prompts"
    return result


def test_category_table_holds_each_categorys_medians_and_intervals(tmp_path):
    from treespec.train.compare import categories

    result = with_categories(synthetic_result())
    a = report.analyse(result)
    table = categories.category_table(result, a)
    assert table["categories"] == ["code", "chat"] and table["prompts"] == {"code": 3, "chat": 2}
    assert [r["name"] for r in table["rows"]] == [*PLAN, *PEERS]
    cat_of_run = [result["prompt_info"][p]["category"] for p in result["prompt_of_run"]]
    for row in table["rows"]:
        runs = next(r["runs"] for r in result["records"] + result["peers"] if r.get("config", r.get("name")) ==
                    row["config"])
        for cat in ("code", "chat"):
            cell = row["cells"][cat]
            values = [v for v, c in zip(runs["speedup"], cat_of_run, strict=True) if c == cat]
            assert cell["speedup"].value == pytest.approx(statistics.median(values))
            assert cell["speedup"].lo <= cell["speedup"].value <= cell["speedup"].hi and cell["prompts"] == \
                table["prompts"][cat]
            if row["kind"] == "drafter":
                lengths = [n for run, c in zip(runs["accept_lengths"], cat_of_run, strict=True) if c == cat
                           for n in run]
                assert cell["tau"].value == pytest.approx(sum(lengths) / len(lengths))
            else:
                assert "tau" not in cell
    # each drafter's best configuration within each category is the one with the highest category median
    best = categories.best_per_category(result, a)
    for drafter, at in best.items():
        for cat, pick in at.items():
            medians = {c["config"]: statistics.median(v for v, k in zip(c["runs"]["speedup"], cat_of_run, strict=True)
                                                      if k == cat)
                       for c in result["records"] if c["drafter"] == drafter}
            assert pick["config"] == max(medians, key=medians.get)
    # acceptance by position and by context: every pass counted once, the bins' τ averaging to the overall τ
    for drafter, by in categories.acceptance_by_position(result, a).items():
        c = a["bests"][drafter]
        passes = [n for run in c["runs"]["accept_lengths"] for n in run]
        for what in ("position", "context"):
            assert sum(b["passes"] for b in by[what]) == len(passes)
            assert sum(b["tau"] * b["passes"] for b in by[what]) == pytest.approx(sum(passes))
            assert all(b["lo"] & (b["lo"] - 1) == 0 for b in by[what])  # powers of two
    rows = categories.category_rows(result, a)
    assert {r["category"] for r in rows} == {"code", "chat", "overall"} and len(rows) == 3 * len(table["rows"])
    report.write_outputs(result, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| code speedup | code τ | chat speedup | chat τ | overall speedup (95% CI) | overall τ |" in md
    assert "Prompts per category: code: 3, chat: 2" in md and "held-out prompts" in md
    assert "nan" not in (tmp_path / "by_category.csv").read_text().lower()


def test_a_run_from_before_categories_says_so():
    from treespec.train.compare import categories

    result = synthetic_result()
    a = report.analyse(result)
    assert categories.category_table(result, a) is None and categories.best_per_category(result, a) is None
    assert categories.category_rows(result, a) == []
    assert "predates workload categories" in report.markdown(result, a)
    assert all(by["context"] == [] for by in categories.acceptance_by_position(result, a).values())
