"""What a drafter run tells the researcher reading it (train/training/drafter_job.py): warnings at the start, how to
resume when it stops early, and a short summary at the end: where the trained drafter went, expected and
measured τ, the three top-1 agreements it logged and what each one counts, the formats it exports to, and the
command that compares trees for it: on the training data's own held-out part (a chat run's validation
conversations, ``workload.chat_validation``; the shipped held-out code prompts for the stdlib corpus) and with the
trees the run's accuracies and cost model suggest (``suggested_trees``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from treespec.heads.kind import DrafterKind
from treespec.planning.autotree import CostModel, chains_only, choose_tree


def duplicate_layers_warning(kind: DrafterKind, layers: Sequence[int], num_hidden_layers: int) -> str | None:
    """A warning when a drafter of ``kind`` fuses one target hidden state more than once (EAGLE-3's default
    low/mid/high aux layers on a target of fewer than 4 layers: (1, 1, 1) on 2 layers), else None. ``layers`` index
    ``hidden_states`` (negative ones from the end); the warning names the kind's setting for them
    (``kind.layers_key``)."""
    n = int(num_hidden_layers)
    resolved = [int(i) % (n + 1) for i in layers]
    repeated = sorted({i for i in resolved if resolved.count(i) > 1})
    if not repeated:
        return None
    key = kind.layers_key or "the drafter's layer setting"
    return (f"warning: {kind.name} fuses target hidden state(s) {', '.join(map(str, repeated))} more than once (layers "
            f"{tuple(resolved)}): the {n}-layer target has too few layers for distinct low, mid and high features, "
            f"so the fused input repeats a layer and carries less of the target than the method intends; choose "
            f"distinct layers with {key}=[...] or train on a deeper target")


def command(script: str, overrides: Sequence[str], world_size: int = 1) -> str:
    """A launch command for ``script`` with hydra ``overrides`` (torchrun for several processes)."""
    launcher = ["python"] if world_size <= 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    return shlex.join([*launcher, script, *overrides])


def hydra_overrides() -> list[str] | None:
    """The command line's overrides of the running hydra job, None outside one (a config composed in code)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def resume_command(overrides: Sequence[str] | None, run_dir, world_size: int = 1) -> str:
    """The command that continues this run: its overrides without ``resume`` and ``trainer.stop_after``, with
    its run folder and ``resume=true``. Without known overrides (a config composed in code) the run folder
    stands for them; the other overrides must be repeated."""
    dropped = ("resume=", "trainer.stop_after=")
    kept = [o for o in (overrides or []) if not o.lstrip("+~").startswith(dropped)]
    if not any(o.lstrip("+").startswith("run_dir=") for o in kept):
        kept.append(f"run_dir={run_dir}")
    script = "scripts/train_heads.py"
    line = command(script, [*kept, "resume=true"], world_size)
    return line if overrides is not None else line.replace(script, f"{script} <the run's other overrides>", 1)


def compare_command(name: str, export_dir, target: str, workload: Sequence[str] = (),
                    trees: Sequence[dict] = ()) -> str:
    """scripts/compare_trees.py on the trained drafter alone (conf/compare.yaml: ``drafters`` picks entries of
    ``available``, each a conf/drafter/<name>.yaml whose ``source`` is the weights folder), on ``workload``
    (overrides, ``chat_workload``; none: the comparison's default, the shipped held-out code prompts) with ``trees``
    (tree specs, ``suggested_trees``; none: the comparison's default list)."""
    overrides = [f"drafters=[{name}]", f"available.{name}.source={hydra_value(str(export_dir))}"]
    if target != "reference:target":  # another target: the shipped assistant (reference:draft) cannot serve it
        overrides += [f"target={hydra_value(target)}", "assistant=null"]
    overrides += list(workload)
    if trees:
        overrides.append(f"trees={tree_list(trees)}")
    return command("scripts/compare_trees.py", overrides)


def hydra_value(text: str) -> str:
    """``text`` as a hydra override value: as it is when plain (a path, a name: letters, digits and ``_./@+-``,
    not read as a number, bool or null), else a quoted string (hydra's escape for a quote is a backslash)."""
    plain = re.fullmatch(r"[A-Za-z0-9_./@+-]+", text) and re.search(r"[A-Za-z/]", text) \
        and text.lower() not in ("true", "false", "null", "nan", "inf")
    return text if plain else "'" + text.replace("'", "\\'") + "'"


def tree_list(trees: Sequence[dict]) -> str:
    """Tree specs as a hydra list override value: [{kind:chain,depth:[2,4,6]},{kind:auto}]."""
    def value(v):
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)

    return "[" + ",".join("{" + ",".join(f"{k}:{value(v)}" for k, v in t.items()) + "}" for t in trees) + "]"


def chat_workload(chat, val_conversations: int, *, timed: int = 16, held_out: int = 24) -> tuple[list[str], str]:
    """The comparison's workload overrides for a chat run's held-out conversations (``data.chat`` ``chat``; the
    run held ``val_conversations`` out) → (overrides, a note for the reader). ``workload.chat_validation`` selects
    exactly the conversations the run's split put in validation (train/compare/workload.py); of them ``held_out``
    at most (a third) measure the drafter's accuracies, ``timed`` at most are timed. More held out than timed:
    acceptance differs from one conversation to the next, and a few held out predict τ poorly (docs/results.md,
    "Predictions on a user-built chat target")."""
    source = str(chat.source)
    if Path(source).is_file() and Path(source).suffix in (".jsonl", ".json"):
        overrides = ["workload=jsonl", f"workload.path={hydra_value(source)}"]
    else:  # parquet files, a folder, a glob: read through the datasets library, as training read them
        overrides = ["workload=dataset", f"workload.name={hydra_value(source)}",
                     f"workload.split={hydra_value(str(chat.get('split') or 'train'))}"]
    overrides.append(f"workload.chat_validation={chat.val_fraction}")
    if chat.get("system_prompt"):
        overrides.append(f"workload.system_prompt={hydra_value(str(chat.system_prompt))}")
    if chat.get("template"):
        overrides.append(f"workload.template={hydra_value(str(chat.template))}")
    held = min(held_out, val_conversations // 3)
    overrides += [f"workload.held_out={held}", "workload.per_category=null",
                  f"workload.prompts={max(1, min(timed, val_conversations - held))}"]
    note = (f"the {val_conversations} conversation(s) of {source} the run held out (data.chat.val_fraction="
            f"{chat.val_fraction}): {held} for accuracies, the rest timed")
    return overrides, note


def training_workload(data, info: dict) -> tuple[list[str], str]:
    """The comparison's workload for a run's training data ``data`` (the ``data`` config; ``info``: the run's
    summary, its ``data_*`` counts) → (overrides, what they time): a chat run's held-out conversations
    (``chat_workload``), the shipped held-out code prompts (stdlib files of the validation split) for the stdlib
    corpus, else the comparison's default with a note."""
    chat = data.get("chat")
    if chat is not None:
        n = int(info.get("data_val_conversations") or 0)
        if n and info.get("data_val_by_hash", True):
            return chat_workload(chat, n)
        return [], (f"the shipped held-out code prompts: none of {chat.source}'s conversations hashed into validation "
                    f"(data.chat.val_fraction={chat.val_fraction}), so none can be selected as held out; raise it")
    corpus = data.get("corpus") or {}
    # the shipped prompts come from the stdlib files that val_fraction 0.02 holds out; a larger fraction holds out more
    if corpus.get("source", "stdlib") == "stdlib" and float(corpus.get("val_fraction", 0.02)) >= 0.02:
        return ["workload=reference"], "the shipped held-out code prompts (stdlib files outside the training split)"
    return [], (f"the shipped held-out code prompts (no held-out workload is built for the corpus "
                f"{corpus.get('source')})")


def suggested_trees(accuracy, costs: dict | CostModel, *, max_nodes: int = 64) -> tuple[list[dict], str]:
    """The trees a comparison should try for a drafter with per-depth rank accuracies ``accuracy`` (acc[d][r])
    on this machine's cost model ``costs`` (a cost_curve.json record): chains around the best predicted chain
    (γ − 2, γ, γ + 2; γ + 2 also past the measured depths), accuracy trees around the best predicted one (n/2, n,
    2n nodes) and ``auto`` → (specs, a line naming the predicted bests). With no speculation predicted to pay, short
    chains and small trees."""
    model = costs if isinstance(costs, CostModel) else CostModel.from_record(costs)
    chain, _ = choose_tree(chains_only(accuracy), model, max_nodes=max_nodes)
    tree, _ = choose_tree(accuracy, model, max_nodes=max_nodes)
    gamma, nodes = chain.tree.depth if len(chain.tree) else 0, len(tree.tree)
    # γ + 2 may lie past the measured depths: the comparison measures it (its own accuracies reach deeper)
    chains = sorted({g for g in (gamma - 2, gamma, gamma + 2) if g >= 1}) if gamma else [1, 2, 3]
    sizes = sorted({n for n in (nodes // 2, nodes, 2 * nodes) if 2 <= n <= max_nodes}) if nodes >= 2 else [4, 8]
    specs = [{"kind": "chain", "depth": chains}, {"kind": "accuracy", "nodes": sizes}, {"kind": "auto"}]
    line = (f"predicted best: chain γ={gamma} (τ {chain.tau:.2f}, {chain.speedup:.2f}x), accuracy tree of {nodes} "
            f"nodes (τ {tree.tau:.2f}, {tree.speedup:.2f}x) on this machine's cost model")
    return specs, line


def export_lines(formats: dict[str, str | None], export_dir, target: str) -> list[str]:
    """The consumers ``export.formats`` accepts, with the export command for the first, and those it refuses."""
    ok = [to for to, reason in formats.items() if reason is None]
    lines = []
    if ok:
        cmd = shlex.join(["python", "scripts/export_drafter.py", str(export_dir), "--to", ok[0], "--out",
                          f"exports/{ok[0]}", "--target", target])
        lines.append(f"{', '.join(ok)}:  {cmd}")
    refused = [to for to, reason in formats.items() if reason is not None]
    reasons = {formats[to] for to in refused}
    if len(reasons) == 1 and not ok:  # one reason for every format (a draft model is a transformers folder already)
        lines.append(f"not {', '.join(refused)}: {reasons.pop()}")
    elif refused:
        lines.append(f"not {', '.join(refused)} (reasons in summary.json: export_formats)")
    return lines


def top1_lines(kind: DrafterKind, val_metrics: dict, summary: dict, probe_acc: list[list[float]] | None) -> list[str]:
    """Depth-1 top-1 agreement under each definition the run logged, named so that they are not confused: the two
    rank accuracies measured as decoding drafts (heads/training/accuracy.py: every position, EAGLE drafting over its own
    outputs), during training on the target's own continuations (eval/acc_depth_k, train/training/expected_tau.py)
    and at export on the run's held-out windows (head_accuracy.json), and the in-training top-1 that ``kind``'s
    loop logs as a validation metric (``kind.top1_metric``, counting ``kind.top1_meaning``)."""
    lines = []
    if probe_acc:
        lines.append(f"{probe_acc[0][0]:.3f} on the target's own continuations (eval/acc_depth_1; what τ follows)")
    if "depth1_top1" in summary:
        lines.append(f"{summary['depth1_top1']:.3f} on the run's held-out windows (head_accuracy.json, depth1_top1: "
                     "every position, drafted as decoding drafts)")
    key = kind.top1_metric
    if key is not None and key in val_metrics:
        lines.append(f"{val_metrics[key]:.3f} in training (val/{key}: {kind.top1_meaning})")
    return lines


def text(rows: list[tuple[str, list[str]]], title: str) -> str:
    """A titled block of labelled rows (a label, then continuation lines indented under its first)."""
    width = max(len(label) for label, _ in rows)
    out = [title]
    for label, lines in rows:
        for i, line in enumerate(lines):
            out.append(f"  {label if i == 0 else '':<{width}}  {line}")
    return "\n".join(out)
