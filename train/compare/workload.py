"""Workloads: the prompt sets the comparison times (conf/workload/, docs/workloads.md).

Every source yields ``Item``s: an id, a category and one or more user turns (plus any messages before the
first turn: a system prompt, recorded history). Sources (``workload.source``):

- ``reference``: the shipped held-out code prompts (treespec/models/prompts.jsonl), in three categories a
  code model's drafters differ on (``reference_category``): ``repetitive`` (tables, runs of near-identical
  lines: prompt lookup's ground), ``tests`` (assertion-heavy test code) and ``library`` (the rest).
- ``jsonl`` (``path``): one JSON object per line, its format detected per row (``FORMATS``): Spec-Bench /
  MT-Bench ``question.jsonl`` (``question_id``, ``category``, ``turns``), OpenAI ``messages``, ShareGPT
  ``conversations``, or ``{"prompt": ...}`` / ``{"text": ...}`` with an optional ``category`` and ``id``.
- ``dataset`` (``name``, ``split``, ``columns``): a ``datasets`` folder (``save_to_disk``), parquet/JSON(L)
  files, or a Hub id; ``columns`` maps these field names to the set's columns, then rows read as above.
- ``texts`` (``path``): windows of about ``window_chars`` characters of the text or code files in a folder;
  a file's category is its first sub-folder (its suffix when it lies at the top).

A conversation (``messages``/``conversations``) is asked at its last user message: the messages before
it are its context, as recorded, and a trailing recorded answer is dropped (the target writes its own).
Rows that cannot be read (a line that is not UTF-8 or not JSON, a category that is not a string, Spec-Bench
turns that are not a list of strings), hold no user turn, or repeat an earlier row's content are skipped and
counted; lines that are not UTF-8 are also named in a warning. Rows that share an id but differ are kept, the
later ones renamed ``ID#2``, ``ID#3``, ... with a warning, so every prompt has its own id in the report.

**Selection** (``select``, train/compare/selection.py) is deterministic and seeded. Within a category, items are
ranked by a sha1 of (seed, content), never by file position: shuffling the file changes nothing, and a grown file
keeps every earlier selected item that still ranks among the first of its category (an item enters only by ranking
ahead). Per category, the first ``held_out`` (spread over categories, never a category's last item) are held out:
the target's own continuations of them give the drafters' accuracies, FR-Spec's ranking, disjoint from the timed
prompts. The next ``per_category`` are timed; ``prompts`` caps the total, taking categories in turn. Items longer
than ``max_prompt_tokens`` (after the template) are skipped and counted, never cut.

**A chat training run's held-out conversations** (``chat_validation``: the run's ``data.chat.val_fraction``, on its
``data.chat.source``): only the rows that run held out for validation are read, by the rule that split them
(train/training/chat.py's ``conversation_key``, hashed by ``is_validation``): conversations of the drafter's training
distribution it never trained on, as the end of ``scripts/train_heads.py`` prints (train/training/run_summary.py)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath

from treespec import reference
from treespec.corpus import is_validation
from treespec.train.compare.selection import check_categories, select
from treespec.train.compare.workload_rows import DEFAULT_CATEGORY, FORMATS, Item, read_jsonl, read_rows  # noqa: F401
from treespec.train.training import config_checks
from treespec.train.training.chat import conversation_key
from treespec.train.training.conversations import BadRow, load_rows, normalize

REPETITIVE = 0.30  # zlib-compressed size ÷ size at or below which a reference prompt counts as repetitive


@dataclass
class Workload:
    source: str                                   # what was read: "reference", "jsonl: /path", ...
    timed: list[Item]
    held_out: list[Item]                          # the reference set's: its split held_out (reference_held_out)
    skipped: Counter = field(default_factory=Counter)   # reason → count
    formats: Counter = field(default_factory=Counter)   # detected row format → count
    categories: list[str] = field(default_factory=list)  # every category the source holds (after the filter)

    def digest(self) -> str:
        """sha1 over the selected items' content keys, timed then held out: equal digests, equal prompts."""
        keys = [i.key for i in self.timed] + ["held out"] + [i.key for i in self.held_out]
        return hashlib.sha1("|".join(keys).encode()).hexdigest()



def chat_validation(val_fraction, system_prompt: str | None = None):
    """``keep(row)``: whether chat training with ``data.chat.val_fraction`` = ``val_fraction`` (and
    ``data.chat.system_prompt`` = ``system_prompt``) held the row's conversation out for validation (module
    docstring); rows it could not train on are not kept."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 1:
        raise ValueError(f"workload.chat_validation={val_fraction!r} must be the training run's data.chat.val_fraction,"
                         " a number in (0, 1]")

    def keep(row) -> bool:
        try:
            return is_validation(conversation_key(normalize(row, system_prompt)), float(val_fraction))
        except BadRow:
            return False

    return keep



def _offline() -> bool:
    """Whether the Hugging Face clients are told to stay offline (the environment, read now)."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def read_dataset(name: str, split: str = "train", columns: dict | None = None, cache_dir=None, keep=None):
    """A ``datasets`` set: a local folder (``save_to_disk``), parquet/JSON(L) files (or a glob of them, as
    ``data.chat.source`` takes it), or a Hub id. ``keep`` as ``read_rows`` takes it (on the renamed rows)."""
    import datasets  # heavy: only this source needs it

    local = Path(str(name)).expanduser()
    if local.exists() or (any(c in str(name) for c in "*?[") and glob.glob(str(local))):
        rows = load_rows(local, split=split, cache_dir=cache_dir)
    else:
        datasets.disable_progress_bars()
        try:
            if _offline():  # say so at once rather than after the Hub client's retries
                raise ConnectionError("offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)")
            rows = datasets.load_dataset(str(name), split=split, cache_dir=cache_dir)
        except Exception as err:  # noqa: BLE001 - offline, unknown or gated: one message that says what to do
            raise ValueError(
                f"workload.name={name!r} is not a local folder or file, and the Hugging Face Hub could not give it "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}). On a machine "
                f"with a network: python -c \"import datasets; datasets.load_dataset('{name}', split='{split}')"
                ".save_to_disk('DIR')\", copy DIR here and pass workload.name=DIR (or a parquet file)") from None
    mapping = {k: v for k, v in (columns or {}).items() if v}
    missing = sorted(v for v in mapping.values() if v not in rows.column_names)
    if missing:
        raise ValueError(f"workload.columns names {missing}, which {name} does not have (its columns: "
                         f"{', '.join(rows.column_names)})")
    renamed = ({**{k: v for k, v in row.items() if k not in mapping.values()},
                **{ours: row[theirs] for ours, theirs in mapping.items()}} for row in rows)
    return read_rows(renamed, str(name), keep=keep)


def check_texts(pattern, window_chars, windows_per_file) -> None:
    """``workload=texts``'s settings: a glob inside ``workload.path`` (relative, no ``..``) and windows of at
    least one character, at least one per file. A ValueError names the key, the value and what is accepted."""
    config_checks.integer(window_chars, "workload.window_chars")
    config_checks.integer(windows_per_file, "workload.windows_per_file")
    if not isinstance(pattern, str) or not pattern or PurePath(pattern).anchor \
            or ".." in PurePosixPath(pattern.replace("\\", "/")).parts:
        raise ValueError(f"workload.pattern={pattern!r} must be a glob inside workload.path: relative, without '..' "
                         "(e.g. '*.py', 'src/*.py', '*')")


def read_texts(path: str | os.PathLike, pattern: str = "*", window_chars: int = 1000,
               windows_per_file: int = 4) -> tuple[list[Item], Counter, Counter]:
    """Windows of the text files under ``path``: up to ``windows_per_file`` per file, each about
    ``window_chars`` characters ending at a line break; files that are not UTF-8 text are skipped, and so is
    any file whose real path (links followed) lies outside ``path``."""
    check_texts(pattern, window_chars, windows_per_file)
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"workload.path={str(root)!r}: no such folder")
    real_root = root.resolve()
    items, skipped = [], Counter()
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and not p.name.startswith("."))
    for file in files:
        if not file.resolve().is_relative_to(real_root):
            skipped["outside workload.path"] += 1
            continue
        try:
            text = file.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            skipped["not UTF-8 text"] += 1
            continue
        except OSError:
            skipped["unreadable"] += 1
            continue
        rel = file.relative_to(root)
        category = rel.parts[0] if len(rel.parts) > 1 else (file.suffix.lstrip(".") or DEFAULT_CATEGORY)
        start, k = 0, 0
        while start < len(text) and k < windows_per_file:
            end = text.rfind("\n", start, start + window_chars) + 1 if start + window_chars < len(text) else len(text)
            end = end if end > start else min(len(text), start + window_chars)
            if text[start:end].strip():
                items.append(Item(f"{rel.as_posix()}#{k}", category, (text[start:end],)))
                k += 1
            start = end
        if k == 0:
            skipped["no text"] += 1
    if not items:
        counts = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
        why = f"none of the {len(files)} files matching it holds text ({counts})" if files else "no file matches it"
        raise ValueError(f"workload.path={str(root)!r}, workload.pattern={pattern!r}: {why}; workload=texts reads "
                         "UTF-8 text files")
    return items, skipped, Counter({"texts": len(items)})


def reference_category(source: str, text: str) -> str:
    """A shipped prompt's category: ``repetitive`` when it compresses to ≤ 30 % (tables, runs of similar
    lines), else ``tests`` for test files, else ``library``."""
    if len(zlib.compress(text.encode())) <= REPETITIVE * len(text.encode()):
        return "repetitive"
    return "tests" if "test" in source else "library"


def reference_rows() -> list[dict]:
    """Every row of treespec/models/prompts.jsonl (``split``: test, the timed prompts, or held_out)."""
    with open(reference.MODELS_DIR / "prompts.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_reference() -> tuple[list[Item], Counter, Counter]:
    """The shipped held-out prompts (treespec/models/prompts.jsonl, split test), raw code."""
    items = [Item(r["source"], reference_category(r["source"], r["text"]), (r["text"],)) for r in reference_rows()
             if r["split"] == "test"]
    return items, Counter(), Counter({"reference": len(items)})


def reference_held_out() -> list[Item]:
    """prompts.jsonl's split held_out: later lines of the timed prompts' files, each in its file's timed category:
    text like the timed prompts, not them, for the comparison's accuracies (docs/results.md, "How well predictions
    match", measures how well τ predicted from them holds)."""
    rows = reference_rows()
    category = {r["source"]: reference_category(r["source"], r["text"]) for r in rows if r["split"] == "test"}
    return [Item(f"{r['source']} (later lines)", category[r["source"]], (r["text"],)) for r in rows
            if r["split"] == "held_out" and r["source"] in category]


def read_source(w, cache_dir=None) -> tuple[list[Item], Counter, Counter, str]:
    """The items of ``workload`` config ``w``, skipped and format counts, and a description of the source."""
    source = w.get("source")
    fraction = w.get("chat_validation")
    if fraction is not None and source not in ("jsonl", "dataset"):
        raise ValueError(f"workload.chat_validation selects a chat training run's held-out conversations from its "
                         f"data.chat.source: a jsonl or dataset workload, not workload={source}")
    keep = chat_validation(fraction, w.get("system_prompt")) if fraction is not None else None
    held = f" (the conversations chat training held out for validation: val_fraction {fraction})" if keep else ""
    if source == "reference":
        return (*read_reference(), "treespec reference prompts (prompts.jsonl, split test)")
    if source == "jsonl":
        return (*read_jsonl(w.path, keep), f"jsonl: {w.path}{held}")
    if source == "dataset":
        columns = dict(w.get("columns") or {})
        return (*read_dataset(w.name, w.get("split") or "train", columns, cache_dir, keep),
                f"dataset: {w.name} (split {w.get('split') or 'train'}){held}")
    if source == "texts":
        return (*read_texts(w.path, w.get("pattern", "*"), w.get("window_chars", 1000), w.get("windows_per_file", 4)),
                f"texts: {w.path}")
    raise ValueError(f"workload.source={source!r} is not one of reference, jsonl, dataset, texts")


def load_workload(w, *, prompts: int | None = None, length=None, cache_dir=None) -> Workload:
    """Read and select the workload of config ``w`` (conf/workload/); ``prompts`` caps the timed prompts
    (the run's ``prompts``, by default ``w.prompts``); ``length(item)`` as in ``select``."""
    config_checks.integer(w.get("seed") or 0, "workload.seed", 0)  # was a bare int() error when called directly
    items, skipped, formats, source = read_source(w, cache_dir)
    # a per-category budget for a category the workload does not have is a typo, never a silent no-op
    check_categories([str(c) for c in (w.get("max_new_tokens") or {})], {i.category for i in items},
                     "workload.max_new_tokens")
    reference_set = w.get("source") == "reference"
    held_out = 0 if reference_set else int(w.get("held_out") or 0)
    timed, kept_out, names = select(
        items, per_category=w.get("per_category"), categories=w.get("categories"), held_out=held_out,
        prompts=prompts if prompts is not None else w.get("prompts"), seed=int(w.get("seed") or 0), length=length,
        max_prompt_tokens=w.get("max_prompt_tokens"), skipped=skipped)
    if reference_set and int(w.get("held_out") or 0):  # its own held-out split, not the timed prompts
        kept_out = select(reference_held_out(), categories=w.get("categories"), prompts=int(w.held_out),
                          seed=int(w.get("seed") or 0), length=length, max_prompt_tokens=w.get("max_prompt_tokens"),
                          skipped=Counter())[0]
    if not timed:
        raise ValueError(f"workload {source}: no prompt left to time ({dict(skipped)} skipped)")
    return Workload(source, timed, kept_out, skipped, formats, names)
