"""No tracked file names a folder of the machine it was written on: reports under results/, the docs, the
configs, the scripts and the code say ``runs/compare/RUN``, never ``/root/runs/compare/RUN`` (reports write run
folders relative to where the run was started: train/compare/categories.py's ``shown_path``).

Every text file ``git ls-files`` lists is scanned for home folders (``/root/``, ``/home/<user>/``), this
workplace's ``/work/`` and pytest's ``/tmp/pytest-`` folders, each where a path starts (not inside a URL or a
longer path such as ``docs/work/``). The one file left out is this test, whose purpose requires the strings."""

import re
import subprocess

import pytest

from tests.helpers import ROOT

MACHINE_PATHS = re.compile(r"(?<![\w.~/-])(/root/|/home/[\w.-]+/|/work/|/tmp/pytest-)")
EXEMPT = {"tests/test_tracked_paths.py"}  # this file: it spells the patterns out


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): nothing tracked to scan")
    return [name for name in out.stdout.decode().split("\0") if name and name not in EXEMPT]


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, the path's start) of every machine path in ``text``."""
    return [(number, match.group(1)) for number, line in enumerate(text.splitlines(), 1)
            for match in MACHINE_PATHS.finditer(line)]


def test_the_pattern_finds_machine_paths_and_leaves_urls_and_relative_paths():
    text = ('tree = Tree.load("/root/runs/compare/x/best_tree.json")\nrun_dir=/home/alice/runs\n'
            "python /work/main/x.py\n/tmp/pytest-of-root/pytest-3/a\nsee https://host.org/work/page, docs/work/x, "
            "runs/compare/x, ~/root/y and /data/models\n")
    assert machine_paths(text) == [(1, "/root/"), (2, "/home/alice/"), (3, "/work/"), (4, "/tmp/pytest-")]


def test_no_tracked_file_holds_an_absolute_path_of_this_machine():
    hits = []
    for name in tracked_text_files():
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{number}: {found}" for number, found in machine_paths(text)]
    assert not hits, ("absolute paths of the machine a file was written on (write them relative to the run's "
                      "folder or the checkout):\n" + "\n".join(hits))
