"""What a trained drafter's folder holds beside its weights for ``tree={"kind": "auto"}`` (heads.load_profile), written
at the end of training (train/training/drafter_job.py):

- cost_curve.json: this machine's cost model, measured as ``load_profile`` and the comparison measure it
  (heads/checkpoints/local_profile.py: the target's curve alone and after the drafter's calls, the drafting costs, the
  engine's cost per step), with the machine, the target and the weights it was measured for, so that
  ``load_profile(folder, target)`` on this machine uses it as it is and measures afresh anywhere else;
- chain_tau.json: each rule's τ of sampled chains (treespec/planning/chain_tau.py) at temperature 1 (and at the
  evaluation's temperature when it samples), on the target's own sampled continuations of the held-out windows, for a
  drafter that can sample its candidates: what "auto" chooses γ by for ``candidates="sample"``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from treespec.heads import registry
from treespec.heads.checkpoints.local_profile import about, files_fingerprint, measure_cost_model
from treespec.planning.autotree import COST_CURVE_FILE, DEFAULT_SIZES, write_cost_record
from treespec.planning.chain_tau import DEPTH, measure_chain_tau, save_chain_tau
from treespec.sampling import Sampling
from treespec.train.training.data import own_continuations

LEAD = 16        # prompt tokens kept before each continuation (as the comparison measures chain τ)
WINDOWS = 8      # held-out windows continued for chain τ (default)
NEW_TOKENS = 64  # tokens the target writes after each


def chain_samplings(eval_temperature: float) -> list[Sampling]:
    """Temperature 1, and the evaluation's temperature when it samples (top-p 1)."""
    temperatures = [1.0] + ([float(eval_temperature)] if eval_temperature and float(eval_temperature) != 1.0 else [])
    return [Sampling(t) for t in temperatures]


def save_profile(folder, target, kind_name: str, module, drafter, windows: torch.Tensor, *,
                 eval_temperature: float = 0.0, seed: int = 0, cost_sizes=DEFAULT_SIZES, engine_rounds: int = 3,
                 chain_windows: int = WINDOWS, log=print) -> dict:
    """Write cost_curve.json and (for a kind that samples candidates) chain_tau.json into ``folder`` (module
    docstring); returns the cost record. ``drafter``: the trained module as its top-k Drafter; ``windows`` [n, S]:
    held-out token windows, the first ``chain_windows`` continued for chain τ; ``cost_sizes`` and ``engine_rounds``
    as ``heads.local_profile.measure_cost_model`` takes them (conf/train_heads.yaml's eval.profile)."""
    folder = Path(folder)
    calibration = [windows[i : i + 1] for i in range(min(2, len(windows)))] if windows is not None else None
    costs = measure_cost_model(target, drafter, sizes=cost_sizes, engine_rounds=engine_rounds,
                               prompts=calibration or None)  # drafting timed decoding on from held-out text
    record = costs.record(**about(target, files_fingerprint(folder)))
    write_cost_record(folder / COST_CURVE_FILE, record)
    kind = registry.get(kind_name)
    if "sample" not in kind.candidate_modes or windows is None or windows.shape[1] < 2:
        return record
    sampler = registry.make(kind_name, module, "sample")
    depth = min(DEPTH, kind.max_depth(module) or DEPTH)
    context = min(64, windows.shape[1] - 1)
    measured = []
    for sampling in chain_samplings(eval_temperature):
        text = own_continuations(target, windows[:chain_windows].to(target.device), context=context,
                                 new_tokens=NEW_TOKENS, lead=min(LEAD, context), temperature=sampling.temperature,
                                 top_p=sampling.top_p, seed=seed)
        measured.append(measure_chain_tau(target, sampler, text, depth=depth, sampling=sampling,
                                          lead=min(LEAD, context), generator=torch.Generator().manual_seed(seed)))
        log(f"chain τ of sampled candidates at T={sampling.temperature}, γ = 0..{depth}: " + "; ".join(
            f"{rule} " + " ".join(f"{t:.2f}" for t in measured[-1].tau[rule]) for rule in measured[-1].tau))
    save_chain_tau(folder, measured)
    return record
