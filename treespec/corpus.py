"""Text corpora, read and split the same way wherever they are used: training the reference models
(train/training/data.py) and REST's datastore (heads/rest/) read the same documents, and the same documents are
held out from both.

The default corpus is the running interpreter's standard library (no download needed): every ``.py`` file under
``sysconfig.get_paths()["stdlib"]`` except site-packages. Documents are split into train/validation
deterministically by a hash of their name (a file's relative path; a JSONL row's own text), so the split never
depends on directory order, on where the corpus lives or on the machine. Any other directory of text files, or a
JSONL file of ``{"text": ...}`` records, can be selected instead; a JSONL corpus may also hold conversations
(``messages``/``conversations`` rows), which the caller's ``render`` turns into text (a language model trained here
learns them in ChatML: train/training/data.py).

    corpus = load_corpus(**STDLIB_CORPUS)     # Corpus(train=[(name, text), ...], val=[...])
    corpus_digest(**STDLIB_CORPUS)            # sha1 of what load_corpus reads: caches are keyed by it
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# conf/data/stdlib.yaml's corpus: the reference models' training text; its validation split is held out
STDLIB_CORPUS = {"source": "stdlib", "pattern": "*.py", "val_fraction": 0.02, "max_files": None}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the sample named ``key`` (a document's path, a conversation's JSON) is held out: a hash, so the
    split depends neither on reading order nor on the machine."""
    digest = hashlib.sha1(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def corpus_files(source: str, pattern: str, max_files: int | None) -> tuple[Path, list[Path]]:
    """The files a directory corpus reads (``source`` "stdlib" or a directory), in reading order."""
    root = stdlib_root() if source == "stdlib" else Path(source)
    paths = sorted(p for p in _matching(root, pattern) if p.is_file() and "site-packages" not in p.parts)
    return root, paths[:max_files] if max_files else paths


def _matching(root: Path, pattern: str):
    """``root.rglob(pattern)`` that never descends into a site-packages folder (whose files are left out anyway):
    the stdlib's holds every installed package, which took rglob seconds to walk. Like rglob, symlinked folders are
    not entered; a pattern naming folders ("a/*.py", "**") is rglob's own."""
    if "/" in pattern or os.sep in pattern or "**" in pattern:
        yield from root.rglob(pattern)
        return
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        base = Path(folder)
        yield from (base / name for name in fnmatch.filter(dirs + files, pattern))


def corpus_digest(source: str = "stdlib", *, pattern: str = "*.py", max_files: int | None = None, **_) -> str:
    """sha1 over the contents of every file ``load_corpus`` would read (with their relative paths): any
    edited, grown, added or removed file changes it. Other ``load_corpus`` arguments are ignored."""
    h = hashlib.sha1()
    if source == "stdlib" or Path(source).is_dir():
        root, paths = corpus_files(source, pattern, max_files)
        for path in paths:
            data = path.read_bytes()
            h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    elif Path(source).is_file():
        h.update(Path(source).read_bytes())
    else:
        raise ValueError(f"corpus source {source!r} is neither 'stdlib', a directory nor a .jsonl file")
    return h.hexdigest()


def jsonl_line(raw: bytes, source, i: int) -> str:
    """Line ``i`` (from 0) of a JSONL corpus as text; bytes that are not UTF-8 are an error naming the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus {source} line {i + 1} is not UTF-8 text (byte {raw[err.start:err.start + 1]!r} at "
                         f"column {err.start + 1})") from None


@dataclass(frozen=True)
class Corpus:
    """A list of named documents split into train and validation."""

    train: list[tuple[str, str]]
    val: list[tuple[str, str]]

    def documents(self) -> list[tuple[str, str]]:
        """Every document once: a lone document is in both parts (``load_corpus``), and REST, which reads both,
        once stored it twice."""
        return list(dict(self.train + self.val).items())


def load_corpus(
    source: str = "stdlib",
    *,
    pattern: str = "*.py",
    val_fraction: float = 0.02,
    max_files: int | None = None,
    render=None,
) -> Corpus:
    """Read documents from ``source``: "stdlib", a directory (files matching ``pattern``) or a
    ``.jsonl`` file of ``{"text": ...}`` records; with ``render`` (row → text, or None to skip the row), its
    conversation rows too. Raises ValueError when nothing is found or a row is neither."""
    if not (isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if max_files is not None and (isinstance(max_files, bool) or not isinstance(max_files, int) or max_files < 1):
        raise ValueError(f"max_files must be an integer >= 1 or None (all), got {max_files!r}")  # 0 read every file
    docs: list[tuple[str, str]] = []
    keys: list[str] = []  # what decides each document's split (is_validation)
    if source == "stdlib" or Path(source).is_dir():
        root, paths = corpus_files(source, pattern, max_files)
        for path in paths:
            docs.append((str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace")))
            keys.append(docs[-1][0])
    elif source.endswith(".jsonl") and Path(source).is_file():
        skipped = 0
        with open(source, "rb") as f:
            for i, raw in enumerate(f):
                line = jsonl_line(raw, source, i)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:  # was bare, with neither the file nor the line
                    raise ValueError(f"corpus {source} line {i + 1} is not JSON ({err.msg} at column {err.pos + 1})"
                                     ) from None
                # a row's split follows its content, not its file's path: a corpus copied elsewhere splits the same
                key = line.strip()
                if isinstance(row, dict) and isinstance(row.get("text"), str):
                    docs.append((f"{source}:{i}", row["text"]))
                    keys.append(key)
                elif render is not None and isinstance(row, dict) and ("messages" in row or "conversations" in row):
                    text = render(row)
                    if text is None:
                        skipped += 1
                        continue
                    docs.append((f"{source}:{i}", text))
                    keys.append(key)
                else:
                    what = "'text' string nor conversation" if render is not None else "'text' string"
                    raise ValueError(f"corpus {source} line {i + 1} holds no {what}: "
                                     f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
                if max_files and len(docs) >= max_files:
                    break
        if skipped:
            print(f"corpus {source}: {skipped} conversation row(s) skipped (no usable turns)")
    else:
        raise ValueError(f"corpus source {source!r} is neither 'stdlib', a directory nor a .jsonl file")
    if not docs:
        raise ValueError(f"corpus source {source!r} holds no documents matching {pattern!r}")
    held = [is_validation(key, val_fraction) for key in keys]
    train = [d for d, h in zip(docs, held, strict=True) if not h]
    val = [d for d, h in zip(docs, held, strict=True) if h]
    if not val:  # tiny corpora: keep at least one validation document (a lone one is both: read_documents)
        val, train = train[-1:], train[:-1] or train
    return Corpus(train=train, val=val)


