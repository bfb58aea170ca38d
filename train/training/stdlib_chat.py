"""Conversations about the standard library's functions: chat data that needs no download.

A user who builds their own chat target needs conversations to train it on, a workload in several categories to
compare trees on, and a held-out part of both. The running interpreter's standard library has all three offline:
every public function with a docstring gives two single-turn conversations,

- ``explain``: "What does `json.dumps` do?" answered with its docstring;
- ``write``: "Write `dumps(obj, *, skipkeys=False, ...)` (json): <the docstring's first line>" answered with the
  function's source in a fenced block,

and any other conversation file joins under a category of its own (``add``: SmolLM2's Magpie conversations as
``chat``). Rows are OpenAI-style ``{"id", "category", "messages"}``, which ``scripts/train_lm.py`` learns in ChatML
(``data.corpus.source=<file>``), ``data=chat`` trains drafters on, regeneration keeps the ids and categories of, and
``workload=jsonl`` reads per category. The order is the corpus files' (sorted), then the functions' in each file, so
the same interpreter writes the same file.

    python scripts/stdlib_conversations.py stdlib_chat.jsonl --add treespec/models/smollm2/magpie.jsonl:chat
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import textwrap
from collections import Counter
from pathlib import Path

from treespec.corpus import corpus_files
from treespec.io import atomic_write

MIN_DOC_CHARS = 40      # "Return x." explains nothing worth answering
MAX_DOC_CHARS = 1500    # an answer of a few hundred tokens at most
MAX_SOURCE_LINES = 40   # longer functions are not a chat answer


def _module(relative: Path) -> str:
    """``json/encoder.py`` → ``json.encoder``; a package's ``__init__.py`` → the package."""
    parts = list(relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def _functions(tree: ast.Module):
    """(qualified name, node) of every public function and method, classes' methods named ``Class.method``."""
    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from walk(node.body, f"{prefix}{node.name}.")
    yield from walk(tree.body, "")


def conversations(source: str = "stdlib", pattern: str = "*.py"):
    """The ``explain`` and ``write`` rows of every public function with a docstring in ``source``'s files."""
    root, paths = corpus_files(source, pattern, None)
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:  # the stdlib's deliberately broken test files
            continue
        module = _module(path.relative_to(root))
        for qualname, node in _functions(tree):
            doc = ast.get_docstring(node)
            if not doc or len(doc) < MIN_DOC_CHARS:
                continue
            doc = inspect.cleandoc(doc)
            name = f"{module}.{qualname}"
            if len(doc) <= MAX_DOC_CHARS:
                yield {"id": f"{name}:explain", "category": "explain", "messages": [
                    {"role": "user", "content": f"What does `{name}` do?"},
                    {"role": "assistant", "content": doc}]}
            code = ast.get_source_segment(text, node)
            if code and code.count("\n") < MAX_SOURCE_LINES:
                ask = f"Write `{_signature(node)}` ({module}): {doc.splitlines()[0].strip()}"
                yield {"id": f"{name}:write", "category": "write", "messages": [
                    {"role": "user", "content": ask},
                    {"role": "assistant", "content": f"```python\n{textwrap.dedent(code)}\n```"}]}


def added(spec: str):
    """Rows of ``FILE:CATEGORY`` (a JSONL of conversations), each given that category and an id in it."""
    path, sep, category = spec.rpartition(":")
    if not sep or not path or not category:
        raise ValueError(f"add={spec!r}: give FILE:CATEGORY, for example magpie.jsonl:chat")
    if not Path(path).is_file():
        raise ValueError(f"add={spec!r}: {path} is not a file")
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not ("messages" in row or "conversations" in row):
                    raise ValueError(f"{path} line {i + 1} is not a conversation (no 'messages' nor 'conversations')")
                yield {**row, "id": f"{category}:{row.get('id', row.get('row', i))}", "category": category}


def write(out: str | os.PathLike, *, add: tuple[str, ...] = (), source: str = "stdlib",
          pattern: str = "*.py") -> Counter:
    """Write the conversations (module docstring) to ``out`` atomically; returns the rows per category."""
    rows = [*conversations(source, pattern), *(row for spec in add for row in added(spec))]
    counts = Counter(row["category"] for row in rows)

    def dump(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    atomic_write(out, dump)
    return counts
