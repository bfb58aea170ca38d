"""A workload's rows (train/compare/workload.py's module docstring): each row's format detected and read into an
``Item``, rows that cannot be read skipped and counted (the first of each kind named where none is usable), JSON Lines
and .json files read."""

from __future__ import annotations

import codecs
import gzip
import hashlib
import itertools
import json
import os
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from treespec.train.training.conversations import ROLES, BadRow

DEFAULT_CATEGORY = "all"
FORMATS = {"turns": "spec-bench", "messages": "openai", "conversations": "sharegpt", "prompt": "prompt",
           "text": "text"}


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



# -- reading rows -----------------------------------------------------------------------------------------
def _text(value) -> str | None:
    """A content value as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, (str, dict)) for p in value):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) for p in value
                       if isinstance(p, str) or p.get("type", "text") == "text")
    return None


def _conversation(turns) -> tuple[tuple[tuple[str, str], ...], str]:
    """(context, last user message) of an OpenAI or ShareGPT conversation; a trailing answer is dropped."""
    messages = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict):
            raise BadRow("malformed turn", f"turn {len(messages) + 1} is not an object")
        raw = turn.get("role", turn.get("from"))
        role = ROLES.get(str(raw).strip().lower()) if raw is not None else None
        content = _text(turn.get("content", turn.get("value")))
        if role is None or content is None:
            raise BadRow("malformed turn", f"turn {len(messages) + 1}: role {raw!r}")
        messages.append((role, content))
    while messages and messages[-1][0] != "user":
        messages.pop()
    if not messages or not messages[-1][1].strip():
        raise BadRow("no user turn", "")
    return tuple(messages[:-1]), messages[-1][1]


def _category(value) -> str:
    """A row's category: a string; none (missing, null, empty) is ``DEFAULT_CATEGORY``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_CATEGORY
    if not isinstance(value, str):  # 0, false, a list: never merged into "all" nor turned into a repr
        raise BadRow("category not a string", f"category {value!r}")
    return value


def _turns(value) -> tuple[str, ...]:
    """Spec-Bench's ``turns``: a list of non-empty strings (or one string)."""
    turns = [value] if isinstance(value, str) else value
    if not isinstance(turns, list):
        raise BadRow("turns not a list of strings", f"turns is {str(value)[:80]} ({type(value).__name__})")
    bad = next((k for k, t in enumerate(turns) if not isinstance(t, str)), None)
    if bad is not None:  # which turn: a bare "no usable prompt" once left the file to be searched
        raise BadRow("turns not a list of strings", f"turn {bad + 1} is {str(turns[bad])[:80]} "
                                                    f"({type(turns[bad]).__name__}), not a string")
    if not any(t.strip() for t in turns):
        raise BadRow("no user turn", "")
    if not all(t.strip() for t in turns):  # dropping it would answer a different conversation
        raise BadRow("empty turn", f"turn {next(k for k, t in enumerate(turns) if not t.strip()) + 1}")
    return tuple(turns)


def parse_row(row, index: int) -> tuple[Item, str]:
    """(Item, format name) of one row in any of ``FORMATS``; BadRow when it is none of them."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object", f"a JSON {type(row).__name__}")
    fmt = next((key for key in FORMATS if row.get(key) is not None), None)
    if fmt is None:
        raise BadRow("unknown format", f"none of {', '.join(FORMATS)}")
    category = _category(row.get("category"))
    rid = next((str(v) for v in (row.get("question_id"), row.get("id")) if v is not None), str(index))
    context: tuple = ()
    if fmt == "turns":
        turns = _turns(row["turns"])
    elif fmt in ("messages", "conversations"):
        context, last = _conversation(row[fmt])
        turns = (last,)
    else:
        text = _text(row[fmt])
        if not text or not text.strip():
            raise BadRow("empty prompt", "")
        turns = (text,)
    return Item(rid, category, turns, context), FORMATS[fmt]


def _lines(numbers: list[int], most: int = 10) -> str:
    """"3, 7 and 12" (the first ``most`` of them, then how many more)."""
    shown = [str(n) for n in numbers[:most]] + ([f"{len(numbers) - most} more"] if len(numbers) > most else [])
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def read_rows(rows, where: str, skipped: Counter | None = None, keep=None, lines: list[int] | None = None
              ) -> tuple[list[Item], Counter, Counter]:
    """Items of ``rows`` (dicts), with skipped rows and detected formats counted (added to ``skipped``: what
    the caller skipped before, such as lines that are not JSON); duplicates dropped; ids made unique. ``keep(row)``:
    only the rows it keeps are read (``chat_validation``); the row numbers stay those of the source. ``lines``: each
    row's line in its file, which an error names (else its row number)."""
    items, formats, seen, taken, renamed, first = [], Counter(), set(), set(), [], {}
    skipped = Counter(skipped or {})
    for i, row in enumerate(rows):
        if keep is not None and not keep(row):
            continue
        try:
            item, fmt = parse_row(row, i)
        except BadRow as bad:
            skipped[bad.reason] += 1
            place = f"line {lines[i]}" if lines else f"row {i}"
            first.setdefault(bad.reason, f"{place}: {bad.detail}" if bad.detail else place)
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
        raise ValueError(f"{where}: no usable prompt ({dict(skipped) or 'no rows'}"
                         + "".join(f"; {reason}: first at {at}" for reason, at in first.items())
                         + "); the formats it reads are "
                         "Spec-Bench turns, OpenAI messages, ShareGPT conversations, prompt or text "
                         "(docs/workloads.md)")
    return items, skipped, formats


def _json_lines(data: bytes, path: Path) -> tuple[list, Counter, list[int]]:
    """The rows of JSON Lines ``data`` and their line numbers (from 1); lines that are not UTF-8 or not JSON are
    skipped and counted, the first kind also named in a warning."""
    rows, bad, undecodable, numbers = [], Counter(), [], []
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
            numbers.append(number)
        except json.JSONDecodeError:
            bad["not JSON"] += 1
    if undecodable:
        one = len(undecodable) == 1
        warnings.warn(f"workload.path={str(path)!r}: {'line' if one else 'lines'} {_lines(undecodable)} "
                      f"{'is' if one else 'are'} not UTF-8 text: skipped and counted (save the file as UTF-8 to keep "
                      f"{'it' if one else 'them'})", stacklevel=3)
    return rows, bad, numbers


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
    """A JSONL file (gzipped too: .gz), or a .json file holding a list of rows, one row (pretty-printed or not) or
    JSON Lines.
    A leading byte-order mark is dropped. ``keep`` as ``read_rows`` takes it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={str(path)!r}: no such file")
    data = path.read_bytes()
    if path.suffix == ".gz":  # a gzipped JSONL (treespec/models/smollm2/chat.jsonl.gz)
        data, path = gzip.decompress(data), path.with_suffix("")
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    if path.suffix == ".json" and not _first_line_is_a_row(data):
        rows, bad, lines = _one_document(data, path), Counter(), None
    else:
        rows, bad, lines = _json_lines(data, path)
    return read_rows(rows, str(path), bad, keep, lines)
