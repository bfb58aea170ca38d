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

import codecs
import glob
import hashlib
import itertools
import json
import os
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath, PurePosixPath

from treespec import reference
from treespec.corpus import is_validation
from treespec.train.compare.selection import check_categories, select
from treespec.train.training import config_checks
from treespec.train.training.chat import conversation_key
from treespec.train.training.conversations import ROLES, BadRow, load_rows, normalize

DEFAULT_CATEGORY = "all"
FORMATS = {"turns": "spec-bench", "messages": "openai", "conversations": "sharegpt", "prompt": "prompt",
           "text": "text"}
REPETITIVE = 0.30  # zlib-compressed size ÷ size at or below which a reference prompt counts as repetitive


@dataclass(frozen=True)
class Item:
    """One question: ``turns`` are the user messages the target answers one after another (Spec-Bench's
    multi-turn questions have two); ``context`` the messages before the first ({"role", "content"})."""

    id: str
    category: str
    turns: tuple[str, ...]
    context: tuple[tuple[str, str], ...] = ()   # (role, content) pairs, hashable

    @property
    def key(self) -> str:
        """sha1 of the content (category, context, turns): what ranks, dedupes and stamps an item."""
        text = json.dumps([self.category, self.context, self.turns], ensure_ascii=False)
        return hashlib.sha1(text.encode()).hexdigest()

    def messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.context]


@dataclass
class Workload:
    source: str                                   # what was read: "reference", "jsonl: /path", ...
    timed: list[Item]
    held_out: list[Item]                          # empty for the reference set (its held-out text is stdlib's)
    skipped: Counter = field(default_factory=Counter)   # reason → count
    formats: Counter = field(default_factory=Counter)   # detected row format → count
    categories: list[str] = field(default_factory=list)  # every category the source holds (after the filter)

    def digest(self) -> str:
        """sha1 over the selected items' content keys, timed then held out: equal digests, equal prompts."""
        keys = [i.key for i in self.timed] + ["held out"] + [i.key for i in self.held_out]
        return hashlib.sha1("|".join(keys).encode()).hexdigest()


# -- reading rows -----------------------------------------------------------------------------------------
def _text(value) -> str | None:
    """A content value as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, (str, dict)) for p in value):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in value
                       if isinstance(p, str) or p.get("type", "text") == "text")
    return None


def _conversation(turns, index: int) -> tuple[tuple[tuple[str, str], ...], str]:
    """(context, last user message) of an OpenAI or ShareGPT conversation; a trailing answer is dropped."""
    messages = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict):
            raise BadRow("malformed turn", f"row {index}")
        raw = turn.get("role", turn.get("from"))
        role = ROLES.get(str(raw).strip().lower()) if raw is not None else None
        content = _text(turn.get("content", turn.get("value")))
        if role is None or content is None:
            raise BadRow("malformed turn", f"row {index}: role {raw!r}")
        messages.append((role, content))
    while messages and messages[-1][0] != "user":
        messages.pop()
    if not messages or not messages[-1][1].strip():
        raise BadRow("no user turn", f"row {index}")
    return tuple(messages[:-1]), messages[-1][1]


def _category(value, index: int) -> str:
    """A row's category: a string; none (missing, null, empty) is ``DEFAULT_CATEGORY``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_CATEGORY
    if not isinstance(value, str):  # 0, false, a list: never merged into "all" nor turned into a repr
        raise BadRow("category not a string", f"row {index}: category {value!r}")
    return value


def _turns(value, index: int) -> tuple[str, ...]:
    """Spec-Bench's ``turns``: a list of non-empty strings (or one string)."""
    turns = [value] if isinstance(value, str) else value
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise BadRow("turns not a list of strings", f"row {index}: turns {str(value)[:80]}")
    if not any(t.strip() for t in turns):
        raise BadRow("no user turn", f"row {index}")
    if not all(t.strip() for t in turns):  # dropping it would answer a different conversation
        raise BadRow("empty turn", f"row {index}")
    return tuple(turns)


def parse_row(row, index: int) -> tuple[Item, str]:
    """(Item, format name) of one row in any of ``FORMATS``; BadRow when it is none of them."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object", f"row {index}")
    fmt = next((key for key in FORMATS if row.get(key) is not None), None)
    if fmt is None:
        raise BadRow("unknown format", f"row {index} has none of {', '.join(FORMATS)}")
    category = _category(row.get("category"), index)
    rid = next((str(v) for v in (row.get("question_id"), row.get("id")) if v is not None), str(index))
    context: tuple = ()
    if fmt == "turns":
        turns = _turns(row["turns"], index)
    elif fmt in ("messages", "conversations"):
        context, last = _conversation(row[fmt], index)
        turns = (last,)
    else:
        text = _text(row[fmt])
        if not text or not text.strip():
            raise BadRow("empty prompt", f"row {index}")
        turns = (text,)
    return Item(rid, category, turns, context), FORMATS[fmt]


def _lines(numbers: list[int], most: int = 10) -> str:
    """"3, 7 and 12" (the first ``most`` of them, then how many more)."""
    shown = [str(n) for n in numbers[:most]] + ([f"{len(numbers) - most} more"] if len(numbers) > most else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


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


def read_rows(rows, where: str, skipped: Counter | None = None, keep=None) -> tuple[list[Item], Counter, Counter]:
    """Items of ``rows`` (dicts), with skipped rows and detected formats counted (added to ``skipped``: what
    the caller skipped before, such as lines that are not JSON); duplicates dropped; ids made unique. ``keep(row)``:
    only the rows it keeps are read (``chat_validation``); the row numbers stay those of the source."""
    items, formats, seen, taken, renamed = [], Counter(), set(), set(), []
    skipped = Counter(skipped or {})
    for i, row in enumerate(rows):
        if keep is not None and not keep(row):
            continue
        try:
            item, fmt = parse_row(row, i)
        except BadRow as bad:
            skipped[bad.reason] += 1
            continue
        if item.key in seen:
            skipped["duplicate"] += 1
            continue
        if item.id in taken:  # another row's id, other content: both kept, this one renamed
            new = next(f"{item.id}#{k}" for k in itertools.count(2) if f"{item.id}#{k}" not in taken)
            renamed.append(f"{item.id} → {new}")
            item = replace(item, id=new)
        seen.add(item.key)
        taken.add(item.id)
        items.append(item)
        formats[fmt] += 1
    if renamed:
        warnings.warn(f"{where}: {len(renamed)} row(s) share an id with an earlier row but differ; renamed "
                      f"{', '.join(renamed[:10])}{' ...' if len(renamed) > 10 else ''} so every prompt has its own id",
                      stacklevel=2)
    if not items and keep is not None:
        raise ValueError(f"{where}: no conversation of it is in the validation split workload.chat_validation "
                         f"selects ({dict(skipped) or 'none skipped'}): is it the training run's data.chat.source, "
                         "with its data.chat.val_fraction and system_prompt?")
    if not items:
        raise ValueError(f"{where}: no usable prompt ({dict(skipped) or 'no rows'}); the formats it reads are "
                         "Spec-Bench turns, OpenAI messages, ShareGPT conversations, prompt or text "
                         "(docs/workloads.md)")
    return items, skipped, formats


def _json_lines(data: bytes, path: Path) -> tuple[list, Counter]:
    """The rows of JSON Lines ``data``; lines that are not UTF-8 or not JSON are skipped and counted, the first
    kind also named in a warning (line numbers from 1)."""
    rows, bad, undecodable = [], Counter(), []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad["not UTF-8"] += 1
            undecodable.append(number)
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            bad["not JSON"] += 1
    if undecodable:
        one = len(undecodable) == 1
        warnings.warn(f"workload.path={str(path)!r}: {'line' if one else 'lines'} {_lines(undecodable)} "
                      f"{'is' if one else 'are'} not UTF-8 text: skipped and counted (save the file as UTF-8 to keep "
                      f"{'it' if one else 'them'})", stacklevel=3)
    return rows, bad


def _one_document(data: bytes, path: Path) -> list:
    """The rows of a .json file holding one document: a list of rows, or one row."""
    where = f"workload.path={str(path)!r}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{where}: not UTF-8 text at line {line} (byte {err.start}); save it as UTF-8") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON at line {err.lineno}, column {err.colno}: {err.msg} (a .json "
                         "workload holds a list of rows, one row, or one row per line)") from None
    if isinstance(doc, dict):
        return [doc]
    if isinstance(doc, list):
        return doc
    raise ValueError(f"{where}: holds a JSON {type(doc).__name__}, not a list of rows or one row")


def _first_line_is_a_row(data: bytes) -> bool:
    """Whether the first non-blank line of ``data`` is a JSON object on its own (the file is JSON Lines)."""
    first = next((line for line in data.split(b"\n") if line.strip()), b"")
    try:
        return isinstance(json.loads(first.decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def read_jsonl(path: str | os.PathLike, keep=None) -> tuple[list[Item], Counter, Counter]:
    """A JSONL file, or a .json file holding a list of rows, one row (pretty-printed or not) or JSON Lines.
    A leading byte-order mark is dropped. ``keep`` as ``read_rows`` takes it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={str(path)!r}: no such file")
    data = path.read_bytes()
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    if path.suffix == ".json" and not _first_line_is_a_row(data):
        rows, bad = _one_document(data, path), Counter()
    else:
        rows, bad = _json_lines(data, path)
    return read_rows(rows, str(path), bad, keep)


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


def read_reference() -> tuple[list[Item], Counter, Counter]:
    """The shipped held-out prompts (treespec/models/prompts.jsonl, split test), raw code."""
    with open(reference.MODELS_DIR / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    items = [Item(r["source"], reference_category(r["source"], r["text"]), (r["text"],)) for r in rows
             if r["split"] == "test"]
    return items, Counter(), Counter({"reference": len(items)})


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
    items, skipped, formats, source = read_source(w, cache_dir)
    # a per-category budget for a category the workload does not have is a typo, never a silent no-op
    check_categories([str(c) for c in (w.get("max_new_tokens") or {})], {i.category for i in items},
                     "workload.max_new_tokens")
    held_out = 0 if w.get("source") == "reference" else int(w.get("held_out") or 0)
    timed, kept_out, names = select(
        items, per_category=w.get("per_category"), categories=w.get("categories"), held_out=held_out,
        prompts=prompts if prompts is not None else w.get("prompts"), seed=int(w.get("seed") or 0), length=length,
        max_prompt_tokens=w.get("max_prompt_tokens"), skipped=skipped)
    if not timed:
        raise ValueError(f"workload {source}: no prompt left to time ({dict(skipped)} skipped)")
    return Workload(source, timed, kept_out, skipped, formats, names)
