import pickle

import pytest
import torch

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


def pytest_configure(config):
    # tests/test_specforge.py: needs SpecForge's own venv (skipped without it)
    config.addinivalue_line("markers", "specforge: compares with SpecForge's code run in its own venv")
