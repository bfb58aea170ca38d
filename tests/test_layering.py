"""The layers (docs/design.md, "Module map"), bottom up: masks → core → heads → train. Each imports only its layer
and those below it: masks/ is a leaf that imports nothing of treespec, the core never imports drafters or
jobs, heads/ never train/; so no two layers import each other, and no module import cycles exist inside a
layer. Inside the core, planning (treespec/planning/) sits above the loop, which never imports it. Every import
counts, also inside functions and under TYPE_CHECKING. ruff's banned-api rules (per-folder ruff.toml) enforce the
same in the linter; this test runs ruff too, so the README's test command fails on a new violation. The test suite
has one rule of its own: test modules take shared helpers from tests/helpers and never import one another. And no
module (treespec/, heads/, masks/, train/, scripts/, tests/) is over 400 lines: one concept each."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = {"treespec": ROOT / "treespec", "treespec.heads": ROOT / "heads", "treespec.masks": ROOT / "masks",
            "treespec.train": ROOT / "train"}


def modules() -> dict[str, Path]:
    """Every module of the four packages, subpackages included (heads/<kind>/, train/<job>/)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(source: str, package: str):
    """(module, names imported from it) for every import statement in ``source``, a module of ``package``
    (relative imports resolved; ``import a.b`` is ("a.b", []))."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, [a.name for a in node.names]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every treespec module ``name`` imports (relative imports resolved; ``from pkg import mod`` is mod)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for base, names in imported(path.read_text(), package):
        found.add(base)
        found |= {f"{base}.{n}" for n in names if f"{base}.{n}" in known}
    return {m for m in found if m == "treespec" or m.startswith("treespec.")}


KNOWN = set(modules())
GRAPH = {name: imports_of(name, path, KNOWN) for name, path in modules().items()}


LAYERS = ("treespec.masks", "treespec", "treespec.heads", "treespec.train")  # bottom to top


def layer(module: str) -> str:
    for package in ("treespec.heads", "treespec.masks", "treespec.train"):
        if module == package or module.startswith(package + "."):
            return package
    return "treespec"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_module_imports_only_layers_below(module):
    own = layer(module)
    bad = sorted(m for m in GRAPH[module] if LAYERS.index(layer(m)) > LAYERS.index(own))
    assert not bad, f"{module} ({own}) imports {bad}: it may import only {LAYERS[: LAYERS.index(own) + 1]}"


def test_no_two_layers_import_each_other():
    """Package __init__ files included: a core module importing treespec.masks and a masks module importing
    treespec.tree is a cycle between the layers even though no single module cycle exists."""
    edges = {(layer(m), layer(d)) for m, deps in GRAPH.items() for d in deps if layer(m) != layer(d)}
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not both, f"layers importing each other: {both}"


def test_no_import_cycles():
    """Among the modules of each layer (package __init__ files, subpackages' too, only re-export, so they are left
    out)."""
    inits = {m for m, path in modules().items() if path.stem == "__init__"}
    graph = {m: {d for d in deps if d in GRAPH and d != m and d not in inits} for m, deps in GRAPH.items()
             if m not in inits}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " → ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# -- inside the core: planning apart from the loop ------------------------------------------------------------
PLANNING = "treespec.planning"
# the package's public face re-exports generate() (plan, then decode) from planning; it holds no logic
PLANNING_FACE = {"treespec"}


def in_planning(module: str) -> bool:
    return module == PLANNING or module.startswith(PLANNING + ".")


def planning_users(graph: dict[str, set[str]]) -> list[str]:
    """The core's modules outside planning (its face excepted) that import anything of treespec.planning."""
    return sorted(m for m, deps in graph.items() if layer(m) == "treespec" and not in_planning(m)
                  and m not in PLANNING_FACE and any(in_planning(d) for d in deps))


def test_the_loop_never_imports_planning():
    """Planning (tree specs, profiles, cost models, chain τ) decodes to measure, so it sits above the loop
    (generate.py, inputs.py, the walkers, cache, rows, drafter, ...): the loop receives a resolved tree and never
    reaches up, so no decoding runs inside another (docs/design.md, "Planning apart from decoding")."""
    bad = planning_users(GRAPH)
    assert not bad, f"{bad} import {PLANNING}: the loop takes a resolved tree (treespec/planning/resolve.py plans it)"
    assert "treespec.generate" in GRAPH[PLANNING + ".resolve"]  # the package is seen, and it calls the loop


def test_the_planning_check_sees_a_loop_import(tmp_path):
    """A function-local import of a planning module from a loop module is found; planning and heads/ may import it."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from treespec.planning.tree_spec import build_tree\n")
    found = imports_of("treespec.fake", fake, set(modules()))
    graph = {"treespec.fake": found, "treespec.planning.fake": found, "treespec.heads.fake": found}
    assert planning_users(graph) == ["treespec.fake"]


# -- inside the layers: train/ by job, heads/ by kind ---------------------------------------------------------
TRAIN_JOBS = ("treespec.train.training", "treespec.train.compare", "treespec.train.checks")  # bottom to top
KIND_FOLDERS = sorted(f"treespec.heads.{p.parent.name}" for p in (ROOT / "heads").glob("*/kind.py"))
# what may reach into the kind folders: the registry (the one list of kinds), export (by the kinds' hooks), the
# package's re-exports; and EAGLE-3, whose drafter extends EAGLE's, and DFlash, whose layer takes EAGLE-3's Llama sizes
KIND_USERS = {"treespec.heads", "treespec.heads.registry"}
KIND_BASES = {"treespec.heads.eagle3": {"treespec.heads.eagle"}, "treespec.heads.dflash": {"treespec.heads.eagle3"}}


def job_of(module: str) -> str | None:
    return next((j for j in TRAIN_JOBS if module == j or module.startswith(j + ".")), None)


def kind_folder_of(module: str) -> str | None:
    return next((k for k in KIND_FOLDERS if module == k or module.startswith(k + ".")), None)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if job_of(m)))
def test_train_jobs_import_only_jobs_below(module):
    """training ← compare ← checks: the comparison uses training's data and config checks, the checks use both;
    training never reaches up."""
    own = TRAIN_JOBS.index(job_of(module))
    bad = sorted(m for m in GRAPH[module] if job_of(m) and TRAIN_JOBS.index(job_of(m)) > own)
    assert not bad, f"{module} imports {bad}: train/ jobs import only {TRAIN_JOBS[: own + 1]}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if layer(m) == "treespec.heads"))
def test_a_kind_folder_is_reached_only_through_the_registry(module):
    """Shared machinery never imports a kind, and no kind imports another (except its declared base): a new kind
    is its folder and one registry line."""
    own = kind_folder_of(module)
    allowed = ({own} | KIND_BASES.get(own, set())) if own else set()
    reached = {kind_folder_of(m) for m in GRAPH[module]} - {None}
    bad = sorted(reached - allowed)
    assert module in KIND_USERS or not bad, f"{module} imports the kind folders {bad}"


def test_the_kinds_are_found():
    kinds = ["combined", "dflash", "draft_model", "eagle", "eagle3", "hydra", "lookahead", "medusa", "prompt_lookup",
             "recycling", "rest", "suffix"]
    assert KIND_FOLDERS == ["treespec.heads." + k for k in sorted(kinds)]
    assert len([m for m in GRAPH if m.startswith("treespec.train.") and m.count(".") == 2]) <= 12


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """A function-local absolute import, a TYPE_CHECKING one and a relative one are all found."""
    fake = tmp_path / "fake.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from treespec.train.training import loop\n"
                    "def f():\n    import treespec.heads.eagle.drafter\nfrom .cache import keep_tree_path\n")
    found = imports_of("treespec.fake", fake, set(modules()))
    assert {"treespec.train.training.loop", "treespec.heads.eagle.drafter", "treespec.cache"} <= found
    # a masks module reaching the core through a parent-relative import
    fake.write_text("from .. import tree\nfrom .dense import additive\n")
    found = imports_of("treespec.masks.fake", fake, set(modules()))
    assert "treespec.tree" in found and layer("treespec.tree") == "treespec"


def test_ruff_is_clean():
    pytest.importorskip("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


# -- one owner for what a query may see ------------------------------------------------------------------------
MASK_OWNER = "treespec.visibility"


def mask_users(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` outside masks/ that import anything of treespec.masks, the owner excepted."""
    return sorted(m for m, deps in graph.items() if m != MASK_OWNER and layer(m) != "treespec.masks"
                  and any(layer(d) == "treespec.masks" for d in deps))


def test_masks_have_one_owner():
    """Tree ancestry, a batch's row slots, sliding windows and the choice between dense and flex masks meet in
    treespec/visibility.py: the core, heads/, train/ and scripts/ ask it for masks, none calls masks/ itself (the
    tests of masks/ do; masks/ imports only itself)."""
    scripts = {f"scripts.{p.stem}": imports_of(f"scripts.{p.stem}", p, KNOWN)
               for p in sorted((ROOT / "scripts").glob("*.py"))}
    bad = mask_users(GRAPH | scripts)
    assert not bad, f"{bad} import treespec.masks: ask {MASK_OWNER} for masks instead"
    assert MASK_OWNER in GRAPH and any(layer(d) == "treespec.masks" for d in GRAPH[MASK_OWNER])


def test_the_mask_owner_check_sees_a_direct_use(tmp_path):
    """A function-local import of a masks/ submodule and a plain ``import treespec.masks`` are both found."""
    fake = tmp_path / "fake.py"
    fake.write_text("import treespec.masks\ndef f():\n    from treespec.masks.dense import ancestor_mask\n")
    found = imports_of("treespec.heads.fake", fake, set(modules()))
    assert mask_users({"treespec.heads.fake": found, MASK_OWNER: found, "treespec.masks.dense": found}) == [
        "treespec.heads.fake"]


# -- the tests: shared helpers live in tests/helpers, and no test module imports another ----------------------
TESTS = ROOT / "tests"


def suite_imports(source: str, path: Path) -> set[str]:
    """Every tests.* module that ``source`` (the text of ``path``, a file under tests/) imports, relative imports
    resolved; ``from . import test_x`` is tests.test_x."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    found = {m for base, names in imported(source, package) for m in (base, *(f"{base}.{n}" for n in names))}
    # only modules and packages of the suite: ``from .helpers import VOCAB`` names tests.helpers, not VOCAB
    as_path = lambda m: ROOT / m.replace(".", "/")
    return {m for m in found if m.startswith("tests.") and (as_path(m).with_suffix(".py").is_file()
                                                            or as_path(m).is_dir())}


def not_helpers(found: set[str]) -> list[str]:
    """The modules of ``found`` outside tests/helpers; a folder of the suite (``from . import test_x`` names
    tests.core as well as tests.core.test_x) holds nothing to import."""
    return sorted(m for m in found if m != "tests.helpers" and not m.startswith("tests.helpers.")
                  and not (ROOT / m.replace(".", "/")).is_dir())


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")), ids=lambda p: p.relative_to(TESTS).as_posix())
def test_the_suite_imports_helpers_only_from_tests_helpers(path):
    bad = not_helpers(suite_imports(path.read_text(), path))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: a helper two test modules share goes in tests/helpers"


def test_the_suite_import_checker_sees_a_test_module_import():
    """A function-local relative import, ``from . import``, one from a parent package and an absolute one are all
    found, in a test at the top of the suite and in one of its folders."""
    source = ("def f():\n    from .test_lossless import target\nfrom . import test_layering\nimport tests.conftest\n"
              "from .helpers import VOCAB, chat\nfrom tests.helpers import WORDS\n")
    found = suite_imports(source, TESTS / "test_x.py")
    assert not_helpers(found) == ["tests.conftest", "tests.test_layering", "tests.test_lossless"]
    source = ("from . import test_generate\nfrom ..heads.eagle.test_eagle import target\nfrom ..helpers import VOCAB\n"
              "from tests.train.compare import test_report\n")
    assert not_helpers(suite_imports(source, TESTS / "core" / "test_x.py")) == [
        "tests.core.test_generate", "tests.heads.eagle.test_eagle", "tests.train.compare.test_report"]
    assert not_helpers(suite_imports("from . import models\nfrom .chat import x\n", TESTS / "helpers" / "x.py")) == []


# -- names that say one thing ----------------------------------------------------------------------------------
# a kind folder's roles (heads/__init__.py): the same concept per kind, and one layer down from its base
KIND_ROLES = {"drafter": "treespec/drafter.py", "kind": "heads/kind.py", "objective": "heads/training/objective.py",
              "network": None, "upstream": None}


def test_no_two_modules_share_a_file_name():
    """Except __init__ and a kind folder's roles (each beside its one base in the layer above, if any)."""
    files = [p for d in ("treespec", "heads", "masks", "train", "scripts", "tests/helpers")
             for p in (ROOT / d).rglob("*.py") if p.stem != "__init__"]
    by_name: dict[str, list[str]] = {}
    for path in files:
        by_name.setdefault(path.stem, []).append(path.relative_to(ROOT).as_posix())
    bad = {}
    for name, paths in by_name.items():
        if len(paths) < 2:
            continue
        in_kinds = [p for p in paths if p.startswith("heads/") and p.count("/") == 2 and
                    (ROOT / p).parent.joinpath("kind.py").is_file()]
        rest = sorted(set(paths) - set(in_kinds))
        if name not in KIND_ROLES or rest not in ([], [KIND_ROLES[name]]):
            bad[name] = paths
    assert not bad, f"modules sharing a file name: {bad}"


def test_setup_cfg_lists_every_package():
    """A package setup.cfg leaves out is missing from an installed (non-editable) copy."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].replace(",", "\n").split() if p.strip()}
    found = {m for m, path in modules().items() if path.stem == "__init__"}
    assert listed == found, f"setup.cfg's packages: missing {sorted(found - listed)}, extra {sorted(listed - found)}"


# -- no module over 400 lines ----------------------------------------------------------------------------------
MAX_LINES = 400
SIZED = ("treespec", "heads", "masks", "train", "scripts", "tests")  # the folders whose modules are held to it


def tracked_python(root: Path = ROOT) -> list[Path]:
    """The .py files git tracks under SIZED (every .py file there where ``root`` is not a git checkout)."""
    try:
        done = subprocess.run(["git", "ls-files", "-z", "--", *SIZED], capture_output=True, text=True, cwd=root)
    except FileNotFoundError:  # no git on this machine
        done = None
    if done is None or done.returncode != 0:
        return sorted(p for d in SIZED for p in (root / d).rglob("*.py"))
    return sorted(root / name for name in done.stdout.split("\0") if name.endswith(".py") and (root / name).is_file())


def over_long(paths, limit: int = MAX_LINES) -> dict[str, int]:
    """{path: its line count} of every file of ``paths`` longer than ``limit`` lines."""
    counts = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in paths}
    return {p.as_posix(): n for p, n in counts.items() if n > limit}


def test_no_module_is_over_400_lines():
    """A module over 400 lines holds more than one concept: split it along a seam (a sibling module, a helper in
    tests/helpers, a test file per surface), never by an arbitrary cut."""
    paths = tracked_python()
    assert any(p.name == "generate.py" for p in paths) and any(p.parent.name == "tests" for p in paths)
    bad = {str(Path(p).relative_to(ROOT)): n for p, n in over_long(paths).items()}
    assert not bad, f"modules over {MAX_LINES} lines: {bad}"


def test_the_length_check_sees_a_long_module(tmp_path):
    """401 lines is over, 400 is not; a file outside git's view is still counted where git is absent."""
    long, fits = tmp_path / "long.py", tmp_path / "fits.py"
    long.write_text("x = 1\n" * 401)
    fits.write_text("x = 1\n" * 400)
    assert over_long([long, fits]) == {long.as_posix(): 401}
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("x = 1\n")
    assert tracked_python(tmp_path) == [tmp_path / "tests" / "test_x.py"]


def test_the_module_map_names_every_module():
    """docs/design.md's module map is the one description of the house: a module it does not name is one a reader
    cannot find there (five were missing before this test)."""
    text = (ROOT / "docs" / "design.md").read_text()
    missing = [p.relative_to(ROOT).as_posix() for d in ("treespec", "heads", "masks", "train")
               for p in sorted((ROOT / d).rglob("*.py"))
               if p.stem != "__init__" and "models" not in p.relative_to(ROOT).parts and p.name not in text]
    assert not missing, f"modules docs/design.md's module map does not name: {missing}"
