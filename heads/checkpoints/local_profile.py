"""A drafter's profile on this machine: what ``heads.load_profile(source, target)`` measures once on first use
when the drafter's folder holds none measured here, and caches (treespec/planning/profile_cache.py).

- The cost model (treespec.planning.autotree.CostModel), measured as the comparison measures it: the target's cost
  curve alone (vanilla's pass), again with every forward right after one of the drafter's drafting calls (its
  weights push the target's out of the caches), the drafting costs measured in the loop
  (treespec/planning/drafting_cost.py), and the engine's cost per step (treespec/planning/engine_cost.py). A folder's
  own cost_curve.json is used instead when it was measured on this machine for this target and these weights (training
  writes one: train/training/drafter_job.py); the shipped drafters' were not, so theirs are measured here.
- The chain τ of sampled candidates at a sampling the folder's chain_tau.json lacks, on the target's own
  continuations of the first prompt decoded at it (treespec.planning.chain_tau.measure_on_prompt).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path

from treespec.heads.kind import drafting_step
from treespec.planning import chain_tau
from treespec.planning.autotree import DEFAULT_SIZES, CostModel, cost_at, measure_cost_curve, read_cost_curve
from treespec.planning.cost_records import check_cost_record
from treespec.planning.drafting_cost import measure_drafting_cost, own_text_prompts
from treespec.planning.engine_cost import measure_engine_cost
from treespec.planning.profile_cache import (
    cached,
    cost_key,
    entry,
    fingerprint,
    kernels,
    key,
    machine,
    measured_here,
)
from treespec.timing import busy_cores, usable_cores

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: how a cost record was measured; a folder's record of another format is measured again. 2: drafting timed in the
#: decoding loop (treespec/planning/drafting_cost.py), with a per-node term
COST_FORMAT = 2
PAST_LEN = 256  # cached tokens the cost curve is timed after (the comparison times at its prompts' context)
BUSY = 0.5  # cores busy with other work from which a measurement is flagged


def files_fingerprint(folder) -> str:
    """sha1 of a drafter folder's weight files (names and bytes): what its measurements are keyed by, whoever
    loads it."""
    digest = hashlib.sha1()
    for path in sorted(p for p in Path(folder).rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        digest.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def about(target, drafter_key: str, past_len: int = PAST_LEN) -> dict:
    """What a cost record says it was measured for: the device and machine, the target's kernels, the target, the
    drafter's weights."""
    return {"device": str(target.device), "machine": machine(target.device), "kernels": kernels(target),
            "target": fingerprint(target), "drafter": drafter_key, "past_len": past_len, "cost_format": COST_FORMAT}


def measure_cost_model(target, drafter, *, past_len: int = PAST_LEN, sizes=DEFAULT_SIZES,
                       engine_rounds: int = 3, prompts=None) -> CostModel:
    """``drafter``'s cost model on ``target`` on this device (module docstring): the curves at ``sizes`` tree tokens,
    the engine's cost in ``engine_rounds`` rounds, the drafting decoding ``prompts`` ([1, P] each; None: text the
    target writes itself, treespec/planning/drafting_cost.py)."""
    curve = measure_cost_curve(target, tuple(sizes), past_len=past_len)
    step = drafting_step(drafter)
    after = measure_cost_curve(target, tuple(sizes), past_len=past_len, before=step) if step is not None else curve
    drafter.reset()
    prompts = own_text_prompts(target) if prompts is None else prompts
    fixed, per_depth, per_node = measure_drafting_cost(target, drafter, prompts).on(cost_at(curve, 1))
    engine = measure_engine_cost(target, past_len=past_len, repeats=engine_rounds)
    return CostModel(after, fixed, per_depth, cost_at(curve, 1), engine, per_node)


def cost_record(target, drafter, folder, log=print) -> dict:
    """This machine's cost record of ``drafter`` (loaded from ``folder``) on ``target``: the folder's when it was
    measured here for these models, else the cache's, else measured now and cached."""
    drafter_key = files_fingerprint(folder)
    saved = read_cost_curve(folder)
    if measured_here(saved, target) and saved.get("drafter") == drafter_key and \
            saved.get("cost_format") == COST_FORMAT:  # an older one was timed otherwise: measured again
        return saved
    name = cost_key(target, drafter_key)
    where = f"{entry('cost_model', name)} (cached: delete it to measure again)"

    def measure() -> dict:  # checked before it is cached, and when it is read back
        busy = other_work(target, entry("cost_model", name), log)
        return check_cost_record(measure_cost_model(target, drafter).record(**about(target, drafter_key),
                                                                            busy_cores=busy), where,
                                 measured=True)

    return check_cost_record(cached("cost_model", name, measure, log), where)


def other_work(target, where: Path, log=print, cores: int | None = None) -> float | None:
    """The cores other work keeps busy right before a cost model is measured (``timing.busy_cores``; None off the
    CPU or without /proc/stat), kept in the record. A model measured on a busy machine is cached all the same, and
    its "auto" may then choose no speculation where an idle machine gains (docs/usage.md): so say so, and where
    the entry lives."""
    if target.device.type != "cpu":
        return None
    cores = cores or usable_cores()
    busy = busy_cores(cores)
    if busy is not None and busy >= BUSY:
        log(f"warning: {busy:.1f} of {cores} cores were busy with other work as this cost model was measured; it is "
            f"cached as measured: delete {where} to measure it again on an idle machine")
    return busy


def chain_tau_measurer(target, folder, log=print) -> Callable:
    """``DrafterProfile.measure_chain_tau`` for the drafter in ``folder`` on ``target``: a chain τ at a new
    sampling, measured on the first prompt decoded at it and cached per target, drafter and sampling."""
    drafter_key = files_fingerprint(folder)

    def measure(drafter, sampling, prompt):
        name = key(target=fingerprint(target), drafter=drafter_key, sampling=dataclasses.asdict(sampling),
                   depth=chain_tau.DEPTH)
        return chain_tau.from_record(cached(
            "chain_tau", name, lambda: chain_tau.record(chain_tau.measure_on_prompt(target, drafter, prompt, sampling),
                                                        target=fingerprint(target), drafter=drafter_key), log))

    return measure
