"""The comparison's figures (train/compare/plots.py) on synthetic measurements: acceptance lengths as fractions over
shared integer bins, each drafter's line with its band and prediction, the reference lines, the acceptance heat
map's data, every figure written. No model runs."""

import pytest

from treespec.train.compare import plots

from tests.helpers import REPORT_PEERS, REPORT_PLAN, rendered_run


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """One synthetic run written and rendered once (the figures take a second or two)."""
    return rendered_run(tmp_path_factory.mktemp("run"))


# ------------------------------------------------------------------------------------------- figure data

def test_acceptance_lengths_are_fractions_over_shared_integer_bins(rendered):
    result, a, _ = rendered
    dist = plots.accept_length_distributions(a)
    assert set(dist) == set(REPORT_PLAN)
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
        assert set(lines) == set(REPORT_PLAN)
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
    assert [r["label"] for r in refs] == ["treespec vanilla", *REPORT_PEERS] and refs[0]["value"] == 1.0
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
