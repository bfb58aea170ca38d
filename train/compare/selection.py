"""Which of a workload's items are timed and which held out (train/compare/workload.py reads them): deterministic
and seeded. Within a category, items are ranked by a sha1 of (seed, content), never by file position: shuffling
the file changes nothing, and a grown file keeps every earlier selected item that still ranks among the first of
its category. Per category the first ``held_out`` (spread over categories, never a category's last item) are held
out, the next ``per_category`` timed; ``prompts`` caps the total, taking categories in turn. ``per_category`` may
also be a mapping {category: n}, the categories it does not name taking its ``default`` entry (none, or null: all
of them): Spec-Bench's MT-bench questions come in eight categories of ten, its other categories in 80s, so a
subset as balanced as the full set takes one in eight of the former.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping

DEFAULT = "default"  # per_category's entry for the categories it does not name


def rank_key(item, seed: int) -> str:
    """An item's place in its category: sha1 of (seed, its content key), never its position in the file."""
    return hashlib.sha1(f"{seed}\0{item.key}".encode()).hexdigest()


def check_categories(names, known, key: str) -> None:
    """A ValueError naming ``key`` when ``names`` holds a category the workload does not have (a typo)."""
    unknown = [c for c in names if c not in known]
    if unknown:
        raise ValueError(f"{key}: {unknown} not found; the workload's categories are {', '.join(sorted(known))}")


def counts_of(per_category, names: list[str], known=None) -> dict[str, int | None]:
    """{category: timed items at most (None: all)} for the categories ``names`` from ``per_category``: one count
    (or None) for every category, or a mapping (module docstring). A ValueError names a category the workload
    lacks (``known``: all it has, ``workload.categories`` may keep fewer) or a count below 1."""
    if not isinstance(per_category, Mapping):
        per_category = {DEFAULT: per_category}
    check_categories([str(c) for c in per_category if c != DEFAULT], set(known or names), "workload.per_category")
    for category, n in per_category.items():
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"workload.per_category: {category}={n!r} must be an integer >= 1 or null (all)")
    return {c: per_category.get(c, per_category.get(DEFAULT)) for c in names}


def select(items: list, *, per_category: int | None = None, categories=None, held_out: int = 0,
           prompts: int | None = None, seed: int = 0, length=None, max_prompt_tokens: int | None = None,
           skipped: Counter | None = None) -> tuple[list, list, list[str]]:
    """(timed, held out, categories) chosen from ``items`` (workload.py's ``Item``s; module docstring).
    ``length(item)``: its prompt's tokens, checked against ``max_prompt_tokens`` only for items that would be
    chosen; over-long ones are counted in ``skipped["over max_prompt_tokens"]``. Timed items come grouped by
    category, categories sorted."""
    skipped = skipped if skipped is not None else Counter()
    by_category: dict[str, list] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    known = set(by_category)
    if categories:
        wanted = [categories] if isinstance(categories, str) else [str(c) for c in categories]
        check_categories(wanted, by_category, "workload.categories")
        by_category = {c: by_category[c] for c in wanted}
    names = sorted(by_category)
    counts = counts_of(per_category, names, known)
    quota = {c: held_out // len(names) + (i < held_out % len(names)) for i, c in enumerate(names)}
    timed: dict[str, list] = {}
    kept_out: dict[str, list] = {}
    for c in names:
        ranked = sorted(by_category[c], key=lambda it: rank_key(it, seed))
        fits = []
        want = quota[c] + (counts[c] if counts[c] is not None else len(ranked))
        for item in ranked:
            if len(fits) >= want:
                break
            if max_prompt_tokens is not None and length is not None and length(item) > max_prompt_tokens:
                skipped["over max_prompt_tokens"] += 1
                continue
            fits.append(item)
        h = min(quota[c], max(0, len(fits) - 1))  # a category keeps at least one timed prompt
        kept_out[c], timed[c] = fits[:h], fits[h:]
    if prompts is not None:  # the total cap, categories in turn
        order = [it for k in range(max((len(v) for v in timed.values()), default=0)) for c in names
                 for it in timed[c][k:k + 1]]
        keep = {it.key for it in order[:prompts]}
        timed = {c: [it for it in timed[c] if it.key in keep] for c in names}
    return [it for c in names for it in timed[c]], [it for c in names for it in kept_out[c]], names
