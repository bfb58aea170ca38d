"""The engine's own cost per step (treespec/planning/engine_cost.py) and the cost model that carries it
(autotree.CostModel): the calibration's arithmetic on fake step times, the step clock's counts on real decoding, and the
records (cost_curve.json) with and without the engine's fields. No speed is asserted: timings are only ever fed in."""

import json

import pytest
import torch

from treespec import generate
from treespec.inputs import left_padded
from treespec.planning import engine_cost
from treespec.planning.autotree import (
    CostModel,
    EngineCost,
    auto_chooser,
    choose_tree,
    cost_at,
    predict,
    read_cost_curve,
    save_cost_curve,
    saved_chooser,
)
from treespec.planning.engine_cost import PlaceholderDrafter, StepClock, fit_engine, measure_engine_cost, step_times
from treespec.tree import Tree

from tests.helpers import tiny_llama

CURVE = {1: 1.0e-3, 4: 1.2e-3, 16: 2.0e-3, 64: 5.0e-3, 128: 9.0e-3}
ACC = [[0.8, 0.1], [0.7, 0.1], [0.6], [0.5], [0.4]]


def test_fit_recovers_a_line_and_refuses_a_falling_one():
    e = fit_engine(0.5e-3, [(3, 2e-3 + 3 * 1e-5), (9, 2e-3 + 9 * 1e-5), (31, 2e-3 + 31 * 1e-5)])
    assert e.vanilla == pytest.approx(0.5e-3) and e.fixed == pytest.approx(2e-3) and e.per_node == pytest.approx(1e-5)
    flat = fit_engine(0.0, [(3, 4e-3), (31, 2e-3)])  # a bigger tree never costs the loop less: noise
    assert flat.per_node == 0.0 and flat.fixed == pytest.approx(3e-3) and flat.vanilla == 0.0
    assert fit_engine(0.0, [(9, 2e-3)]) == EngineCost(0.0, 2e-3, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_engine(0.0, [])
    with pytest.raises(ValueError, match="steps >= 2"):
        measure_engine_cost(tiny_llama(seed=0), steps=1)


def test_calibration_from_fake_timers(monkeypatch):
    """measure_engine_cost's arithmetic: each round's steps minus the pass alone timed right before them, the median
    over rounds, a line through the tree sizes. The machine's speed changes between rounds (every time doubles in
    round 2) and one round's steps hold a slow outlier: the engine cost comes back as the one put in all the same;
    vanilla and every tree are timed in interleaved rounds after an untimed one."""
    calls = []
    sizes = [None] + [t.num_nodes for t in engine_cost.CALIBRATION_TREES]
    speed = lambda: 2.0 if len(calls) // (2 * len(sizes)) == 2 else 1.0  # round 2 (of 0..3) runs slow

    def fake_pass(target, nodes, past_len, batch=1, repeats=8):
        alone = speed() * cost_at(CURVE, nodes)
        calls.append(("pass", nodes))
        return alone

    def fake_steps(target, prompt, steps, tree=None, drafter=None, attention_mask=None, max_new_tokens=None):
        if tree is None:
            times = [speed() * (cost_at(CURVE, 1) + 0.4e-3)] * (steps - 1)
        else:
            assert isinstance(drafter, PlaceholderDrafter) and drafter.default_tree == tree
            times = [speed() * (cost_at(CURVE, tree.num_nodes) + 1.5e-3 + 2e-5 * tree.num_nodes)] * (steps - 1)
        calls.append(("steps", None if tree is None else tree.num_nodes, steps))
        return times[:-1] + [1.0]  # one step caught a slow spell: the median ignores it

    monkeypatch.setattr(engine_cost, "pass_time", fake_pass)
    monkeypatch.setattr(engine_cost, "step_times", fake_steps)
    e = measure_engine_cost(tiny_llama(seed=0), past_len=16, steps=6, repeats=3)
    assert e.vanilla == pytest.approx(0.4e-3) and e.fixed == pytest.approx(1.5e-3)
    assert e.per_node == pytest.approx(2e-5)
    rounds = [[("pass", n or 1), ("steps", n, count)] for n in sizes for count in [3]] + \
        [[("pass", n or 1), ("steps", n, 6)] for _ in range(3) for n in sizes]
    assert calls == [c for pair in rounds for c in pair]


def test_step_clock_times_every_step_and_the_placeholder_is_lossless():
    """One walk per step, plain or speculative: the clock holds one start per verification pass; a placeholder
    tree verifies like any other (greedy output equals vanilla's)."""
    target = tiny_llama(seed=0)
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    ticks = iter(range(1000))
    clock = StepClock(synchronize=False, now=lambda: float(next(ticks)))
    vanilla = generate(target, prompt, max_new_tokens=9, observer=clock)
    assert len(clock.walk_starts) == vanilla.target_passes == 8 and clock.step_seconds() == [1.0] * 7
    tree = Tree.full(2, 2)
    clock = StepClock(synchronize=False)
    out = generate(target, prompt, drafter=PlaceholderDrafter(tree, token=5), tree=tree, max_new_tokens=9,
                   observer=clock)
    assert torch.equal(out.sequences, vanilla.sequences)
    assert len(clock.walk_starts) == out.target_passes and all(s >= 0 for s in clock.step_seconds())
    assert len(step_times(target, prompt, 5, tree, PlaceholderDrafter(tree))) == 4
    assert len(step_times(target, prompt.expand(2, -1), 5)) == 4  # a batch of rows too


def test_replayed_rows_accept_the_lengths_they_are_given():
    """The ragged calibration's drafter: row b's step s accepts (b + s) mod (depth + 1) tokens of the target's own
    continuation, so rows keep different paths; the output is still the target's greedy one."""
    target = tiny_llama(seed=0)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 9, 7)]
    vanilla = generate(target, prompts, max_new_tokens=20)
    ids, mask = left_padded(prompts, 0)
    tree = Tree.chain(3)
    replay = engine_cost.ReplayDrafter(tree, vanilla.sequences[:, ids.shape[1]:], [12, 9, 7], vocab=64)
    out = generate(target, ids, attention_mask=mask, drafter=replay, tree=tree, max_new_tokens=20)
    assert torch.equal(out.sequences, vanilla.sequences)
    for row, result in enumerate(out.rows):  # each pass commits the accepted ones and one more (until the end)
        assert result.accept_lengths[:3] == [(row + step) % 4 + 1 for step in (1, 2, 3)]
    cost = measure_engine_cost(target, past_len=16, batch=3, steps=4, repeats=1, ragged=True, log=lambda *_: None)
    assert cost.vanilla >= 0 and cost.fixed >= 0


def test_the_engine_changes_predictions_and_the_choice():
    """Vanilla pays the engine once per token, a tree once per τ tokens: a large per-step engine cost makes a deep
    chain pay where the bare curve chose a shallow one; zero engine cost predicts as before."""
    bare = CostModel(CURVE, draft_cost_per_depth=0.3e-3)
    assert predict(Tree.chain(3), ACC, bare).speedup == \
        pytest.approx(predict(Tree.chain(3), ACC, CURVE, draft_cost_per_depth=0.3e-3).speedup)
    engine = EngineCost(vanilla=2e-3, fixed=2e-3, per_node=0.0)
    heavy = CostModel(CURVE, draft_cost_per_depth=0.3e-3, engine=engine)
    p = predict(Tree.chain(3), ACC, heavy)
    assert p.vanilla == pytest.approx(3e-3)
    assert p.step_cost == pytest.approx(cost_at(CURVE, 4) + 3 * 0.3e-3 + 2e-3)
    assert p.speedup == pytest.approx(p.tau * 3e-3 / p.step_cost)
    assert predict(Tree.chain(0), ACC, heavy).speedup == 1.0
    chain_only = [[0.8], [0.7], [0.6], [0.5], [0.4]]
    assert choose_tree(chain_only, heavy)[0].tree.depth > choose_tree(chain_only, bare)[0].tree.depth


def test_cost_records_keep_the_engine_and_read_old_ones(tmp_path):
    """cost_curve.json holds the engine's three terms; a file written before them reads with zeros; generate's
    chooser (saved_chooser) and a CostModel built from the same numbers choose the same tree."""
    engine = EngineCost(0.5e-3, 1.5e-3, 1e-5)
    save_cost_curve(tmp_path, CURVE, draft_cost_fixed=0.2e-3, draft_cost_per_depth=0.3e-3, baseline=0.9e-3,
                    engine=engine, device="cpu")
    record = read_cost_curve(tmp_path)
    costs = CostModel.from_record(record)
    assert costs == CostModel(CURVE, 0.2e-3, 0.3e-3, 0.9e-3, engine) and record["device"] == "cpu"
    assert CostModel.from_record(costs.record()) == costs
    for max_nodes in (4, 16):
        assert saved_chooser(record)(ACC, max_nodes) == choose_tree(ACC, costs, max_nodes=max_nodes)[0].tree
        assert auto_chooser(costs)(ACC, max_nodes) == saved_chooser(record)(ACC, max_nodes)
    old = {"curve": {str(n): t for n, t in CURVE.items()}, "draft_cost_fixed": 0.0, "draft_cost_per_depth": 1e-4,
           "baseline": None, "device": "cpu"}
    (tmp_path / "cost_curve.json").write_text(json.dumps(old))
    assert CostModel.from_record(read_cost_curve(tmp_path)).engine == EngineCost()


GOOD = {"curve": {"1": 0.01, "2": 0.011, "64": 0.03}, "draft_cost_fixed": 1e-3, "draft_cost_per_depth": 2e-3,
        "baseline": None, "engine_vanilla": 1e-4, "engine_fixed": 2e-4, "engine_per_node": 1e-6}


@pytest.mark.parametrize("edit, message", [
    # each of these once decided tree=auto unchecked, or failed far from the file
    ({"curve": {"1": float("nan"), "2": 0.02}}, r"cost of a pass over 1 tokens is nan"),
    ({"curve": {"1": 0.01, "2": float("inf")}}, r"cost of a pass over 2 tokens is inf"),
    ({"curve": {"1": -0.01, "2": 0.02}}, r"a target pass cannot take 0 s or less"),
    ({"curve": {"1": 0, "2": 0, "4": 0}}, r"a target pass cannot take 0 s or less"),  # was a ZeroDivisionError
    ({"curve": {"1": 0.01, "abc": 0.02}}, r"whole numbers of tree tokens >= 1, got 'abc'"),
    ({"curve": {"1": 0.01, "2.5": 0.02}}, r"whole numbers of tree tokens >= 1, got '2.5'"),
    ({"curve": {"1": 0.01, "2": "x"}}, r"cost of a pass over 2 tokens must be seconds \(a number\), got 'x'"),
    ({"curve": {"1": 0.01}}, r"timed at one size only"),  # cost_sizes=[1] wrote it; cost_at raised IndexError
    ({"engine_fixed": -1.0}, r"engine_fixed = -1.0 s, more negative than a whole one-token pass"),
    ({"draft_cost_per_depth": float("nan")}, r"draft_cost_per_depth is nan"),
    ({"engine_vanilla": "0.1"}, r"engine_vanilla must be seconds"),
    ({"baseline": 0.0}, r"baseline\) cannot take 0.0 s"),
])
def test_an_impossible_cost_file_is_refused_naming_it(tmp_path, edit, message):
    (tmp_path / "cost_curve.json").write_text(json.dumps({**GOOD, **edit}))
    with pytest.raises(ValueError, match=message) as err:
        read_cost_curve(tmp_path)
    assert str(tmp_path / "cost_curve.json") in str(err.value)


@pytest.mark.parametrize("edit, warning, read_as", [
    # a real measurement on a busy machine: an in-loop median minus a pass timed alone
    ({"engine_fixed": -0.00088}, r"engine_fixed = -0.00088 s is below 0 .*read as 0", {"engine_fixed": 0.0}),
    ({"draft_cost_per_depth": 2.0}, r"draft_cost_per_depth = 2 s is 200 one-token passes .*ms instead of s", {}),
    ({"curve": {"1": 0.01, "64": 1e-5}}, r"a pass over 64 tokens .* costs under 1/10 of one over 1", {}),
    ({"curve": {"1": 0.01, "2": 1e300}}, r"a pass over 2 tokens \(1e\+300 s\) costs over 20 passes over 1", {}),
])
def test_an_implausible_cost_file_is_flagged_naming_it(tmp_path, edit, warning, read_as):
    (tmp_path / "cost_curve.json").write_text(json.dumps({**GOOD, **edit}))
    with pytest.warns(UserWarning, match=warning) as caught:
        record = read_cost_curve(tmp_path)
    assert str(tmp_path / "cost_curve.json") in str(caught[0].message)
    assert all(record[k] == v for k, v in read_as.items())


def test_a_cost_file_is_checked_as_it_is_written_and_a_folder_in_its_place_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"cost_curve.json: the cost of a pass over 2 tokens is nan"):
        save_cost_curve(tmp_path, {1: 0.01, 2: float("nan")})
    assert not (tmp_path / "cost_curve.json").exists()
    with pytest.warns(UserWarning, match=r"engine_fixed = -0.00088 s is below 0"):
        save_cost_curve(tmp_path, {1: 0.01, 2: 0.02}, engine=EngineCost(1e-4, -0.00088, 0.0))
    assert json.loads((tmp_path / "cost_curve.json").read_text())["engine_fixed"] == 0.0
    (tmp_path / "other" / "cost_curve.json").mkdir(parents=True)  # was read as no file at all
    with pytest.raises(ValueError, match=r"other/cost_curve.json is not a regular file"):
        read_cost_curve(tmp_path / "other")


def test_cost_at_on_a_one_size_curve_says_so():
    assert cost_at({1: 0.01}, 1) == 0.01
    with pytest.raises(ValueError, match=r"timed at 1 size\(s\) \[1\] cannot give a pass over 4 tokens"):
        cost_at({1: 0.01}, 4)  # was an IndexError
