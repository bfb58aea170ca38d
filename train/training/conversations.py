"""Conversation rows: reading a chat source and normalizing its rows to role/content messages.

``data.chat.source`` is a JSONL/JSON file (gzipped too, or a glob of them), parquet files, a folder of such files, or a
folder written by ``datasets.Dataset.save_to_disk``; all are read with the Hugging Face ``datasets`` library.
Rows are ShareGPT ``{"conversations": [{"from", "value"}]}`` or OpenAI ``{"messages": [{"role", "content"}]}``
(content a string or a list of text parts; an assistant message's ``reasoning_content`` is passed to the
template as it is). A row that cannot be trained on raises ``BadRow``, which the callers count and skip.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

# ShareGPT and OpenAI role names → the roles chat templates know
ROLES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant", "tool": "tool"}
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def data_suffix(path: Path) -> str:
    """A data file's kind by its name: ``.jsonl`` for chat.jsonl and chat.jsonl.gz (the datasets library reads
    gzipped JSON itself)."""
    suffixes = path.suffixes
    return suffixes[-2] if len(suffixes) >= 2 and suffixes[-1] == ".gz" else path.suffix


class BadRow(ValueError):
    """A row that cannot be trained on: ``reason`` is its category in the summary, ``detail`` an example."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def source_files(source: str | os.PathLike) -> list[Path]:
    """The files a chat source reads: a file, a glob, or every data file in a folder (for a
    ``save_to_disk`` folder, all its files)."""
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if path.is_file():
        return [path]
    files = sorted(Path(p) for p in glob.glob(str(source), recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"chat source {source!r} matches no file or folder")
    return files


def source_digest(source: str | os.PathLike) -> str:
    """sha1 over the bytes (and relative names) of every file ``source`` reads."""
    h = hashlib.sha1()
    for path in source_files(source):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def load_rows(source: str | os.PathLike, *, split: str = "train", cache_dir: str | os.PathLike | None = None):
    """The rows of a chat source as a ``datasets.Dataset`` (see the module docstring for what it may be)."""
    import datasets  # heavy: imported only by the jobs that read chat data

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source)
    hf_cache = str(Path(cache_dir) / "hf-datasets") if cache_dir else None
    try:
        if path.is_dir() and any((path / n).is_file() for n in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"chat source {path} has splits {sorted(ds)}, not data.chat.split={split!r}")
                ds = ds[split]
            return ds
        files = [p for p in source_files(source) if data_suffix(p) in FILE_BUILDERS]
        builders = {FILE_BUILDERS[data_suffix(p)] for p in files}
        if not files or len(builders) != 1:
            raise ValueError(f"chat source {source!r} must be JSON/JSONL or parquet files (one kind), or a "
                             f"datasets folder; found {[p.name for p in source_files(source)][:5]}")
        return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                     cache_dir=hf_cache)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets/arrow raise many kinds; name the source
        raise ValueError(f"cannot read chat source {source!r} with the datasets library: {type(err).__name__}: "
                         f"{err}") from err


def _text(content) -> str | None:
    """A message's content as text: a string, or the text parts of an OpenAI content list."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") not in (None, "text"):
                raise BadRow("non-text content", str(part.get("type")))
        return "".join(parts)
    raise BadRow("malformed turn", f"content of type {type(content).__name__}")


def normalize(row, system_prompt: str | None = None, *, answered: bool = True) -> list[dict]:
    """A ShareGPT or OpenAI row → [{"role", "content"(, "reasoning_content")}], or BadRow. ``answered``: a row
    with no assistant turn is a BadRow (training data; regeneration writes the answers itself)."""
    if not isinstance(row, dict):
        raise BadRow("malformed row", type(row).__name__)
    turns = row.get("messages")
    if turns is None:
        turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise BadRow("no conversation", "neither 'conversations' nor 'messages' holds turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRow("malformed turn", type(turn).__name__)
        raw_role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            raise BadRow("unknown role", repr(raw_role))
        content = _text(turn.get("content") if turn.get("content") is not None else turn.get("value"))
        reasoning = turn.get("reasoning_content") if role == "assistant" else None
        if not (content and content.strip()) and not (isinstance(reasoning, str) and reasoning.strip()):
            raise BadRow("empty turn", role)
        message = {"role": role, "content": content or ""}
        if isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    if answered and not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
