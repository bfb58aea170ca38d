"""The comparison's uncertainty (train/compare/stats.py) and its results by workload category
(train/compare/categories.py) on synthetic measurements: bootstrap intervals over prompts (medians, τ with its
passes, degenerate inputs), each category's medians and intervals, each drafter's best per category, acceptance by
position and context, and a run from before categories. No model runs."""

import math
import random
import statistics

import pytest

from treespec.train.compare import report
from treespec.train.compare.stats import Estimate, groups_of, median_interval, tau_interval

from tests.helpers import REPORT_PEERS, REPORT_PLAN, synthetic_result, with_categories

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


# ------------------------------------------------------------------------------------------- categories

def test_category_table_holds_each_categorys_medians_and_intervals(tmp_path):
    from treespec.train.compare import categories

    result = with_categories(synthetic_result())
    a = report.analyse(result)
    table = categories.category_table(result, a)
    assert table["categories"] == ["code", "chat"] and table["prompts"] == {"code": 3, "chat": 2}
    assert [r["name"] for r in table["rows"]] == [*REPORT_PLAN, *REPORT_PEERS]
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
