"""Goodness-of-fit helper shared by the losslessness tests."""

from treespec.train.lossless import chi2_pvalue  # noqa: F401 - one implementation, shared with the matrix
