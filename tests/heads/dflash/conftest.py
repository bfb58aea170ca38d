"""The fixtures every DFlash test module shares: the tiny target, the test prompt, a drafter overfit on the target's
greedy continuations (tests/helpers/dflash_drafters.py), and a smaller target for the chi-square tests."""

import pytest

from tests.helpers import VOCAB, dflash_prompt, dflash_target, tiny_llama, trained_dflash


@pytest.fixture(scope="module")
def target():
    return dflash_target()


@pytest.fixture(scope="module")
def prompt():
    return dflash_prompt()


@pytest.fixture(scope="module")
def trained(target, prompt):
    return trained_dflash(target, prompt)


@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
