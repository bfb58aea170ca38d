"""Ship a trained drafter for the reference target: copy ``runs/heads/<name>/final`` into
treespec/models/<name> with its training summary, and (re)measure its per-depth top-k accuracies against
the target's greedy tokens on held-out text (``head_accuracy.json``, the input of accuracy-grown trees).

    python scripts/ship_drafter.py medusa              # after scripts/train_heads.py drafter=medusa
    python scripts/ship_drafter.py eagle               # after scripts/train_heads.py experiment=reference_eagle
    python scripts/ship_drafter.py hydra               # after scripts/train_heads.py experiment=reference_hydra
    python scripts/ship_drafter.py medusa --skip-copy  # re-measure the shipped drafter only
    python scripts/ship_drafter.py draft --skip-copy   # the reference draft model's accuracies (auto trees)
    python scripts/ship_drafter.py eagle3 --run-dir runs/eagle3_ttt7   # a run elsewhere (its run_dir=...)
    python scripts/ship_drafter.py medusa2    # Medusa-2: the heads and their fine-tuned target (stored in bf16)
    python scripts/ship_drafter.py eagle3 --target smollm2 --run-dir runs/heads/eagle3   # → models/smollm2/eagle3
    python scripts/ship_drafter.py eagle3 --target smollm2 --skip-copy --cost-curve      # re-time it on this machine
    python scripts/ship_drafter.py draft --target smollm2 --run-dir runs/heads/draft   # a distilled draft model
    python scripts/ship_drafter.py dflash --run-dir runs/dflash_miss --as dflash_fallback --bf16   # a second block

For another target than the code reference (``--target smollm2``), the drafter goes to treespec/models/<target>/
<name>, and keeps the head_accuracy.json its export measured on the run's held-out conversations (the stdlib
windows are not its workload). ``--cost-curve`` re-measures cost_curve.json (the target's pass per tree size, the
drafter's own drafting cost and the engine's cost per step) on this machine, as training does at its end: do it on an
idle machine. Elsewhere ``heads.load_profile(folder, target)`` measures its own once (a curve is per machine).
``--as <folder>`` ships a second drafter of one kind under its own name (``reference:<folder>``), e.g. a block
trained for one use (prompt lookup's fallback) beside the kind's own.

``<name>`` is a drafter kind with weights or one of their training recipes (``medusa2``: Medusa heads trained jointly
with the target). A run that fine-tuned its target (Medusa-2) ships it beside the drafter (``<name>/target``, stored
in bf16); the drafter is measured against it, the target it pairs with. The drafter is measured as the kind its
folder holds.
"""

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from treespec import reference
from treespec.heads import registry
from treespec.heads.checkpoints.local_profile import about, files_fingerprint, measure_cost_model
from treespec.heads.training.accuracy import write_accuracy
from treespec.heads.training.objective import TARGET_FOLDER
from treespec.planning.autotree import COST_CURVE_FILE, write_cost_record
from treespec.train.training.data import held_out_windows

ROOT = Path(__file__).resolve().parents[1]
WINDOWS, WINDOW_LEN = 32, 256  # the training runs' validation windows (conf/trainer/heads.yaml)


def main() -> None:
    # drafters trained by train_heads.py (or, the draft model, train_lm.py), by kind or by training recipe
    trained = [name for kind in registry.KINDS if kind.has_weights for name in (kind.name, *kind.recipes)]
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=trained)
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--run-dir", type=Path, default=None, help="the training run (default: runs/heads/<name>)")
    parser.add_argument("--target", default="target", help="the target it drafts for: target (the code reference) "
                        "or a GGUF reference target (smollm2)")
    parser.add_argument("--cost-curve", action="store_true", help="(re)measure cost_curve.json on this machine")
    parser.add_argument("--as", dest="folder", default=None, help="the shipped folder's name (default: the name): "
                        "a second drafter of one kind, reference:<folder>")
    parser.add_argument("--bf16", action="store_true", help="store the float weights in bfloat16 (half the bytes; "
                        "loading upcasts them to the target's dtype)")
    args = parser.parse_args()
    reference_target = args.target == "target"
    if reference_target and args.name in reference.NAMES and not args.skip_copy:
        parser.error(f"the code reference's {args.name} model is a reference model: scripts/ship_reference.py writes "
                     "it (--skip-copy measures its head_accuracy.json)")
    folder = args.folder or args.name
    if args.folder is not None and (folder in (*reference.NAMES, *reference.GGUF_TARGETS) or "/" in folder
                                    or folder.startswith(".")):
        parser.error(f"--as {folder!r}: a reference model's or target's folder, or not a plain name")
    out = reference.MODELS_DIR / (folder if reference_target else f"{args.target}/{folder}")
    if not args.skip_copy:
        run_dir = args.run_dir or ROOT / "runs" / "heads" / args.name
        if not (run_dir / "final").is_dir():
            raise FileNotFoundError(f"{run_dir / 'final'} does not exist: train it first (scripts/train_heads.py)")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(run_dir / "final", out)
        shutil.copy(run_dir / "summary.json", out / "training_summary.json")

    if args.bf16 and not args.skip_copy:
        for path in out.glob("*.safetensors"):
            weights = load_file(path)
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()}, path)
    joint = (out / TARGET_FOLDER).is_dir()  # the run fine-tuned its target (Medusa-2): the drafter pairs with it
    if joint and not args.skip_copy:  # stored in bf16 as the reference target is (loaders upcast)
        tuned, tuned_tokenizer = reference.load_model(out / TARGET_FOLDER)
        tuned.to(torch.bfloat16).save_pretrained(out / TARGET_FOLDER)
        tuned_tokenizer.save_pretrained(out / TARGET_FOLDER)
    target, tokenizer = reference.load_model(out / TARGET_FOLDER) if joint else reference.load(args.target)
    if args.cost_curve:
        costs = measure_cost_model(target, registry.load(out, target))
        write_cost_record(out / COST_CURVE_FILE, costs.record(**about(target, files_fingerprint(out))))
        print(f"{out}/cost_curve.json: drafting {costs.draft_cost_fixed * 1e3:.2f} ms per step + "
              f"{costs.draft_cost_per_depth * 1e3:.2f} ms per depth + {costs.draft_cost_per_node * 1e3:.3f} ms per "
              f"node; engine {costs.engine}")
    if not reference_target:
        return
    windows = held_out_windows(tokenizer, WINDOW_LEN, WINDOWS, ROOT / ".cache" / "data")
    kind = registry.detect(out).kind  # what the folder holds (a Medusa-2 run's: Medusa heads)
    module = registry.load_module(kind, target, out)
    acc = registry.get(kind).rank_accuracy(target, module, windows)
    write_accuracy(out, acc)
    print(f"{folder}: top-1 per depth " + " ".join(f"{row[0]:.3f}" for row in acc))
    print("         top-5 per depth " + " ".join(f"{sum(row[:5]):.3f}" for row in acc))


if __name__ == "__main__":
    main()
