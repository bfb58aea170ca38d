"""The Lookahead kind (conf/drafter/lookahead.yaml): Jacobi iteration fills an n-gram pool; no weights, so nothing
to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import ModelFreeKind
from treespec.heads.lookahead.drafter import Lookahead

KIND = ModelFreeKind("lookahead", Lookahead)
