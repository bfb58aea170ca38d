"""What a drafter run tells the researcher reading it (train/training/drafter_job.py): warnings at the start, how to
resume when it stops early, and a short summary at the end: where the trained drafter went, expected and
measured τ, the three top-1 agreements it logged and what each one counts, the formats it exports to, and the
command that compares trees for it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

# What each drafter's in-training top-1 (the validation metric the loop logs as val/<key>) counts, beside the
# two rank accuracies measured as decoding drafts (heads/accuracy.py: every position, EAGLE drafting over its own
# outputs): at export on the run's held-out windows (head_accuracy.json) and during training on the target's
# own continuations (eval/acc_depth_k, train/training/expected_tau.py).
IN_TRAINING_TOP1 = {
    "eagle": ("top1_0", "step 0 fed the target's features, teacher forced on the validation windows"),
    "eagle3": ("eagle3_top1_0", "step 0, teacher forced on the validation windows, only positions whose target "
                                "token is in the draft vocabulary, against the target's argmax over that vocabulary"),
    "medusa": ("depth1_top1", "head 1 on the target's hidden states of the validation windows"),
    "hydra": ("depth1_top1", "head 1 on the target's hidden states of the validation windows, its path the window's "
                             "next token"),
    "draft": ("top1", "the draft model's argmax against the target's, teacher forced on the validation data's scored "
                      "positions"),
}
LAYER_KEYS = {"eagle": "drafter.feature_layers", "eagle3": "drafter.aux_layers"}  # where a run sets the fused layers


def duplicate_layers_warning(name: str, layers: Sequence[int], num_hidden_layers: int) -> str | None:
    """A warning when the drafter fuses one target hidden state more than once (EAGLE-3's default low/mid/high
    aux layers on a target of fewer than 4 layers: (1, 1, 1) on 2 layers), else None. ``layers`` index
    ``hidden_states`` (negative ones from the end)."""
    n = int(num_hidden_layers)
    resolved = [int(i) % (n + 1) for i in layers]
    repeated = sorted({i for i in resolved if resolved.count(i) > 1})
    if not repeated:
        return None
    key = LAYER_KEYS.get(name, "the drafter's layer setting")
    return (f"warning: {name} fuses target hidden state(s) {', '.join(map(str, repeated))} more than once (layers "
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


def compare_command(name: str, export_dir, target: str) -> str:
    """scripts/compare_trees.py on the trained drafter alone (conf/compare.yaml: ``drafters`` picks entries of
    ``available``, each a conf/drafter/<name>.yaml whose ``source`` is the weights folder)."""
    overrides = [f"drafters=[{name}]", f"available.{name}.source={export_dir}"]
    if target != "reference:target":  # another target: the shipped assistant (reference:draft) cannot serve it
        overrides += [f"target={target}", "assistant=null"]
    return command("scripts/compare_trees.py", overrides)


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


def top1_lines(name: str, val_metrics: dict, summary: dict, probe_acc: list[list[float]] | None) -> list[str]:
    """Depth-1 top-1 agreement under each definition the run logged, named so that they are not confused."""
    lines = []
    if probe_acc:
        lines.append(f"{probe_acc[0][0]:.3f} on the target's own continuations (eval/acc_depth_1; what τ follows)")
    if "depth1_top1" in summary:
        lines.append(f"{summary['depth1_top1']:.3f} on the run's held-out windows (head_accuracy.json, depth1_top1: "
                     "every position, drafted as decoding drafts)")
    key, meaning = IN_TRAINING_TOP1.get(name, (None, None))
    if key in val_metrics:
        lines.append(f"{val_metrics[key]:.3f} in training (val/{key}: {meaning})")
    return lines


def text(rows: list[tuple[str, list[str]]], title: str) -> str:
    """A titled block of labelled rows (a label, then continuation lines indented under its first)."""
    width = max(len(label) for label, _ in rows)
    out = [title]
    for label, lines in rows:
        for i, line in enumerate(lines):
            out.append(f"  {label if i == 0 else '':<{width}}  {line}")
    return "\n".join(out)
