"""Goodness-of-fit helper shared by the losslessness tests."""

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts, expected_probs):
    """Chi-square goodness of fit; impossible outcomes that occur give 0; cells with expected count < 5
    are merged into one. Needs an informative case: several outcomes with a fair expected count."""
    observed = counts.ravel().astype(np.float64)
    expected = expected_probs.ravel() * observed.sum()
    impossible = expected == 0
    if observed[impossible].sum() > 0:
        return 0.0
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < 5
    assert (~small).sum() >= 4, "degenerate test case: too few outcomes with a fair expected count"
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
