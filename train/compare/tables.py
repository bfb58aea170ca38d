"""Markdown and text formatting shared by the comparison's reports (train/compare/report.py,
train/compare/categories.py, train/compare/side_by_side.py): values that do not apply print as "–", never "nan";
intervals as "1.51× (1.40–1.62)".
"""

from __future__ import annotations

import math

from treespec.train.compare.stats import Estimate

DASH = "–"


def missing(x) -> bool:
    """Whether a value does not apply: None, NaN or infinite."""
    return x is None or (isinstance(x, float) and not math.isfinite(x))


def num(x, fmt: str = ".2f", suffix: str = "") -> str:
    """``x`` formatted, or "–" when it does not apply (None, NaN, inf)."""
    return DASH if missing(x) else f"{x:{fmt}}{suffix}"


def with_interval(e: Estimate | None, fmt: str = ".2f", suffix: str = "") -> str:
    """"1.51× (1.40–1.62)"; the point alone without an interval; "–" without a value."""
    if e is None or missing(e.value):
        return DASH
    if not e.has_interval:
        return num(e.value, fmt, suffix)
    return f"{e.value:{fmt}}{suffix} ({e.lo:{fmt}}–{e.hi:{fmt}})"


def md_cell(text) -> str:
    return str(text).replace("|", "/")


def md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in rows]
