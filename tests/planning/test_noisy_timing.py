"""Timing that survives a noisy machine (issue 50, item 1): a term is the median of its rounds without those beyond
k·MAD (treespec/planning/robust.py), the engine's cost is timed again when it cannot be (a vanilla step's loop work
above a speculative step's, a term below 0: treespec/planning/engine_cost.py), and a prediction carries the interval
its cost terms' spread gives (treespec/planning/uncertainty.py). Timings are injected; no real clock is asserted."""

import pytest

from treespec.planning import engine_cost
from treespec.planning.autotree import CostModel, EngineCost, measure_cost_curve, predict
from treespec.planning.engine_cost import implausible, measure_engine_cost
from treespec.planning.robust import Spread, robust
from treespec.planning.uncertainty import bounded, prediction_interval
from treespec.train.compare.predictions import predicted_text
from treespec.tree import Tree

from tests.helpers import tiny_llama

TREES = (Tree.chain(2), Tree.full(2, 2))
ACC = [[0.8, 0.1], [0.7, 0.1], [0.6]]


def test_rounds_beyond_k_mads_are_dropped():
    quiet = [1.00, 1.02, 0.98, 1.01, 0.99]
    assert robust(quiet) == Spread(1.00, 0.98, 1.02, 5, 0)
    # a slow spell over two rounds of seven: a plain median moves, the robust one does not
    spell = quiet + [3.5, 3.4]
    s = robust(spell)
    assert (s.value, s.lo, s.hi, s.kept, s.dropped) == (1.00, 0.98, 1.02, 5, 2)
    longer = quiet[:4] + [3.5, 3.4, 3.3]  # three rounds of seven in the spell: the median of all is off the quiet ones
    assert robust(longer).dropped == 3 and robust(longer).hi == 1.02
    assert robust([1.0, 1.0, 1.0, 5.0]) == Spread(1.0, 1.0, 1.0, 3, 1)  # no spread at all: only the odd one goes
    assert robust([1.0, 9.0]) == Spread(5.0, 1.0, 9.0, 2, 0)  # two rounds: nothing to judge by
    with pytest.raises(ValueError, match="at least one"):
        robust([])


def test_the_cost_curve_takes_each_sizes_robust_median(monkeypatch):
    rounds = {1: [1.0, 1.1, 0.9, 4.0, 1.0], 4: [2.0, 2.1, 1.9, 2.0, 8.0]}
    monkeypatch.setattr("treespec.planning.autotree.cost_curve_rounds", lambda *a, **k: rounds)
    spread = {}
    assert measure_cost_curve(None, (1, 4), spread=spread) == {1: 1.0, 4: 2.0}
    assert spread[1] == Spread(1.0, 0.9, 1.1, 4, 1) and spread[4].dropped == 1


def test_an_implausible_engine_cost_is_timed_again(monkeypatch):
    """The first rounds put vanilla's loop work above a speculative step's (a slow spell on vanilla's rounds): more
    rounds are timed and pooled, and the pooled terms are plausible. When every try stays implausible it stops after
    ``retries`` and says so."""
    def rounds(vanilla):
        return lambda target, **kw: (list(vanilla), {tree: [1e-3 + 1e-5 * tree.num_nodes] * 3 for tree in TREES})

    assert implausible(EngineCost(0.5e-3, 1e-3, 1e-5)) is None
    assert "above a speculative step" in implausible(EngineCost(3e-3, 1e-3, 1e-5))
    assert "below 0" in implausible(EngineCost(-1e-4, 1e-3, 0.0))
    calls, logs = [], []
    answers = iter([[3.5e-3, 3.4e-3, 0.5e-3], [0.5e-3, 0.51e-3, 0.49e-3], [0.5e-3, 0.5e-3, 0.52e-3]])

    def samples(target, **kw):
        calls.append(kw["repeats"])
        return rounds(next(answers))(target, **kw)

    monkeypatch.setattr(engine_cost, "engine_samples", samples)
    bounds = {}
    e = measure_engine_cost(None, trees=TREES, repeats=3, bounds=bounds, log=logs.append)
    assert calls == [3, 3] and "implausible" in logs[0] and implausible(e) is None
    assert e.vanilla == pytest.approx(0.5e-3) and e.fixed == pytest.approx(1e-3)  # the spell's rounds dropped
    assert bounds["engine_vanilla"][1] < 1e-3 and bounds["engine_fixed"] == pytest.approx((1e-3, 1e-3))
    calls.clear()
    logs.clear()
    monkeypatch.setattr(engine_cost, "engine_samples", lambda target, **kw: calls.append(1) or rounds(
        [3e-3] * 3)(target, **kw))
    e = measure_engine_cost(None, trees=TREES, repeats=3, retries=2, log=logs.append)
    assert len(calls) == 3 and logs[-1].startswith("warning: the engine's cost is still implausible")
    # nothing says which term the spell hit: both pooled at their mean (vanilla 3 ms, one node 1.01 ms), consistent
    assert e.vanilla == pytest.approx(2.005e-3) and e.step(1) == pytest.approx(2.005e-3) and implausible(e) is None
    assert e.per_node == pytest.approx(1e-5) and "nearest terms that can both be right" in logs[-1]
    # a term that stays below 0 is put at 0 first, as a cost record keeps it, then pooled with the vanilla term
    monkeypatch.setattr(engine_cost, "engine_samples", lambda target, **kw: (
        [0.5e-3] * 3, {tree: [-1e-3 + 1e-5 * tree.num_nodes] * 3 for tree in TREES}))
    e = measure_engine_cost(None, trees=TREES, repeats=3, retries=1, log=logs.append)
    assert e.vanilla == pytest.approx(0.255e-3) and e.step(1) == pytest.approx(0.255e-3) and e.fixed > 0
    assert "still implausible" in logs[-1] and implausible(e) is None


def test_a_prediction_carries_its_cost_terms_spread():
    costs = CostModel({1: 1.0, 4: 1.5, 8: 2.0}, draft_cost_per_depth=0.1, baseline=1.0,
                      engine=EngineCost(0.2, 0.3, 0.01))
    tree = Tree.chain(3)
    point = predict(tree, ACC, costs)
    assert prediction_interval(tree, ACC, costs, None) is None  # no rounds kept: no interval
    bounds = {"curve": {"1": [0.9, 1.2], "4": [1.4, 1.8], "8": [1.9, 2.2]}, "baseline": [0.9, 1.1],
              "engine_vanilla": [0.15, 0.3], "engine_fixed": [0.25, 0.4]}
    slow, fast = prediction_interval(tree, ACC, costs, bounds)
    assert slow.speedup < point.speedup < fast.speedup and slow.tau == fast.tau == point.tau
    # each end is the prediction with every term at that end: vanilla's terms high and the step's low when fast
    assert fast.vanilla == pytest.approx(1.1 + 0.3) and fast.step_cost == pytest.approx(1.4 + 0.3 + 0.25 + 4 * 0.01)
    assert slow.vanilla == pytest.approx(0.9 + 0.15) and slow.step_cost == pytest.approx(1.8 + 0.3 + 0.4 + 4 * 0.01)
    # a size timed apart (a tree's own) moves with the others' median relative spread
    assert bounded(CostModel({1: 1.0, 3: 3.0}), {"curve": {1: [0.5, 2.0]}}, "fast").curve == {1: 0.5, 3: 1.5}
    with pytest.raises(ValueError, match="side"):
        bounded(costs, bounds, "middle")
    assert predicted_text({"predicted_speedup": 1.234, "predicted_speedup_lo": 1.1, "predicted_speedup_hi": 1.3}) == \
        "1.23× (1.10–1.30)"
    assert predicted_text({"predicted_speedup": 1.234}) == "1.23×" and predicted_text({}) == "–"


def test_the_engine_measurement_still_runs_end_to_end():
    """On a real tiny target (no timing asserted): the rounds give a plausible or flagged cost and its bounds."""
    bounds, logs = {}, []
    e = measure_engine_cost(tiny_llama(seed=0), past_len=8, trees=(Tree.chain(2),), steps=4, repeats=2, retries=1,
                            bounds=bounds, log=logs.append)
    assert set(bounds) == {"engine_vanilla", "engine_fixed"} and bounds["engine_vanilla"][0] <= e.vanilla
    assert implausible(e) is None or logs


@pytest.mark.parametrize("values, k, message", [
    ([1.0, 2.0, 3.0, 4.0], 0.5, r"k \(outliers lie beyond k scaled MADs\) must be a number >= 1, got 0.5"),  # kept none
    ([1.0, 2.0, 3.0], float("nan"), r"must be a number >= 1, got nan"),  # was a StatisticsError
    ([float("nan"), 1.0, 2.0], 3.0, r"a timed round is NaN"),  # a median over NaN depends on where it falls
])
def test_robust_refuses_what_would_leave_no_median(values, k, message):
    with pytest.raises(ValueError, match=message):
        robust(values, k)


@pytest.mark.parametrize("bounds, message", [
    ({"curve": {1: [0.5]}}, r"curve\[1\] must be \[lo, hi\]"),  # was an IndexError
    ({"curve": {1: [2.0, 0.5]}}, r"curve\[1\] must be \[lo, hi\], two finite numbers with lo <= hi"),  # inverted
    ({"baseline": [float("nan"), 1.0]}, r"baseline must be \[lo, hi\]"),
    ({"engine_fixed": ["a", "b"]}, r"engine_fixed must be \[lo, hi\]"),
    ({"curve": {"x": [0.5, 2.0]}}, r"the curve's sizes must be whole numbers of tree tokens, got 'x'"),
    ([1, 2], r"bounds must be a dict"),
])
def test_bad_bounds_are_named(bounds, message):
    with pytest.raises(ValueError, match=message):
        bounded(CostModel({1: 1.0, 2: 1.0}), bounds, "fast")
    assert bounded(CostModel({1: 1.0, 2: 1.0}), None, "slow").curve == {1: 1.0, 2: 1.0}  # None: no bounds


def test_internal_helpers_name_what_they_were_given():
    """The last two unclear errors of the fourth reliability pass: a bare AttributeError from each."""
    from treespec.planning.uncertainty import spread_pairs

    for bad in ([1, 2], "curve", {"curve": [1, 2]}):
        with pytest.raises(ValueError, match=r"CostModel.from_record takes a cost record .* got"):
            CostModel.from_record(bad)
    with pytest.raises(TypeError, match=r"spread_pairs takes \{size: robust.Spread\}, got \{1: 0.5\}"):
        spread_pairs({1: 0.5})
    assert spread_pairs({2: Spread(1.0, 0.5, 1.5, 3)}) == {2: [0.5, 1.5]}
