"""The comparison's report (train/compare/report.py, train/compare/estimates.py) on synthetic measurements: tables
without holes that say what is best, the drafting cost and the time per pass, every table telling variants apart,
partial runs and results.json files lacking values, the busy-machine warning, the best tree's path, re-rendering.
No model runs. The figures' data: tests/train/compare/test_report_figures.py; intervals and categories:
tests/train/compare/test_report_intervals.py; runs side by side: tests/train/compare/test_side_by_side.py."""

import copy
import csv
import runpy
import statistics
import sys

import pytest

from treespec.train.compare import plots, report, side_by_side
from treespec.train.compare.job import run_job

from tests.helpers import (
    REPORT_PLAN,
    ROOT,
    compose_cfg,
    md_table_of,
    rendered_run,
    synthetic_result,
    with_categories,
)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One synthetic run written and rendered once (the figures take a second or two)."""
    return rendered_run(tmp_path_factory.mktemp("run"))


# ------------------------------------------------------------------------------------------- tables

def test_tables_have_no_holes_and_say_what_is_best(rendered):
    result, a, out = rendered
    md = (out / "results.md").read_text()
    for name in ("results.md", "results.csv", "summary.csv"):
        assert "nan" not in (out / name).read_text().lower(), name
    assert md.index("## Summary") < md.index("## All configurations")
    header, rows = report.summary_table(a)
    assert [r[0] for r in rows] == list(REPORT_PLAN) and "vs transformers greedy" in header
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
    for drafter in REPORT_PLAN:
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


def test_a_time_split_lacking_a_part_renders_without_it_and_a_string_prediction_is_named(tmp_path, monkeypatch):
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
    # the script, run as python runs it (in this process: a new interpreter would spend seconds importing torch)
    monkeypatch.setattr(sys, "argv", ["scripts/prediction_error.py", str(tmp_path)])
    with pytest.raises(ValueError, match=r"predicted_speedup = '1\.5', not a number"):
        runpy.run_path(str(ROOT / "scripts" / "prediction_error.py"), run_name="__main__")


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


def test_report_rerenders_identical_tables(rendered, tmp_path):
    _, _, out = rendered
    again = report.rerender(out / "results.json", tmp_path, figures=False)
    for name in ("results.md", "results.csv", "summary.csv", "cost_curve.csv"):
        assert (again / name).read_text() == (out / name).read_text(), name
