"""scripts/scaling_curve.py: the points read back from training and comparison runs, the log fit and its
extrapolation, and bad input named."""

import csv
import json
import math
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run_script(*args):
    old = sys.argv
    sys.argv = ["scaling_curve.py", *map(str, args)]
    try:
        runpy.run_path(str(ROOT / "scripts" / "scaling_curve.py"), run_name="__main__")
    finally:
        sys.argv = old


def fake_run(folder: Path, tokens: int, tau: float) -> Path:
    folder.mkdir(parents=True)
    summary = {"data_trained_tokens": tokens, "data_train_conversations": tokens // 250, "steps": 10,
               "tokens_seen": 2 * tokens, "train_wall_time_s": 1.0, "eval_mean_accept_length": tau,
               **{f"depth{d}_top1": 0.5 / d for d in range(1, 9)}}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_points_fit_and_extrapolate(tmp_path):
    # τ = 1 + 0.25 ln(T / 1e5) exactly: the fit recovers it and τ 3.5 lies at 1e5 · e^10
    sizes = [122_000, 350_000, 700_000, 1_400_000]
    taus = [1 + 0.25 * math.log(t / 1e5) for t in sizes]
    runs = [f"p{i}={fake_run(tmp_path / f'p{i}', t, y)}" for i, (t, y) in enumerate(zip(sizes, taus, strict=True))]
    compare = tmp_path / "cmp"
    compare.mkdir()
    with (compare / "summary.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["drafter", "config", "tree", "tau", "speedup"])
        for i, y in enumerate(taus):
            w.writerow([f"p{i}", "x", "chain γ=2", y - 0.1, 0.9])
            w.writerow([f"p{i}", "x", "accuracy 8", y, 1.1])  # the best by speedup
    with (compare / "results.csv").open("w", newline="") as f:  # every tree: a slower one holds the highest τ
        w = csv.writer(f)
        w.writerow(["drafter", "config", "tree", "tau", "speedup"])
        for i, y in enumerate(taus):
            w.writerow([f"p{i}", "x", "accuracy 8", y, 1.1])
            w.writerow([f"p{i}", "x", "dynamic 16", y + 0.5, 0.6])
            w.writerow([f"p{i}", "x", "vanilla", "", ""])  # rows without a τ are skipped
    out = tmp_path / "out"
    run_script(*sum((["--run", r] for r in runs[::-1]), []), "--compare", f"held-out={compare}", "--out", out)
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [int(r["trained_tokens"]) for r in rows] == sizes  # sorted by size
    assert [r["tree_held-out"] for r in rows] == ["accuracy 8"] * 4
    assert [r["taumax_tree_held-out"] for r in rows] == ["dynamic 16"] * 4
    assert [float(r["taumax_held-out"]) for r in rows] == pytest.approx([y + 0.5 for y in taus])
    text = (out / "curve.md").read_text()
    assert "τ = -1.878 + 0.250 · ln(tokens)" in text.replace("−", "-")  # a = 1 − 0.25 ln 1e5
    assert f"{1e5 * math.exp(10) / 1e6:.3g}M trained tokens" in text
    assert "taumax_held-out: τ = -1.378 + 0.250 · ln(tokens)" in text.replace("−", "-")  # the same line, 0.5 higher
    assert (out / "curve.png").stat().st_size > 0


def test_bad_input_is_named(tmp_path):
    with pytest.raises(SystemExit, match="summary.json does not exist"):
        run_script("--run", f"a={tmp_path}", "--out", tmp_path / "o")
    run = fake_run(tmp_path / "r", 1000, 1.2)
    with pytest.raises(SystemExit, match="NAME=DIR"):
        run_script("--run", str(run), "--out", tmp_path / "o")
    with pytest.raises(SystemExit, match="no drafter named 'a'"):
        (tmp_path / "c").mkdir()
        (tmp_path / "c" / "summary.csv").write_text("drafter,config,tree,tau,speedup\nb,x,t,1.1,1.0\n")
        run_script("--run", f"a={run}", "--compare", f"x={tmp_path / 'c'}", "--out", tmp_path / "o")


def comparison(folder: Path, taus: dict[str, float]) -> Path:
    folder.mkdir()
    with (folder / "summary.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["drafter", "config", "tree", "tau", "speedup"])
        for name, tau in taus.items():
            w.writerow([name, "x", "dynamic 16", tau, 0.8])
    return folder


def test_a_later_point_joins_from_its_summary_file_and_its_own_comparison(tmp_path):
    # the first points' run folders are gone (only their summary.json was kept) and the last point was timed in a
    # run of its own: one label over both comparison runs gives one τ column, each point read from its own run
    early = fake_run(tmp_path / "early", 100_000, 1.5) / "summary.json"
    kept = tmp_path / "summary_early.json"
    kept.write_text(early.read_text())
    late = fake_run(tmp_path / "late", 400_000, 1.8)
    first = comparison(tmp_path / "c1", {"early": 1.6, "eagle3": 9.0})
    second = comparison(tmp_path / "c2", {"late": 2.1, "eagle3": 9.0})
    out = tmp_path / "out"
    run_script("--run", f"early={kept}", "--run", f"late={late}", "--compare", f"held-out={first}",
               "--compare", f"held-out={second}", "--out", out)
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [(r["point"], float(r["tau_held-out"])) for r in rows] == [("early", 1.6), ("late", 2.1)]
    assert "tau_held-out: τ = " in (out / "curve.md").read_text()
    with pytest.raises(SystemExit, match="'late' is timed in both"):
        run_script("--run", f"late={late}", "--compare", f"held-out={second}",
                   "--compare", f"held-out={comparison(tmp_path / 'c3', {'late': 2.0})}", "--out", out)
