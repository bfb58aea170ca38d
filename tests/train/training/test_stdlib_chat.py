"""Conversations about a source tree's functions (train/training/stdlib_chat.py): what each category asks and
answers, what is left out, added files, and a workload that reads the categories back."""

import json

import pytest

from treespec.train.compare.workload import read_rows
from treespec.train.training.stdlib_chat import write

GREET = '''def greet(name, *, loud=False):
    """Say hello to a person by name.

    Loud greetings are upper case, for the hard of hearing.
    """
    text = f"hello {name}"
    return text.upper() if loud else text
'''


@pytest.fixture
def source(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(GREET)
    (root / "pkg" / "shapes.py").write_text(
        "class Square:\n"
        "    def area(self):\n"
        "        \"\"\"The area of the square, its side times its side, in square units.\"\"\"\n"
        "        return self.side ** 2\n\n"
        "    def _private(self):\n"
        "        \"\"\"A private method is no public function, whatever its docstring says at length.\"\"\"\n\n"
        "def tiny():\n    \"\"\"Too short.\"\"\"\n")
    (root / "broken.py").write_text("def (:\n")  # the stdlib ships files like this (lib2to3 test data)
    return root


def test_functions_become_explain_and_write_conversations(source, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"row": 7, "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "hello"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    counts = write(out, add=(f"{chat}:chat",), source=str(source))
    assert counts == {"explain": 2, "write": 2, "chat": 1}
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"pkg.greet:explain", "pkg.greet:write", "pkg.shapes.Square.area:explain",
                         "pkg.shapes.Square.area:write", "chat:7"}
    explain = rows["pkg.greet:explain"]["messages"]
    assert explain[0]["content"] == "What does `pkg.greet` do?"
    assert explain[1]["content"] == ("Say hello to a person by name.\n\n"
                                     "Loud greetings are upper case, for the hard of hearing.")
    write_turns = rows["pkg.greet:write"]["messages"]
    assert write_turns[0]["content"] == "Write `greet(name, *, loud=False)` (pkg): Say hello to a person by name."
    assert write_turns[1]["content"] == f"```python\n{GREET.rstrip()}\n```"
    assert "    def area" not in rows["pkg.shapes.Square.area:write"]["messages"][1]["content"]  # dedented
    # a workload reads the categories back (train/compare/workload.py)
    items, _, _ = read_rows(list(rows.values()), str(out))
    assert sorted({i.category for i in items}) == ["chat", "explain", "write"]


def test_bad_added_files_are_named(source, tmp_path):
    with pytest.raises(ValueError, match="give FILE:CATEGORY"):
        write(tmp_path / "o.jsonl", add=("chat.jsonl",), source=str(source))
    with pytest.raises(ValueError, match="missing.jsonl is not a file"):
        write(tmp_path / "o.jsonl", add=(f"{tmp_path / 'missing.jsonl'}:chat",), source=str(source))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "not a conversation"}) + "\n")
    with pytest.raises(ValueError, match="line 1 is not a conversation"):
        write(tmp_path / "o.jsonl", add=(f"{bad}:chat",), source=str(source))
    assert not (tmp_path / "o.jsonl").exists()  # nothing half-written
