import functools
import pickle
import shutil

import pytest
import torch

from tests.helpers import train_tiny_lm

# Tests are small: one thread avoids oversubscription on 2-core machines (and beside a training run).
torch.set_num_threads(1)


@pytest.fixture
def forbid_unpickling(monkeypatch):
    """Call the returned function to make any unpickling in the rest of the test fail loudly: proof that a
    checkpoint or cache is never loaded with pickle (which could run planted code)."""
    def arm():
        def boom(*args, **kwargs):
            raise AssertionError("something was unpickled")

        monkeypatch.setattr(torch, "load", boom)
        monkeypatch.setattr(pickle, "load", boom)
        monkeypatch.setattr(pickle, "loads", boom)

    return arm


@pytest.fixture(scope="session")
def tiny_lm_once(tmp_path_factory):
    """The tiny LM of ``tiny_trained_target``, trained once per worker process (tests/helpers/models.py)."""
    root = tmp_path_factory.mktemp("tiny_lm")
    with pytest.MonkeyPatch.context() as patch:
        train_tiny_lm(root, patch)
    return root


@pytest.fixture
def tiny_trained_target(tiny_lm_once, tmp_path, monkeypatch):
    """(folder, data-cache override) of a tiny LM trained for 60 steps through the LM entry, with wandb offline:
    a copy in this test's tmp_path (tmp_path / "lm" / "final", tmp_path / "cache") of the one this process
    trained once, so the test may write into either."""
    shutil.copytree(tiny_lm_once, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "lm" / "final", f"data.cache_dir={tmp_path / 'cache'}"


@pytest.fixture
def no_report_figures(monkeypatch):
    """A comparison run in this test writes its report without the figures (results.json, the tables, results.md):
    the figures take much of a tiny comparison's time, and tests/train/compare/test_compare.py and
    test_report_figures.py test them."""
    from treespec.train.compare import harness, report

    monkeypatch.setattr(harness, "write_outputs", functools.partial(report.write_outputs, figures=False))


def pytest_configure(config):
    # tests/train/checks/test_specforge.py: needs SpecForge's own venv (skipped without it)
    config.addinivalue_line("markers", "specforge: compares with SpecForge's code run in its own venv")
