"""The comparison across batch sizes: how tokens/s, τ and the best tree change when B prompts decode at once,
and where speculation stops paying (``batch_sizes=[1,4,16]`` in conf/compare.yaml; docs/batch.md).

For every batch size B, ``batches`` batches of B held-out prompts, or more where that many do not hold every
prompt once (batch i: prompts i·B, i·B + 1, ..., cycling through the prompt set), are decoded, interleaved batch by
batch after a warm-up (bench.measure, a batch standing for a prompt), by treespec's batched vanilla decoding,
transformers' batched greedy ``generate`` on the same left-padded batch, and every drafter × tree. Per
configuration and B: tokens/s over every row's tokens, the speedup against batched vanilla at the same B and
against transformers' batched generate (each the median over batches of the per-batch ratio; intervals over
batches in train/compare/batch_report.py), and τ over every row's verification passes.

Costs at each B: the target's cost curve over B × N tokens (N tree tokens per row, ``cost_sizes``), the engine's
cost per step over ragged rows (treespec/planning/engine_cost.py: prompts of different lengths, rows accepting
different lengths), the drafter's drafting at B rows and the prefill of B prompts. ``tree=auto`` is chosen anew at
each B from them: the accuracy-grown (or dry-run measured) tree with the best predicted tokens/s, or the empty tree
(vanilla decoding) where none is predicted to pay: from that B on, speculation stops paying on this device. A
drafter's choices at every size up to B, as one TreesByBatch (treespec/batch_trees.py), are decoded too ("auto per
B"): generate() follows the table as rows end. Every configuration's speedup is predicted for whole generations
(treespec/planning/batch_generation.py: rows ending at different steps, the batch thinning out, the prefill),
beside the per-step prediction. The per-B curves are the target's alone (the B = 1 grid also times them after each
drafter's drafting, which would multiply this part's cost by the drafters).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

from treespec.batch_trees import TreesByBatch
from treespec.compat import NO_EOS
from treespec.inputs import left_padded
from treespec.planning.autotree import cost_at, measure_cost_curve, measure_prefill_curve, predict, tau_source
from treespec.planning.batch_generation import BatchCosts, predict_batch_generation
from treespec.planning.batch_table import COST_SIZES
from treespec.planning.bench import Config, measure, own_copy
from treespec.planning.drafting_cost import NO_DRAFTING, measure_drafting_cost
from treespec.planning.engine_cost import measure_engine_cost
from treespec.result import GenerationResult, RowResult
from treespec.tree import Tree

TRANSFORMERS = "transformers batched"  # the peer's config name
AUTO_PER_BATCH = "auto per B"  # a drafter's "auto" choices at every size measured so far, as one TreesByBatch


def prompt_batches(prompts: list[torch.Tensor], size: int, count: int) -> list[list[torch.Tensor]]:
    """``count`` batches of ``size`` prompts ([1, P] tensors → 1-D rows): batch i holds prompts i·size ..
    i·size + size − 1, cycling through the set (a set smaller than a batch repeats prompts in it)."""
    return [[prompts[(i * size + j) % len(prompts)][0] for j in range(size)] for i in range(count)]


def batched_peer(target, pad_token_id: int = 0, eos_token_id=None):
    """A bench.Config runner for transformers' batched ``generate`` on the same left-padded batch. With
    ``eos_token_id`` each row stops where treespec's does (its end tokens; a row's tokens counted up to its
    first); without, every row generates the whole budget."""
    ends = set(eos_token_id or ())
    stop = {"eos_token_id": list(ends)} if ends else {"eos_token_id": NO_EOS}

    def generated(row: list[int]) -> int:
        return next((i + 1 for i, token in enumerate(row) if token in ends), len(row))

    def run(batch, max_new_tokens, temperature, top_p, generator):
        ids, mask = left_padded(batch, pad_token_id)
        ids, mask = ids.to(target.device), mask.to(target.device)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
            {"do_sample": False}
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        t0 = time.perf_counter()
        budget = {} if ends else {"min_new_tokens": max_new_tokens}
        seq = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                              **budget, **stop, **sampling)
        wall = time.perf_counter() - t0
        rows = [RowResult(len(row), generated(new)) for row, new in zip(batch, seq[:, ids.shape[1]:].tolist(),
                                                                         strict=True)]
        return GenerationResult(sequences=seq, prompt_length=ids.shape[1], wall_time=wall, rows=rows)

    return run


def _finite(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def run_batch_sizes(target, drafters: list, specs: list[tuple[str, dict]], prompts: list[torch.Tensor], *,
                    resolve: Callable, batch_sizes, batches: int, max_new_tokens: int, temperature: float = 0.0,
                    top_p: float = 1.0, eos_token_id=None, cost_sizes=COST_SIZES, past_len: int = 256,
                    pad_token_id: int = 0, seed: int = 0, log=print) -> dict:
    """Measure every drafter × tree at every batch size (module docstring) → results.json's "batch" section:
    {batch_sizes, batches, cost_curves {B: {N: s}}, engines {B: EngineCost.record()}, prefill_curves {B: {P: s}},
    draft_costs {drafter: {B: [fixed, per depth, per node]}}, records}.

    ``drafters``: the comparison's DrafterSpecs (train/compare/job.py); ``specs``: (label, tree spec) pairs;
    ``resolve(spec, drafter_spec, costs)`` → (tree, None) or (None, why not), as the comparison resolves trees
    (``tree=auto`` from ``costs``, the CostModel at B rows). Sizes are measured in increasing order, so a prediction at
    B has the cost models of every size up to B for the rows that are left as others finish."""
    out = {"batch_sizes": list(batch_sizes), "batches": batches, "max_new_tokens": max_new_tokens,
           "cost_curves": {}, "engines": {}, "prefill_curves": {}, "draft_costs": {}, "batches_by_size": {},
           "records": [], "skipped": []}
    by_drafter: dict[str, dict[int, object]] = {d.name: {} for d in drafters}  # {drafter: {B: CostModel}}
    autos: dict[str, dict[int, object]] = {d.name: {} for d in drafters}  # {drafter: {B: its tree=auto}}
    for size in sorted(batch_sizes):
        # every prompt at least once at every size, so τ is measured over the whole workload the prediction is for
        count = max(batches, math.ceil(len(prompts) / size))
        out["batches_by_size"][str(size)] = count
        sets = prompt_batches(prompts, size, count)
        widths = [max(len(p) for p in rows) for rows in sets]  # each batch's prompts, left-padded to its longest
        curve, engine, prefill = target_costs(target, size, cost_sizes, past_len, widths, out, log)
        configs, meta = [], {"vanilla": {"drafter": "none", "tree": "vanilla", "nodes": 0, "predicted_speedup": 1.0}}
        for d in drafters:
            source = d.tau_source()
            # drafting at B rows, in the loop, for a drafter whose configurations are predicted
            cost = measure_drafting_cost(target, d.drafter, prompts[:2], batch=size) \
                if source is not None else NO_DRAFTING
            at_size = dataclasses.replace(d, drafting_cost=cost)
            out["draft_costs"].setdefault(d.name, {})[str(size)] = list(at_size.drafting_seconds(cost_at(curve, 1)))
            costs = at_size.cost_model(curve, engine=engine)  # a vanilla step: the curve's T(1) and the engine's
            by_drafter[d.name][size] = costs
            predicted = whole_generations(source, BatchCosts(dict(by_drafter[d.name])), size, widths, prefill,
                                          max_new_tokens, seed)
            for label, spec in specs:
                tree, reason = resolve(spec, at_size, costs)
                name = f"{d.name} | {label}"
                if tree is None:
                    out["skipped"].append({"batch_size": size, "config": name, "reason": reason})
                    continue
                if spec.get("kind") == "auto":
                    autos[d.name][size] = tree
                configs.append(Config(name, own_copy(d.drafter), tree))
                step = predict(tree, source, costs) if source is not None and isinstance(tree, Tree) \
                    and tau_source(source).predicts(tree) else None
                meta[name] = {"drafter": d.name, "tree": label, "nodes": len(tree),
                              "predicted_speedup": predicted(tree) if step is not None else None,
                              "predicted_step_speedup": step.speedup if step else None}
            if len(autos[d.name]) > 1:  # the table of its "auto" choices at every size so far, followed as rows end
                table = TreesByBatch(autos[d.name])
                name = f"{d.name} | {AUTO_PER_BATCH}"
                configs.append(Config(name, own_copy(d.drafter), table))
                meta[name] = {"drafter": d.name, "tree": AUTO_PER_BATCH, "nodes": len(table.at(size)),
                              "table": {str(b): len(t) for b, t in table.trees.items()},
                              "predicted_speedup": predicted(table.at) if source is not None else None,
                              "predicted_step_speedup": None}
        configs.append(Config(TRANSFORMERS, run=batched_peer(target, pad_token_id, eos_token_id)))
        meta[TRANSFORMERS] = {"drafter": "transformers", "tree": "vanilla", "nodes": 0, "predicted_speedup": None}
        rows = measure(target, configs, sets, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, seed=seed,
                       progress=lambda name, i, size=size, n=count: log(f"  [B={size}, batch {i + 1}/{n}] {name}"))
        out["records"] += size_records(size, rows, meta)
    return out


def size_records(size: int, rows: list, meta: dict) -> list[dict]:
    """One batch size's measured rows (bench.measure's) as records: each with its ``meta`` (tree, prediction), τ,
    tokens/s and the speedups against batched vanilla and transformers' batched generate, per batch and overall."""
    peer = next(r for r in rows if r.name == TRANSFORMERS).prompt_tokens_per_s
    records = []
    for row in rows:
        vs_peer = [a / b for a, b in zip(row.prompt_tokens_per_s, peer, strict=True)]
        records.append({
            "batch_size": size, "config": row.name, **meta[row.name], "tau": _finite(row.tau),
            "tokens_per_s": row.tokens_per_s, "speedup": row.speedup,
            "speedup_vs_transformers": statistics.median(vs_peer),
            "runs": {"tokens_per_s": row.prompt_tokens_per_s, "speedup": row.prompt_speedups,
                     "speedup_vs_transformers": vs_peer, "accept_lengths": row.prompt_accept_lengths}})
    return records


def target_costs(target, size: int, cost_sizes, past_len: int, widths: list[int], out: dict, log=print) -> tuple:
    """(the cost curve over ``size`` × N tokens, the engine's cost per step over ``size`` ragged rows, the prefill of
    ``size`` prompts at the batches' padded ``widths``), each also kept in ``out`` (results.json's batch section)."""
    log(f"batch size {size}: cost curve over {size} × N tree tokens, N in {list(cost_sizes)}")
    curve = measure_cost_curve(target, cost_sizes, past_len=past_len, batch=size, repeats=5)
    # rows of different prompts accepting different lengths: the ragged overhead is part of a step's cost
    engine = measure_engine_cost(target, past_len=past_len, batch=size, steps=8, repeats=2, ragged=True)
    prefill = measure_prefill_curve(target, {min(widths), int(statistics.median(widths)), max(widths)}, batch=size)
    out["cost_curves"][str(size)], out["engines"][str(size)] = curve, engine.record()
    out["prefill_curves"][str(size)] = prefill
    return curve, engine, prefill


def whole_generations(source, costs: BatchCosts, size: int, widths: list[int], prefill: dict[int, float],
                      max_new_tokens: int, seed: int = 0) -> Callable:
    """trees → the predicted speedup of this batch size's batches, whole generations (the median over the batches,
    as the measured speedup is the median of per-batch ratios): treespec/planning/batch_generation.py, each batch
    with its own prefill (its prompts padded to its longest)."""
    def predicted(trees) -> float:
        return statistics.median(
            predict_batch_generation(trees, source, costs, [max_new_tokens] * size,
                                     prefill_seconds=cost_at(prefill, width), seed=seed).speedup
            for width in widths)
    return predicted
