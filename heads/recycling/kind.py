"""The Token Recycling kind (conf/drafter/recycling.yaml): the target's own top-k, recycled; no weights, so nothing
to load, score, time or train."""

from __future__ import annotations

from treespec.heads.kind import ModelFreeKind
from treespec.heads.recycling.drafter import TokenRecycling

KIND = ModelFreeKind("recycling", TokenRecycling)
