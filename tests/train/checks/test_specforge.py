"""treespec's EAGLE-3 training step against SpecForge's own (train/checks/specforge_step.py, the check
scripts/specforge_check.py runs; docs/specforge_check.md).

Runs where SpecForge's venv is named (env TREESPEC_SPECFORGE_PYTHON); skipped elsewhere. Same target, random
head, batch and TTT length on both sides: per-step kept positions, losses (in both normalisations), top-1 counts
and every parameter's gradient agree to float32 tolerance, at TTT lengths 1, 2 and the published 7, with plain
windows and with a chat-like loss mask. Handing SpecForge the token mask unshifted (its own convention) must be
caught.
"""

import pytest

from treespec.train.checks import specforge_step

PYTHON = specforge_step.specforge_python()
pytestmark = [pytest.mark.specforge, pytest.mark.slow,  # opt-in: python -m pytest -m specforge
              pytest.mark.skipif(PYTHON is None, reason="no python with SpecForge (set TREESPEC_SPECFORGE_PYTHON; "
                                                        "setup in docs/specforge_check.md)")]
SMALL = {"batch": 2, "seq_len": 32, "draft_vocab": 1024}


# the span-mask case runs with -m slow (the windows case already checks every TTT length against SpecForge)
@pytest.mark.parametrize("loss_mask", ["none", pytest.param("spans", marks=pytest.mark.slow)])
def test_training_step_matches_specforge(loss_mask):
    report = specforge_step.check(python=PYTHON, lengths=(1, 2, 7), loss_mask=loss_mask, **SMALL)
    assert report.ok, "\n".join(report.lines + report.failures)
    kept = [line for line in report.lines if line.startswith("   0 ")]
    assert len(kept) == 3  # one step-0 row per TTT length: all three ran
    assert report.worst["loss"] < 1e-5 and report.worst["gradient"] < 1e-4


def test_unshifted_loss_mask_is_caught():
    """SpecForge's parser marks the trained tokens themselves; its entry k predicts token k + 2 and reads
    loss_mask[k]. Unaligned, the same spans score other predictions, and the check must say so."""
    report = specforge_step.check(python=PYTHON, lengths=(2,), loss_mask="spans", raw_mask=True, **SMALL)
    assert not report.ok
    assert any("loss differs" in f for f in report.failures), report.failures
