"""Each drafter kind's facts live in its kind (heads/<kind>/kind.py, a ``DrafterKind``) and nowhere else: no code
outside ``heads/<kind>/`` and the registry compares a kind's name to a string (``kind == "eagle3"``,
``name in ("draft", ...)``) or keys a table by kind names (``{"eagle": ..., "eagle3": ...}``); such code asks the
kind (``registry.get(name).vllm_method``) instead, so that adding or changing a kind is one folder and one
registry line. An AST scan of treespec/, heads/ (shared modules), train/ and scripts/."""

import ast
from pathlib import Path

from treespec.heads import registry

from tests.helpers import ROOT

SCANNED = ("treespec", "heads", "train", "scripts")
# "auto" is also a tree spec's kind ({"kind": "auto"}), the detection format and a chat template's setting: a string
# many unrelated comparisons hold, so the "auto" kind is left out of the scan
NAMES = {kind.name for kind in registry.KINDS}
# a dict is a table of kinds when it is keyed by two or more kind names; one coinciding key is a word of its own
# (bench's "draft" time, transformers' "prompt_lookup" peer)
TABLE = 2


def scanned_files():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT)
            in_kind_folder = relative.parts[0] == "heads" and len(relative.parts) > 2
            if not in_kind_folder and relative != Path("heads/registry.py"):
                yield relative


def strings(node) -> list[str]:
    """The string constants of ``node``: itself, or the elements of a tuple, list or set literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in strings(element)]
    return []


def kind_name_uses(source: str, names=NAMES) -> list[tuple[int, str]]:
    """(line, what) for every comparison against a kind's name and every dict keyed by kind names in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            hits = sorted({s for side in (node.left, *node.comparators) for s in strings(side) if s in names})
            if hits:
                found.append((node.lineno, f"compares with {', '.join(hits)}: {ast.unparse(node)}"))
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
            if len(keys) >= TABLE:
                found.append((node.lineno, f"a table keyed by kinds {', '.join(keys)}"))
    return found


def test_no_code_outside_the_kinds_compares_a_kind_name():
    uses = [f"{path}:{line}: {what}" for path in scanned_files()
            for line, what in kind_name_uses((ROOT / path).read_text())]
    assert not uses, ("a kind's fact outside heads/<kind>/: make it a DrafterKind attribute (heads/kind.py) set in "
                      "the kind's kind.py, and read it from the kind:\n" + "\n".join(uses))


def test_the_scan_finds_what_it_forbids():
    """The old code's forms are found: a comparison, a membership test, a table; a lone coinciding key is not."""
    source = ('if kind == "prompt_lookup": pass\n'
              'if found.format != "eagle3": pass\n'
              'ok = args.name in ("draft", "x")\n'
              'VLLM = {"eagle": "eagle", "medusa": "medusa"}\n'
              'parts = {"draft": 1.0, "walk": 2.0}\n'
              'if tree == "auto": pass\n')
    assert [line for line, _ in kind_name_uses(source)] == [1, 2, 3, 4]
    assert {"eagle", "eagle3", "medusa", "draft", "prompt_lookup"} <= NAMES and "auto" not in NAMES
