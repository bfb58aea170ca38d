"""The SuffixDecoding kind (conf/drafter/suffix.yaml): suffix-index frequencies over the prompt and earlier
outputs; no weights, so nothing to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import ModelFreeKind
from treespec.heads.suffix.drafter import SuffixDecoding

KIND = ModelFreeKind("suffix", SuffixDecoding)
