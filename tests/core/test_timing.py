"""treespec/timing.py's helpers for the results scripts: ``clocked`` adds each call's time under its name."""

from __future__ import annotations

import time

from treespec.timing import clocked, clocked_passes


def test_clocked_adds_each_calls_time_under_its_name_and_passes_results_through():
    spent: dict[str, float] = {}
    slow = clocked(lambda seconds, tag="x": (time.sleep(seconds), tag)[1], "slow", spent)
    assert slow(0.01, tag="y") == "y" and slow(0.01) == "x"
    assert 0.02 <= spent["slow"] < 1.0 and list(spent) == ["slow"]


def test_clocked_passes_reports_milliseconds_per_pass_by_name():
    spent: dict[str, float] = {"left over": 5.0}
    nap = clocked(lambda: time.sleep(0.005), "nap", spent)
    ms = clocked_passes(nap, spent, passes=3)
    assert set(ms) == {"nap", "whole pass"}  # what an earlier pass left is cleared
    assert 5.0 <= ms["nap"] <= ms["whole pass"] < 500


def test_memory_probe_gives_a_positive_rate_each_call():
    from treespec.timing import memory_probe

    rate = memory_probe(8)
    assert rate() > 0 and rate() > 0
