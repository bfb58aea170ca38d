"""Compare drafters × trees on one target and prompt set: "which tree should I use here?"

For every drafter × tree: τ, acceptance-length histogram, target passes, tokens/s and speedup over
vanilla decoding measured in the same process (bench.measure: interleaved, warmed up, medians), beside
the analytic prediction from the drafter's measured per-depth top-k accuracies and the target's
measured cost curve (autotree). Peers run on the same prompts: transformers' greedy generate(),
assisted generation with the draft as ``assistant_model``, and ``prompt_lookup_num_tokens``.
The report (tables, plots, wandb) is train/report.py. Driven by scripts/compare_trees.py (conf/compare.yaml).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from treespec import reference
from treespec.autotree import auto_chooser, measure_cost_curve, predict
from treespec.bench import Config, measure
from treespec.generate import GenerationResult
from treespec.heads import registry
from treespec.heads.accuracy import read_accuracy
from treespec.sampling import Sampling
from treespec.tree import Tree
from treespec.tree_spec import NEEDS_ACCURACY, build_tree, check_tree_spec

from .data import held_out_windows
from .log import RunLogger
from .report import write_outputs


@dataclass
class DrafterSpec:
    name: str
    drafter: object
    accuracy: list | None = None        # acc[d][r] for accuracy-grown trees and predictions
    draft_cost_per_depth: float = 0.0   # seconds, for predictions
    draft_cost_fixed: float = 0.0
    max_depth: int | None = None        # deepest tree it can fill (Medusa: number of heads)


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


def resolve_tree(spec: dict, d: DrafterSpec, curve: dict[int, float], max_nodes: int):
    """The tree this drafter verifies for ``spec``, or (None, reason) when it cannot fill it."""
    if spec.get("kind") in NEEDS_ACCURACY and d.accuracy is None:
        return None, f"{d.name} has no measured accuracies"
    if spec.get("kind") == "auto":
        spec = {**spec, "max_nodes": spec.get("max_nodes", max_nodes)}
    tree = build_tree(spec, accuracy=d.accuracy,
                      choose=auto_chooser(curve, d.draft_cost_fixed, d.draft_cost_per_depth))
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
                              min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None, **sampling, **extra)
        return GenerationResult(sequences=seq, prompt_length=prompt.shape[1], wall_time=time.perf_counter() - t0)

    return run


def run_comparison(target, drafters: list[DrafterSpec], tree_specs: list[dict], prompts: list[torch.Tensor], *,
                   max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, repeats: int = 1,
                   cost_sizes=(1, 2, 4, 8, 16, 32, 64, 128), max_nodes: int = 64, peers: bool = True,
                   assistant=None, out_dir=".", logger=None, log=print) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"cost curve: target forward over N tree tokens, N in {list(cost_sizes)}")
    curve = measure_cost_curve(target, cost_sizes)
    log("  " + ", ".join(f"N={n}: {1e3 * t:.1f} ms" for n, t in curve.items()))

    configs, meta = [], {}
    for d in drafters:
        for spec in expand_specs(tree_specs):
            tree, reason = resolve_tree(spec, d, curve, max_nodes)
            name = f"{d.name} | {spec_label(spec)}"
            if tree is None:
                log(f"  skip {name}: {reason}")
                continue
            configs.append(Config(name, d.drafter, tree))
            pred = predict(tree, d.accuracy, curve, d.draft_cost_per_depth, d.draft_cost_fixed) \
                if d.accuracy is not None and isinstance(tree, Tree) else None
            meta[name] = {"drafter": d.name, "tree": spec_label(spec), "nodes": len(tree),
                          "depth": tree.depth if isinstance(tree, Tree) else spec.get("depth"),
                          "predicted_tau": pred.tau if pred else math.nan,
                          "predicted_speedup": pred.speedup if pred else math.nan}
    total = (len(configs) + 1) * len(prompts) * repeats
    done = itertools.count(1)
    rows = measure(target, configs, prompts * repeats, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, progress=lambda name, i: log(f"  [{next(done)}/{total}] {name}"))
    meta["vanilla"] = {"drafter": "none", "tree": "vanilla", "nodes": 0, "depth": 0, "predicted_tau": 1.0,
                       "predicted_speedup": 1.0}

    result = {"cost_curve": curve, "rows": rows, "meta": meta}
    best = max(rows[1:], key=lambda r: r.speedup) if len(rows) > 1 else rows[0]
    result["best"] = best.name
    if peers:
        peer_configs = [Config(best.name, next(c for c in configs if c.name == best.name).drafter,
                               next(c for c in configs if c.name == best.name).tree)] if len(rows) > 1 else []
        peer_configs += [Config("transformers greedy", run=hf_peer(target, "greedy"))]
        if assistant is not None:
            peer_configs.append(Config("transformers assisted", run=hf_peer(target, "assisted", assistant)))
        peer_configs.append(Config("transformers prompt lookup", run=hf_peer(target, "prompt_lookup")))
        log("peers on the same prompts (interleaved with treespec vanilla and best)")
        peer_rows = measure(target, peer_configs, prompts * repeats, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p)
        best_tps = next(r.tokens_per_s for r in peer_rows if r.name == best.name) if len(rows) > 1 else \
            peer_rows[0].tokens_per_s
        result["peers"] = [{"name": r.name, "tokens_per_s": r.tokens_per_s, "speedup_vs_vanilla": r.speedup,
                            "treespec_best_over_this": best_tps / r.tokens_per_s} for r in peer_rows]
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
        if entry.get("candidates", "topk") not in kind.candidate_modes:
            raise ValueError(f"drafter {label!r}: {entry.name} takes candidates in {kind.candidate_modes}")
    for key in ("prompts", "repeats", "max_new_tokens"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ValueError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    available = len(reference.prompts())
    if cfg.prompts > available:
        raise ValueError(f"prompts={cfg.prompts}: only {available} held-out prompts are shipped")


def load_drafters(cfg, target, windows, sampling: Sampling) -> list[DrafterSpec]:
    """Each drafter the run names, from the registry, with its accuracies at this run's sampling and its
    drafting costs (for predictions). Accuracies shipped beside a drafter are greedy ones; others, and all
    at temperature > 0, are measured on held-out windows."""
    specs = []
    for label in cfg.drafters:
        entry = cfg.available[label]
        kind = registry.get(entry.name)
        candidates = entry.get("candidates", "topk")
        module = registry.load(entry.name, target, entry.get("source"))
        accuracy = None
        if kind.rank_accuracy is not None and candidates == "topk":  # predictions assume top-k ranks
            shipped = read_accuracy(reference.resolve(entry.source)) if kind.load else None
            if shipped is not None and sampling.greedy:
                accuracy = shipped
            else:
                accuracy = kind.rank_accuracy(target, module, windows(), sampling=sampling)
        fixed, per_depth = kind.cost(module)
        specs.append(DrafterSpec(label, registry.make(entry.name, module, candidates), accuracy,
                                 draft_cost_per_depth=per_depth, draft_cost_fixed=fixed,
                                 max_depth=kind.max_depth(module)))
    return specs


def run_from_config(cfg, out_dir) -> dict:
    """The scripts/compare_trees.py job: load target and drafters named in ``cfg``, compare, write outputs."""
    check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tree_specs = tree_specs_of(cfg)
    target, tokenizer = reference.load_model(cfg.target)
    assistant = reference.load_model(cfg.assistant)[0] if cfg.get("assistant") else None
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in reference.prompts()[: cfg.prompts]]

    @functools.cache
    def windows() -> torch.Tensor:  # [accuracy_windows, 256], loaded once, only if a drafter needs them
        return held_out_windows(tokenizer, 256, cfg.accuracy_windows, cfg.paths.data)

    drafters = load_drafters(cfg, target, windows, Sampling(cfg.temperature, cfg.top_p))
    logger = RunLogger(out_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project, name="compare-trees",
                       config=OmegaConf.to_container(cfg, resolve=True))
    result = run_comparison(target, drafters, tree_specs, prompts, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, top_p=cfg.top_p, repeats=cfg.repeats,
                            cost_sizes=tuple(cfg.cost_sizes), max_nodes=cfg.max_nodes, peers=cfg.peers,
                            assistant=assistant, out_dir=out_dir, logger=logger)
    logger.finish()
    return result
