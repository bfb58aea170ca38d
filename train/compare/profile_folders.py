"""Each drafter's profile as the comparison measured it, kept in the run folder (``profiles/<drafter>/``), so that
``generate(..., tree={"kind": "auto"}, profile=treespec.heads.load_profile(folder))`` chooses the tree this run's
``auto`` chose, from the same numbers: the cost model the run predicted and chose with (cost_curve.json: the
target's curve after the drafter's calls at the prompts' context, the drafting costs, the engine's cost per step),
the accuracies it measured on the workload's held-out part (head_accuracy.json), its chain τ of sampled
candidates (chain_tau.json) and a model-free drafter's τ per tree from its dry run (measured_trees.json), whichever
it has.
"""

from __future__ import annotations

import re
from pathlib import Path

from treespec.heads.training.accuracy import write_accuracy
from treespec.planning.autotree import COST_CURVE_FILE, write_cost_record
from treespec.planning.chain_tau import save_chain_tau
from treespec.planning.measured_tau import save_measured_trees

FOLDER = "profiles"


def profile_folder(drafter: str) -> str:
    """Where a drafter's profile is kept in the run folder: profiles/<drafter>."""
    return f"{FOLDER}/" + re.sub(r"[^A-Za-z0-9._=-]+", "_", drafter).strip("_")


def write_profiles(out_dir, drafters, cost_models: dict | None, **about) -> dict[str, str]:
    """profiles/<name>/ for each DrafterSpec (its cost model from ``cost_models``, the setup's records) → {drafter:
    its folder, relative to ``out_dir``}. A setup without cost models (a journal from before them) writes none."""
    written = {}
    for d in drafters:
        record = (cost_models or {}).get(d.name)
        if record is None:
            continue
        folder = Path(out_dir) / profile_folder(d.name)
        write_cost_record(folder / COST_CURVE_FILE, {**record, **about})
        if d.accuracy is not None:
            write_accuracy(folder, d.accuracy)
        if d.chain_tau is not None:
            save_chain_tau(folder, [d.chain_tau])
        if d.measured:
            save_measured_trees(folder, d.measured)
        written[d.name] = profile_folder(d.name)
    return written
