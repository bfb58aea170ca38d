"""The comparison's measurement: every drafter × tree, and the peers, on one target and one set of prompts.

For every drafter × tree: τ, acceptance-length histogram, target passes, tokens/s and speedup over vanilla
decoding measured in the same process (bench.measure: interleaved, warmed up, medians), beside the analytic
prediction from the drafter's measured per-depth top-k accuracies and the target's measured cost curve
(autotree), taken at the prompts' median context length, prefill and generation length included
(``autotree.predict_generation``). Peers run on the same prompts: transformers' generate() (greedy or
sampling), assisted generation with ``assistant``, and ``prompt_lookup_num_tokens``, interleaved with each
drafter's best configuration. Every prompt run's values are kept (results.json) with each prompt's category,
so the report (train/compare/report.py, train/compare/categories.py) can be rendered again later without measuring, and
every configuration's tree is saved (``trees/``) so the best one can be used elsewhere. train/compare/job.py drives it
from the config.

Prompts may have different generation budgets (``max_new_tokens`` per prompt, e.g. per category): prompts
sharing a budget are measured together, one bench.measure call per budget, and their rows merged.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch

from treespec.planning.bench import Config, Row, own_copy, step_parts
from treespec.planning.tree_spec import build_tree, save_tree
from treespec.train.compare.auto_across import across_specs, check_across, check_distinct, per_drafter
from treespec.train.compare.batch_compare import run_batch_sizes
from treespec.train.compare.configurations import DrafterSpec, expand_specs, resolve_tree, spec_label, tree_file
from treespec.train.compare.journal import open_journal
from treespec.train.compare.passes import measure_by_budget, measuring_order
from treespec.train.compare.peers import PEERS, hf_peer, peer_results
from treespec.train.compare.profile_folders import write_profiles
from treespec.train.compare.progress import Progress
from treespec.train.compare.report import write_outputs
from treespec.train.compare.results_file import save_result
from treespec.train.compare.setup_costs import measure_setup
from treespec.train.compare.stamp import collect as collect_stamp
from treespec.train.compare.stamp import model_checksum, prompts_digest


def _module_checksum(drafter) -> dict:
    """A drafter's weights, when it was handed over without a source: the modules it holds."""
    modules = [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]
    if not modules:
        return model_checksum()
    return model_checksum(torch.nn.ModuleList(modules), source=type(drafter).__name__)


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def _record(row, meta: dict) -> dict:
    """One configuration's measurement as results.json keeps it: medians and every prompt run."""
    return {"config": row.name, **meta, "tau": _finite(row.tau), "tokens_per_s": row.tokens_per_s,
            "speedup": row.speedup, "target_passes": row.target_passes, "new_tokens": row.new_tokens,
            "overhead_fraction": _finite(row.overhead_fraction),
            "runs": {"tokens_per_s": row.prompt_tokens_per_s, "speedup": row.prompt_speedups,
                     "accept_lengths": row.prompt_accept_lengths, "new_tokens": row.prompt_new_tokens}}


def best_of(rows: list[Row]) -> str:
    """The fastest configuration by median speedup (rows[0] is vanilla); "vanilla" when there is no other."""
    return max(rows[1:], key=lambda r: r.speedup).name if len(rows) > 1 else "vanilla"


def context_length(prompt_info: list[dict]) -> int:
    """The median context a verification pass sees: prompt tokens + half the answer, over the prompts."""
    return max(1, int(statistics.median(p["prompt_tokens"] + p["answer_tokens"] // 2 for p in prompt_info)))


def describe_prompts(prompts: list[torch.Tensor], budgets: list[int]) -> list[dict]:
    """Plain prompts (no workload): one category, generation lengths the whole budget."""
    return [{"id": str(i), "category": "all", "turn": 1, "prompt_tokens": p.shape[1], "max_new_tokens": b,
             "answer_tokens": b} for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]


def run_comparison(target, drafters: list[DrafterSpec], tree_specs: list[dict], prompts: list[torch.Tensor], *,
                   max_new_tokens: int | list[int], temperature: float = 0.0, top_p: float = 1.0, repeats: int = 1,
                   cost_sizes=(1, 2, 4, 8, 16, 32, 64, 128), max_nodes: int = 64, peers: bool = True,
                   assistant=None, out_dir=".", logger=None, log=print, seed: int = 0, bootstrap: dict | None = None,
                   stamp: dict | None = None, eos_token_id=None, prompt_info: list[dict] | None = None,
                   held_out: str | None = None, batch_sizes=None, batches: int = 3,
                   batch_cost_sizes=(1, 2, 4, 8, 16, 32), acceptance: str | list[str] = "rejection",
                   baselines=(), resume: bool = False, journal_config: dict | None = None,
                   compile: bool = False) -> dict:
    """Measure every drafter × tree (and the peers) and write the report; returns results.json's contents.

    ``max_new_tokens``: one budget, or one per prompt; ``eos_token_id``: the end tokens every configuration
    (and peer) stops at; ``prompt_info[i]``: prompt i's id, category, turn, prompt and answer tokens
    (templates.TimedPrompt.describe; default: one category, answers the whole budget); ``held_out``: where
    the drafters' accuracies were measured, for the report. ``acceptance``: the walker's rule, or a list of
    rules run side by side on the same trees (each configuration named "drafter | tree | rule"; block
    verification skips branching trees). ``stamp`` (train/compare/stamp.py) describes the run;
    without one a stamp is collected here. ``bootstrap``: {samples, level, seed} for the report's intervals.
    ``batch_sizes``: then every drafter × tree at each batch size too (``batches`` batches of B prompts each, the
    longest budget, tree=auto per B from a cost curve over B × ``batch_cost_sizes`` tokens):
    train/compare/batch_compare.py. ``baselines``: transformers' own methods (``PEERS``' kinds: assisted needs
    ``assistant``) measured in the main pass, interleaved with every configuration, and reported as peers;
    ``peers=True`` measures all of them in a pass of their own instead. Every run is journaled as it finishes
    (train/compare/journal.py), the baselines' too: with ``resume`` a killed comparison in ``out_dir``
    continues where it stopped, refused if its settings (or ``journal_config``, the job's config) differ; the
    batch-size pass is measured again whole. ``compile``: treespec's configurations, vanilla included, run their
    target passes and drafting depths as compiled static graphs (generate's ``compile``; bench.measure warms up
    every shape first)."""
    baselines = list(baselines)
    unknown = [b for b in baselines if b not in PEERS]
    if unknown or (baselines and peers) or ("assisted" in baselines and assistant is None):
        raise ValueError(f"baselines={baselines}: each one of {', '.join(PEERS)}, without peers=True (which "
                         "measures them in a pass of their own), and assisted with an assistant model")
    for spec in across_specs(tree_specs):  # before anything is written or measured (the job checks its config alike)
        check_across(spec, [d.name for d in drafters])
    check_distinct(tree_specs, [d.name for d in drafters])
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    prompt_info = prompt_info or describe_prompts(prompts, budgets)
    if stamp is None:
        stamp = collect_stamp(target=target, prompts=prompts, prompt_set="given to run_comparison", seed=seed,
                              drafters={d.name: d.checksum or _module_checksum(d.drafter) for d in drafters})
    rules = [acceptance] if isinstance(acceptance, str) else list(acceptance)
    context = context_length(prompt_info)
    key = {"target": {k: v for k, v in stamp["target"].items() if k != "source"}, "drafters": stamp["drafters"],
           "prompts": prompts_digest(prompts), "max_new_tokens": budgets, "repeats": repeats,
           "temperature": temperature, "top_p": top_p, "seed": seed,
           "end_token_ids": sorted(eos_token_id) if eos_token_id else None, "trees": expand_specs(tree_specs),
           "acceptance": rules, "max_nodes": max_nodes, "cost_sizes": list(cost_sizes), "peers": bool(peers),
           "assistant": assistant is not None, "config": journal_config,
           # only when given, so a journal begun before these settings existed still resumes
           **({"drafter_trees": {d.name: expand_specs(d.trees) for d in drafters if d.trees}}
              if any(d.trees for d in drafters) else {}),
           **({"baselines": baselines} if baselines else {}), **({"compile": True} if compile else {})}
    journal, setup = open_journal(out_dir, key, resume, log)
    if setup is None:
        setup = measure_setup(target, drafters, tree_specs, rules, prompt_info, cost_sizes, context, max_nodes, log)
        journal.start(key, setup)
    log(f"every run is kept in {journal.path} as it finishes: resume=true run_dir={out_dir} continues a killed run")
    # each drafter's measurements, for generate(tree={"kind": "auto"}, profile=load_profile(folder)) to choose as here
    profiles = write_profiles(out_dir, drafters, setup.get("cost_models"), context_tokens=context)
    curve, curves, prefill = setup["cost_curve"], setup["cost_curves_after_drafting"], setup["prefill_curve"]
    meta, skipped, planned = setup["meta"], setup["skipped"], setup["configs"]
    by_drafter = {d.name: d for d in drafters}
    configs = [Config(c["name"], own_copy(by_drafter[c["drafter"]].drafter), build_tree(c["tree_spec"]),
                      acceptance=c["rule"])
               for c in planned if c["same_as"] is None]
    for c in planned:  # every configuration's tree, for use elsewhere (the same files when resumed)
        d = by_drafter.get(c["drafter"])  # None: an "auto" across drafters that chose no speculation
        save_tree(build_tree(c["tree_spec"]), out_dir / tree_file(c["name"]), config=c["name"],
                  drafter=d.name if d else "none", tree=meta[c["name"]]["tree"],
                  **{"load": d.entry} if d and d.entry else {})
    entries = {d.name: d.entry for d in drafters if d.entry}
    configs += [Config(PEERS[b], run=hf_peer(target, b, assistant, eos_token_id)) for b in baselines]

    def with_aliases(rows: list[Row]) -> list[Row]:
        """The measured rows of treespec's configurations, each one that verifies another's tree given that one's
        measurement (transformers' baselines, reported as peers, are left out)."""
        by_name = {r.name: r for r in rows}
        return [by_name["vanilla"]] + [dataclasses.replace(by_name[c["same_as"] or c["name"]], name=c["name"])
                                       for c in planned]

    def result_of(every_row, prompt_of_run) -> dict:
        """results.json's contents from the rows of the prompt runs measured so far, marked incomplete."""
        rows = with_aliases(every_row)
        baseline_rows = [r for r in every_row if r.name in PEERS.values()]
        records = [_record(r, meta[r.name]) for r in rows]
        for rec, row in zip(records, rows, strict=True):  # drafting cost as it happened in these runs
            per_depth = row.draft_time_per_pass / rec["depth"] if rec["depth"] else math.nan
            rec["draft_ms_per_depth"] = _finite(1e3 * per_depth)
            rec["c"] = _finite(per_depth / curve[min(curve)])  # c = draft depth / target forward over one token
            rec["walk_ms_per_pass"] = _finite(1e3 * row.walk_time_per_pass)  # part of the engine overhead
            rec["step_ms"] = step_parts(row)  # where a pass's time went
        return {
            "format": 3,
            "complete": False,       # true once every prompt run and the peers are measured
            "prompts_done": len(prompt_of_run),  # prompt runs measured (of prompts × repeats)
            "stamp": stamp,
            "settings": {"prompts": len(prompts), "repeats": repeats, "max_new_tokens": max(budgets),
                         "temperature": temperature, "top_p": top_p, "seed": seed, "bootstrap": dict(bootstrap or {}),
                         "end_token_ids": sorted(eos_token_id) if eos_token_id else None,
                         "context_tokens": context, "held_out": held_out, "compile": bool(compile)},
            "prompt_info": prompt_info,
            "prompt_of_run": list(prompt_of_run),
            "cost_curve": curve, "cost_curves_after_drafting": curves, "prefill_curve": prefill,
            "engine": setup.get("engine"), "cost_models": setup.get("cost_models"), "profiles": profiles,
            "cost_bounds": setup.get("cost_bounds"),
            "records": records, "skipped": skipped,
            "best": best_of(rows),
            "accuracy": {d.name: d.accuracy for d in drafters if d.accuracy is not None}, "drafter_entries": entries,
            "chain_tau": {d.name: {"tau": d.chain_tau.tau, "stderr": d.chain_tau.stderr, "drafts": d.chain_tau.drafts}
                          for d in drafters if d.chain_tau is not None},
            "peers": None, "wall_s": time.perf_counter() - started, "sessions": journal.sessions,
            **dict(zip(("peer_pass", "peers"), peer_results(rows + baseline_rows, best_of(rows)), strict=True)
                   if baseline_rows else {}),
        }

    order = measuring_order(budgets, repeats)
    restored = {p: journal.restored(p, order) for p in ("main", "peers")}
    # the peers' pass: vanilla, each drafter's best, transformers greedy, prompt lookup and assisted generation
    peer_count = 3 + len({c["drafter"] for c in planned} - {None}) + (assistant is not None) if peers else 0
    progress = Progress((len(configs) + 1 + peer_count) * len(order), len(order),
                        sum(map(len, restored.values())), log)
    common = {"temperature": temperature, "top_p": top_p, "seed": seed, "eos_token_id": eos_token_id,
              "compile": compile}
    # every run journaled as it finishes (a resume measures only what is missing), and results.json saved after
    # every prompt run (atomically): report=PATH renders a killed run as a partial one
    rows, prompt_of_run = measure_by_budget(
        target, configs, prompts, budgets, repeats=repeats, **common, progress=progress,
        restored=restored["main"], on_run=lambda k, i, name, m: journal.record("main", k, i, name, m),
        on_prompt=lambda partial, order: save_result(result_of(partial, order), out_dir))
    result = result_of(rows, prompt_of_run)
    records, best = result["records"], result["best"]
    if peers:
        # each drafter's best configuration runs again beside the peers, interleaved prompt by prompt, so its
        # ratio to every peer is measured on the same prompts in the same pass
        by_name = {c.name: c for c in configs}
        measured_as = {c["name"]: c["same_as"] or c["name"] for c in planned}
        bests = {}
        for rec in records[1:]:
            if rec["drafter"] not in bests or rec["speedup"] > bests[rec["drafter"]]["speedup"]:
                bests[rec["drafter"]] = rec
        # each measured once ("auto" across drafters measured as another's configuration, or as vanilla, is not again)
        peer_configs = [by_name[n] for n in dict.fromkeys(measured_as[rec["config"]] for rec in bests.values())
                        if n in by_name]
        peer_configs += [Config("transformers greedy", run=hf_peer(target, "greedy", eos_token_id=eos_token_id))]
        if assistant is not None:
            peer_configs.append(Config("transformers assisted", run=hf_peer(target, "assisted", assistant,
                                                                            eos_token_id)))
        peer_configs.append(Config("transformers prompt lookup", run=hf_peer(target, "prompt_lookup",
                                                                             eos_token_id=eos_token_id)))
        log(f"peers on the same prompts, interleaved with treespec vanilla and each drafter's best "
            f"({', '.join(c.name for c in peer_configs if c.run is None)})")
        peer_rows, _ = measure_by_budget(
            target, peer_configs, prompts, budgets, repeats=repeats, **common, progress=progress,
            restored=restored["peers"], on_run=lambda k, i, name, m: journal.record("peers", k, i, name, m))
        # the pass ran each best under the name it is measured as (an alias's tree is its original's)
        result["peer_pass"], result["peers"] = peer_results(peer_rows, measured_as.get(best, best))
        result["wall_s"] = time.perf_counter() - started
        save_result(result, out_dir)
    if batch_sizes:
        result["batch"] = run_batch_sizes(
            target, drafters, [(spec_label(spec), spec) for spec in expand_specs(per_drafter(tree_specs))], prompts,
            resolve=lambda spec, d, costs: resolve_tree(spec, d, costs, max_nodes),
            batch_sizes=batch_sizes, batches=batches, max_new_tokens=max(budgets), temperature=temperature,
            top_p=top_p, eos_token_id=eos_token_id, cost_sizes=batch_cost_sizes, past_len=context, seed=seed, log=log)
    result["wall_s"] = time.perf_counter() - started
    result["complete"] = True
    write_outputs(result, out_dir, logger)
    return result
