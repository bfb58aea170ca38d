"""Compare drafters × trees on one target and prompt set: "which tree should I use here?"

For every drafter × tree: τ, acceptance-length histogram, target passes, tokens/s and speedup over
vanilla decoding measured in the same process (bench.measure: interleaved, warmed up, medians), beside
the analytic prediction from the drafter's measured per-depth top-k accuracies and the target's
measured cost curve (autotree). Peers run on the same prompts: transformers' greedy generate(),
assisted generation with the draft as ``assistant_model``, and ``prompt_lookup_num_tokens``, interleaved
with each drafter's best configuration. Every prompt run's values are kept (results.json), so the report
(train/report.py: tables with bootstrap intervals, plots, wandb) can be rendered again later without
measuring; train/stamp.py records what was run where. Driven by scripts/compare_trees.py (conf/compare.yaml).
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from treespec import reference
from treespec.autotree import auto_chooser, cost_at, measure_cost_curve, predict
from treespec.bench import Config, measure
from treespec.compat import NO_EOS
from treespec.generate import GenerationResult
from treespec.heads import registry
from treespec.heads.vocab import DraftVocab
from treespec.sampling import Sampling
from treespec.timing import forward_step
from treespec.tree import Tree
from treespec.tree_spec import NEEDS_ACCURACY, build_tree, check_tree_spec

from .data import STDLIB_CORPUS, held_out_windows, own_continuations, prepare_tokens
from .log import RunLogger
from .report import compare_runs, rerender, save_result, write_outputs
from .stamp import collect as collect_stamp
from .stamp import model_checksum


@dataclass
class DrafterSpec:
    name: str
    drafter: object
    accuracy: list | None = None        # acc[d][r] for accuracy-grown trees and predictions
    draft_cost_per_depth: float = 0.0   # seconds, for predictions
    draft_cost_fixed: float = 0.0
    max_depth: int | None = None        # deepest tree it can fill (Medusa: number of heads)
    drafting_step: Callable[[], Callable] | None = None  # makes a call running one drafting call (for timing)
    checksum: dict | None = None        # for the report's stamp: source, weight files' and weights' sha1


def expand_specs(specs) -> list[dict]:
    """List-valued fields expand into one spec per value: {"kind": "chain", "depth": [1, 2]} → two specs."""
    out = []
    for spec in specs:
        spec = dict(spec)
        keys = [k for k, v in spec.items() if isinstance(v, (list, tuple)) and k != "paths"]
        for values in itertools.product(*(spec[k] for k in keys)):
            out.append({**spec, **dict(zip(keys, values, strict=True))})
    return out


def spec_label(spec: dict) -> str:
    kind = spec.get("kind")
    if kind == "chain":
        return f"chain γ={spec['depth']}"
    if kind == "full":
        return f"full {spec['width']}×{spec['depth']}"
    if kind == "accuracy":
        return f"accuracy {spec['nodes']}"
    if kind == "dynamic":
        return f"dynamic {spec.get('total_tokens')}/{spec.get('depth')}/{spec.get('top_k')}"
    if kind == "auto":
        return "auto"
    return f"{kind} {len(spec.get('paths', []))}"


def resolve_tree(spec: dict, d: DrafterSpec, curve: dict[int, float], max_nodes: int, baseline: float | None = None):
    """The tree this drafter verifies for ``spec``, or (None, reason) when it cannot fill it. ``curve``: the
    drafter's cost curve; ``baseline``: vanilla's seconds per token (default the curve's one-token cost)."""
    if spec.get("kind") in NEEDS_ACCURACY and d.accuracy is None:
        return None, f"{d.name} has no measured accuracies"
    if spec.get("kind") == "auto":
        spec = {**spec, "max_nodes": spec.get("max_nodes", max_nodes)}
    tree = build_tree(spec, accuracy=d.accuracy,
                      choose=auto_chooser(curve, d.draft_cost_fixed, d.draft_cost_per_depth, baseline))
    if not isinstance(tree, Tree) and not d.drafter.grows_dynamic_trees:
        return None, f"{d.name} cannot grow dynamic trees"
    if not isinstance(tree, Tree) and d.drafter.candidates == "sample":
        return None, f"{d.name} samples its candidates; dynamic trees grow top-k ones"
    if d.max_depth is not None and tree.depth > d.max_depth:
        return None, f"{d.name} fills depth <= {d.max_depth}"
    return tree, None


def hf_peer(target, kind: str, assistant=None):
    """A bench.Config runner for transformers' own generate(): greedy/sampling, assisted, prompt lookup."""
    extra = {"assisted": {"assistant_model": assistant}, "prompt_lookup": {"prompt_lookup_num_tokens": 4}}.get(kind, {})

    def run(prompt, max_new_tokens, temperature, top_p, generator):
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
            {"do_sample": False}
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        t0 = time.perf_counter()
        seq = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=NO_EOS, **sampling, **extra)
        return GenerationResult(sequences=seq, prompt_length=prompt.shape[1], wall_time=time.perf_counter() - t0)

    return run


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
                     "accept_lengths": row.prompt_accept_lengths}}


def run_comparison(target, drafters: list[DrafterSpec], tree_specs: list[dict], prompts: list[torch.Tensor], *,
                   max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, repeats: int = 1,
                   cost_sizes=(1, 2, 4, 8, 16, 32, 64, 128), max_nodes: int = 64, peers: bool = True,
                   assistant=None, out_dir=".", logger=None, log=print, seed: int = 0, bootstrap: dict | None = None,
                   stamp: dict | None = None) -> dict:
    """Measure every drafter × tree (and the peers) and write the report; returns results.json's contents.

    ``stamp`` (train/stamp.py) describes the run for the report; without one a stamp is collected here from
    what this function is given. ``bootstrap``: {samples, level, seed} for the report's intervals."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if stamp is None:
        stamp = collect_stamp(target=target, prompts=prompts, prompt_set="given to run_comparison", seed=seed,
                              drafters={d.name: d.checksum or _module_checksum(d.drafter) for d in drafters})
    log(f"cost curve: target forward over N tree tokens, N in {list(cost_sizes)}")
    curve = measure_cost_curve(target, cost_sizes)
    log("  " + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in curve.items()))
    # each drafter's own curve, every forward timed right after one of its drafting calls as in decoding (its
    # weights push the target's out of the caches: ~10 % slower on a CPU); predictions and "auto" use it
    curves, baseline = {}, cost_at(curve, 1)  # vanilla's seconds per token: the target alone
    for d in drafters:
        if d.drafting_step is not None:
            curves[d.name] = measure_cost_curve(target, cost_sizes, before=d.drafting_step())
            d.drafter.reset()
            log(f"  after {d.name}'s drafting: " + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in
                                                           curves[d.name].items()))

    configs, meta, skipped = [], {}, []
    for d in drafters:
        for spec in expand_specs(tree_specs):
            tree, reason = resolve_tree(spec, d, curves.get(d.name, curve), max_nodes, baseline=baseline)
            name = f"{d.name} | {spec_label(spec)}"
            if tree is None:
                log(f"  skip {name}: {reason}")
                skipped.append({"config": name, "drafter": d.name, "tree": spec_label(spec), "reason": reason})
                continue
            configs.append(Config(name, d.drafter, tree))
            pred = predict(tree, d.accuracy, curves.get(d.name, curve), d.draft_cost_per_depth, d.draft_cost_fixed,
                           baseline=baseline) \
                if d.accuracy is not None and isinstance(tree, Tree) else None
            meta[name] = {"drafter": d.name, "tree": spec_label(spec), "nodes": len(tree),
                          "depth": tree.depth if isinstance(tree, Tree) else spec.get("depth"),
                          "predicted_tau": pred.tau if pred else None,
                          "predicted_speedup": pred.speedup if pred else None}
    meta["vanilla"] = {"drafter": "none", "tree": "vanilla", "nodes": 0, "depth": 0, "predicted_tau": 1.0,
                       "predicted_speedup": 1.0}
    prompt_of_run = [i % len(prompts) for i in range(len(prompts) * repeats)]

    def result_of(rows) -> dict:
        """results.json's contents from the rows of the prompt runs measured so far, marked incomplete."""
        records = [_record(r, meta[r.name]) for r in rows]
        for rec, row in zip(records, rows, strict=True):  # drafting cost as it happened in these runs
            per_depth = row.draft_time_per_pass / rec["depth"] if rec["depth"] else math.nan
            rec["draft_ms_per_depth"] = _finite(1e3 * per_depth)
            rec["c"] = _finite(per_depth / curve[min(curve)])  # c = draft depth / target forward over one token
        done = len(rows[0].prompt_speedups)
        return {
            "format": 2,
            "complete": False,       # true once every prompt run and the peers are measured
            "prompts_done": done,    # prompt runs measured (of prompts × repeats)
            "stamp": stamp,
            "settings": {"prompts": len(prompts), "repeats": repeats, "max_new_tokens": max_new_tokens,
                         "temperature": temperature, "top_p": top_p, "seed": seed,
                         "bootstrap": dict(bootstrap or {})},
            "prompt_of_run": prompt_of_run[:done],
            "cost_curve": curve, "cost_curves_after_drafting": curves, "records": records, "skipped": skipped,
            "best": max(rows[1:], key=lambda r: r.speedup).name if len(rows) > 1 else "vanilla",
            "accuracy": {d.name: d.accuracy for d in drafters if d.accuracy is not None}, "peers": None,
            "wall_s": time.perf_counter() - started,
        }

    total = (len(configs) + 1) * len(prompts) * repeats
    count = itertools.count(1)
    # saved after every prompt (atomically), so a run killed after hours keeps what it measured: report=PATH
    # renders it as a partial run
    rows = measure(target, configs, prompts * repeats, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, progress=lambda name, i: log(f"  [{next(count)}/{total}] {name}"),
                   on_prompt=lambda partial_rows: save_result(result_of(partial_rows), out_dir))
    result = result_of(rows)
    records, best = result["records"], result["best"]
    if peers:
        # each drafter's best configuration runs again beside the peers, interleaved prompt by prompt, so its
        # ratio to every peer is measured on the same prompts in the same pass
        by_name = {c.name: c for c in configs}
        bests = {}
        for rec in records[1:]:
            if rec["drafter"] not in bests or rec["speedup"] > bests[rec["drafter"]]["speedup"]:
                bests[rec["drafter"]] = rec
        peer_configs = [by_name[rec["config"]] for rec in bests.values()]
        peer_configs += [Config("transformers greedy", run=hf_peer(target, "greedy"))]
        if assistant is not None:
            peer_configs.append(Config("transformers assisted", run=hf_peer(target, "assisted", assistant)))
        peer_configs.append(Config("transformers prompt lookup", run=hf_peer(target, "prompt_lookup")))
        log(f"peers on the same prompts, interleaved with treespec vanilla and each drafter's best "
            f"({', '.join(by_name[rec['config']].name for rec in bests.values())})")
        peer_rows = measure(target, peer_configs, prompts * repeats, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, seed=seed)
        runs = {r.name: r.prompt_tokens_per_s for r in peer_rows}
        best_runs = runs.get(best, runs["vanilla"])
        result["peer_pass"] = {r.name: {"tokens_per_s": r.prompt_tokens_per_s, "speedup": r.prompt_speedups}
                               for r in peer_rows if not r.name.startswith("transformers ")}
        result["peers"] = [{"name": r.name, "tokens_per_s": r.tokens_per_s, "speedup_vs_vanilla": r.speedup,
                            "treespec_best_over_this": statistics.median(
                                b / p for b, p in zip(best_runs, r.prompt_tokens_per_s, strict=True)),
                            "runs": {"tokens_per_s": r.prompt_tokens_per_s, "speedup": r.prompt_speedups}}
                           for r in peer_rows if r.name.startswith("transformers ")]
        result["wall_s"] = time.perf_counter() - started
        save_result(result, out_dir)
    result["wall_s"] = time.perf_counter() - started
    result["complete"] = True
    write_outputs(result, out_dir, logger)
    return result


def tree_specs_of(cfg) -> list[dict]:
    """The run's tree specs (``tree=...`` replaces ``trees``), expanded and checked before anything loads."""
    specs = [OmegaConf.to_container(cfg.tree, resolve=True)] if cfg.get("tree") else \
        OmegaConf.to_container(cfg.trees, resolve=True)
    for spec in expand_specs(specs):
        check_tree_spec(spec)
    return specs


def check_config(cfg) -> None:
    """Everything that can be wrong in the config, raised before any model is loaded."""
    tree_specs_of(cfg)
    for label in cfg.drafters:
        if label not in cfg.available:
            raise ValueError(f"drafters: {label!r} is not one of the available drafters ({', '.join(cfg.available)}; "
                             "conf/drafter/ describes them)")
        entry = cfg.available[label]
        kind = registry.get(entry.name)
        if kind.has_weights and OmegaConf.is_missing(entry, "source"):
            raise ValueError(f"drafter {label!r} needs its checkpoint: available.{label}.source=/path/to/folder")
        if entry.get("draft_vocab") is not None and not kind.reduces_vocab:
            raise ValueError(f"drafter {label!r}: {entry.name} has no full-vocabulary head for draft_vocab")
        if entry.get("candidates", "topk") not in kind.candidate_modes:
            raise ValueError(f"drafter {label!r}: {entry.name} takes candidates in {kind.candidate_modes}")
    for key in ("prompts", "repeats", "max_new_tokens"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    boot = bootstrap_settings(cfg)
    if boot["samples"] < 100 or not 0 < boot["level"] < 1:
        raise ValueError(f"bootstrap: samples must be >= 100 and 0 < level < 1, got {boot}")
    available = len(reference.prompts())
    if cfg.prompts > available:
        raise ValueError(f"prompts={cfg.prompts}: only {available} held-out prompts are shipped")


def drafter_checksum(entry, module) -> dict:
    """The stamp's record of one drafter: its source, weight files' sha1 and loaded weights' sha1."""
    if module is None:
        return {"source": entry.get("source"), "weights": None}
    try:
        folder = reference.resolve(entry.source)
    except (FileNotFoundError, TypeError):
        folder = None
    return model_checksum(module, entry.get("source"), folder)


def load_drafters(cfg, target, windows, sampling: Sampling, vocab_of=lambda spec: None, log=print) -> list[DrafterSpec]:
    """Each drafter the run names, from the registry, with its accuracies at this run's sampling and its
    drafting costs (for predictions). Accuracies are measured at the run's sampling on ``windows()``: the
    target's own continuations of held-out text (``own_continuations``), what verification will see; the
    accuracies shipped beside a drafter were measured on human-written text and underestimate τ.
    ``vocab_of(entry.draft_vocab)`` gives the drafter's FR-Spec vocabulary (None: its full head)."""
    specs = []
    target_step = forward_step(target, 1)  # drafting is timed right after a target pass, as in decoding
    for label in cfg.drafters:
        entry = cfg.available[label]
        kind = registry.get(entry.name)
        candidates = entry.get("candidates", "topk")
        module = registry.load(entry.name, target, entry.get("source"))
        draft_vocab = vocab_of(entry.get("draft_vocab"))
        accuracy = None
        # predictions assume top-k ranks of the full head (a reduced one's accuracies were never measured)
        if candidates == "topk" and draft_vocab is None:  # None for a drafter without fixed ranks
            accuracy = kind.rank_accuracy(target, module, windows(), sampling=sampling)
        drafter = registry.make(entry.name, module, candidates, draft_vocab, lean=entry.get("lean", True))
        # as it drafts (lean or not, reduced vocabulary or not). A step's first drafting call follows a target pass,
        # which pushed the drafter's weights out of the caches (~10-30 % slower on a CPU); later depths follow
        # each other: the first call's extra cost is charged once per step
        fixed, cold_depth = kind.cost(drafter, before=target_step)
        per_depth = kind.cost(drafter)[1] if cold_depth else 0.0
        fixed += max(0.0, cold_depth - per_depth)
        if fixed or per_depth:
            log(f"drafting cost of {label}: {1e3 * fixed:.2f} ms per step + {1e3 * per_depth:.2f} ms per depth")
        step = functools.partial(kind.drafting_step, drafter) if kind.has_weights else None
        specs.append(DrafterSpec(label, drafter, accuracy,
                                 draft_cost_per_depth=per_depth, draft_cost_fixed=fixed,
                                 max_depth=kind.max_depth(module), checksum=drafter_checksum(entry, module),
                                 drafting_step=step))
    return specs


def bootstrap_settings(cfg) -> dict:
    b = cfg.get("bootstrap") or {}
    return {"samples": int(b.get("samples", 2000)), "level": float(b.get("level", 0.95)),
            "seed": int(b.get("seed", 0))}


def run_from_config(cfg, out_dir, command: str | None = None) -> dict:
    """The scripts/compare_trees.py job: load target and drafters named in ``cfg``, compare, write outputs."""
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tree_specs = tree_specs_of(cfg)
    target, tokenizer = reference.load_model(cfg.target)
    assistant = reference.load_model(cfg.assistant)[0] if cfg.get("assistant") else None
    device = torch.device(cfg.get("device") or "cpu")
    target = target.to(device)  # drafters load onto the target's device (heads/registry.py)
    assistant = assistant.to(device) if assistant is not None else None
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in reference.prompts()[: cfg.prompts]]

    @functools.cache
    def windows() -> torch.Tensor:  # [accuracy_windows, 144], made once, only if a drafter needs them
        held_out = held_out_windows(tokenizer, 256, cfg.accuracy_windows, cfg.paths.data)
        return own_continuations(target, held_out, temperature=cfg.temperature, top_p=cfg.top_p,
                                 seed=int(cfg.get("seed") or 0)).to(device)

    @functools.cache
    def corpus_counts() -> torch.Tensor:  # [V] token counts of the corpus's training split (FR-Spec's ranking)
        _, train_tokens, _ = prepare_tokens(STDLIB_CORPUS, len(tokenizer), cfg.paths.data, tokenizer=tokenizer)
        return torch.bincount(train_tokens.long(), minlength=len(tokenizer))

    def vocab_of(spec) -> DraftVocab | None:
        """``draft_vocab`` of a drafter entry: N (the N most frequent corpus tokens), a saved vocabulary's path,
        or null (the full head)."""
        if spec is None:
            return None
        if isinstance(spec, int):
            return DraftVocab.most_frequent(corpus_counts(), spec)
        return DraftVocab.load(spec)

    drafters = load_drafters(cfg, target, windows, Sampling(cfg.temperature, cfg.top_p), vocab_of)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    stamp = collect_stamp(
        target=target, target_source=str(cfg.target), target_folder=reference.resolve(cfg.target),
        drafters={d.name: d.checksum for d in drafters}, prompts=prompts, command=command, config=resolved,
        prompt_set=f"treespec reference prompts (prompts.jsonl, split test), the first {cfg.prompts}",
        seed=int(cfg.get("seed") or 0))
    logger = RunLogger(out_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project, name="compare-trees",
                       config={**resolved, "stamp": {k: v for k, v in stamp.items() if k != "config"}})
    result = run_comparison(target, drafters, tree_specs, prompts, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, top_p=cfg.top_p, repeats=cfg.repeats,
                            cost_sizes=tuple(cfg.cost_sizes), max_nodes=cfg.max_nodes, peers=cfg.peers,
                            assistant=assistant, out_dir=out_dir, logger=logger, seed=int(cfg.get("seed") or 0),
                            bootstrap=bootstrap_settings(cfg), stamp=stamp)
    logger.finish()
    return result


def run_job(cfg, out_dir, command: str | None = None) -> dict:
    """scripts/compare_trees.py: ``report=PATH`` re-renders a run's outputs from its results.json (nothing is
    measured), ``compare=[A,B,...]`` writes ``comparison.md`` (runs side by side) into ``out_dir``, else a
    comparison is measured. Returns {"mode", "outputs" (files written), "markdown" (what to print), ...}."""
    if cfg.get("report") and cfg.get("compare"):
        raise ValueError("give report=PATH or compare=[A,B], not both")
    if cfg.get("report"):
        folder = rerender(cfg.report)
        return {"mode": "report", "outputs": folder, "markdown": (folder / "results.md").read_text()}
    if cfg.get("compare"):
        paths = cfg.compare
        paths = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [str(p) for p in paths]
        text = compare_runs(paths)
        path = Path(out_dir) / "comparison.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return {"mode": "compare", "outputs": path, "markdown": text}
    result = run_from_config(cfg, out_dir, command)
    return {"mode": "measure", "outputs": Path(out_dir), "best": result["best"], "result": result,
            "markdown": (Path(out_dir) / "results.md").read_text()}
