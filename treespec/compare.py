"""Compare drafters × trees on one target and prompt set: "which tree should I use here?"

For every drafter × tree: τ, acceptance-length histogram, target passes, tokens/s and speedup over
vanilla decoding measured in the same process (bench.measure: interleaved, warmed up, medians), beside
the analytic prediction from the drafter's measured per-depth top-k accuracies and the target's
measured cost curve (autotree). Peers run on the same prompts: transformers' greedy generate(),
assisted generation with the draft as ``assistant_model``, and ``prompt_lookup_num_tokens``.
Outputs: results.csv, results.md, cost_curve.csv, PNG plots, and a wandb run (offline without
credentials). Driven by scripts/compare_trees.py (conf/compare.yaml).
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec.autotree import choose_tree, measure_cost_curve, predict
from treespec.bench import Config, Row, forward_time, measure, median_time
from treespec.generate import GenerationResult
from treespec.policy import build_tree
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree
from treespec.verify import rank_acceptance


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
    if spec.get("kind") in ("accuracy", "auto") and d.accuracy is None:
        return None, f"{d.name} has no measured accuracies"
    if spec.get("kind") == "auto":
        best, _ = choose_tree(d.accuracy, curve, max_nodes=spec.get("max_nodes", max_nodes),
                              draft_cost_per_depth=d.draft_cost_per_depth, draft_cost_fixed=d.draft_cost_fixed)
        return best.tree, None
    tree = build_tree(spec, accuracy=d.accuracy)
    if not isinstance(tree, Tree) and not d.drafter.grows_dynamic_trees:
        return None, f"{d.name} cannot grow dynamic trees"
    if not isinstance(tree, Tree) and getattr(d.drafter, "candidates", "topk") == "sample":
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


def write_outputs(result: dict, out_dir: Path, logger=None) -> None:
    rows, meta, curve = result["rows"], result["meta"], result["cost_curve"]
    fields = ["config", "drafter", "tree", "nodes", "depth", "tau", "predicted_tau", "tokens_per_s", "speedup",
              "predicted_speedup", "target_passes", "new_tokens", "overhead_fraction"]
    records = [{"config": r.name, **meta[r.name], "tau": r.tau, "tokens_per_s": r.tokens_per_s, "speedup": r.speedup,
                "target_passes": r.target_passes, "new_tokens": r.new_tokens,
                "overhead_fraction": r.overhead_fraction} for r in rows]
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: rec[k] for k in fields} for rec in records)
    with open(out_dir / "cost_curve.csv", "w") as f:
        f.write("tree_tokens,seconds\n" + "".join(f"{n},{t:.6f}\n" for n, t in curve.items()))
    lines = ["| drafter | tree | nodes | τ | predicted τ | tokens/s | speedup | predicted speedup | engine overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        lines.append(f"| {rec['drafter']} | {rec['tree']} | {rec['nodes']} | {rec['tau']:.2f} | "
                     f"{rec['predicted_tau']:.2f} | {rec['tokens_per_s']:.1f} | {rec['speedup']:.2f}× | "
                     f"{rec['predicted_speedup']:.2f}× | {100 * rec['overhead_fraction']:.1f}% |")
    if result.get("peers"):
        lines += ["", "| peer (same prompts) | tokens/s | speedup vs treespec vanilla | treespec best ÷ peer |",
                  "|---|---|---|---|"]
        lines += [f"| {p['name'].replace('|', '/')} | {p['tokens_per_s']:.1f} | {p['speedup_vs_vanilla']:.2f}× | "
                  f"{p['treespec_best_over_this']:.2f} |" for p in result["peers"]]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {"records": records, "peers": result.get("peers"), "best": result["best"],
         "cost_curve": {str(n): t for n, t in curve.items()},
         "accept_lengths": {r.name: r.accept_lengths for r in rows}}, indent=1, default=float))
    plot(records, rows, out_dir)
    if logger is not None:
        log_wandb(logger, records, rows, result, out_dir)


def plot(records: list[dict], rows: list[Row], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_drafter: dict[str, list[dict]] = {}
    for rec in records[1:]:
        by_drafter.setdefault(rec["drafter"], []).append(rec)
    for key, ylabel, fname in (("tau", "τ (tokens per target pass)", "tau_vs_nodes.png"),
                               ("speedup", "speedup over vanilla", "speedup_vs_nodes.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for drafter, recs in by_drafter.items():
            recs = sorted(recs, key=lambda r: r["nodes"])
            ax.plot([r["nodes"] for r in recs], [r[key] for r in recs], "o", label=f"{drafter} measured")
            if not all(math.isnan(r[f"predicted_{key}"]) for r in recs):
                ax.plot([r["nodes"] for r in recs], [r[f"predicted_{key}"] for r in recs], "x", alpha=0.6,
                        label=f"{drafter} predicted")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes (candidates)")
        ax.set_ylabel(ylabel)
        if key == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
    best_per_drafter = {}
    for row in rows[1:]:
        drafter = row.name.split(" | ")[0]
        if drafter not in best_per_drafter or row.speedup > best_per_drafter[drafter].speedup:
            best_per_drafter[drafter] = row
    fig, axes = plt.subplots(1, max(1, len(best_per_drafter)), figsize=(4 * max(1, len(best_per_drafter)), 3),
                             squeeze=False)
    for ax, row in zip(axes[0], best_per_drafter.values(), strict=False):
        top = max(row.accept_lengths, default=1)
        ax.hist(row.accept_lengths, bins=range(1, top + 2), align="left", rwidth=0.8)
        ax.set_title(f"{row.name}\nτ={row.tau:.2f}", fontsize=8)
        ax.set_xlabel("tokens committed per pass")
    fig.tight_layout()
    fig.savefig(out_dir / "accept_length_hist.png", dpi=120)
    plt.close(fig)


def log_wandb(logger, records, rows, result, out_dir: Path) -> None:
    logger.log({f"compare/{rec['config']}/{k}": rec[k] for rec in records for k in ("tau", "tokens_per_s", "speedup")})
    for row in rows[1:]:
        logger.histogram(f"accept_length/{row.name}", row.accept_lengths)
    logger.summary({"best": result["best"], "peers": result.get("peers"), "records": records})
    if logger.wandb is not None:
        import wandb

        logger.wandb.log({"results": wandb.Table(columns=list(records[0]), data=[list(r.values()) for r in records]),
                          **{p.stem: wandb.Image(str(p)) for p in out_dir.glob("*.png")}})


def draft_model_accuracy(target, draft, windows: torch.Tensor, depth: int = 8, top_k: int = 8,
                         sampling: Sampling = GREEDY) -> list[list[float]]:
    """acc[d][r] for a draft LM: the chance its rank-r token is the one the target emits
    (``verify.rank_acceptance``; greedy: the target's argmax), teacher forced on held-out windows; the same
    at every depth (the seed's i.i.d. acceptance assumption)."""
    hits, total = torch.zeros(top_k), 0
    with torch.no_grad():
        for w in windows.split(4):
            ranks = draft(input_ids=w).logits.topk(top_k, dim=-1).indices  # [b, s, R]
            hits += rank_acceptance(ranks, target(input_ids=w).logits, sampling).flatten(0, 1).sum(0)
            total += ranks.shape[0] * ranks.shape[1]
    row = (hits / total).tolist()
    return [row for _ in range(depth)]


@torch.no_grad()
def medusa_cost(heads, hidden_size: int) -> float:
    """Seconds of one Medusa proposal: every head on one feature."""
    feature = torch.randn(1, hidden_size)
    return median_time(lambda: heads(feature[0]))


@torch.no_grad()
def eagle_cost(model, n_tokens: int = 4, past_len: int = 256) -> float:
    """Seconds of one EAGLE expansion depth: ``n_tokens`` frontier nodes through the drafter's layer and
    the target's lm_head, after ``past_len`` cached entries."""
    from transformers import DynamicCache

    h = model.fc.out_features
    cache = DynamicCache(config=model.layer_config)
    model(torch.zeros(1, past_len, dtype=torch.long), torch.zeros(1, past_len, h, dtype=model.dtype), cache=cache)
    tokens, features = torch.zeros(1, n_tokens, dtype=torch.long), torch.zeros(1, n_tokens, h, dtype=model.dtype)

    def depth():
        model.logits(model(tokens, features, cache=cache))
        cache.crop(-n_tokens)  # transformers 5: a negative count removes the newest entries

    return median_time(depth)


def draft_cost(draft) -> float:
    return forward_time(draft, n_tokens=2)


def run_from_config(cfg, out_dir) -> dict:
    """The scripts/compare_trees.py job: load target and drafters named in ``cfg``, compare, write outputs."""
    from omegaconf import OmegaConf

    from treespec.heads import DraftModel, PromptLookup
    from treespec.heads.base import ACCURACY_FILE
    from treespec.heads.medusa import Medusa, MedusaHeads
    from treespec.train.data import held_out_windows
    from treespec.train.heads import head_accuracy, load_target
    from treespec.train.log import RunLogger

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tree_specs = [OmegaConf.to_container(cfg.tree, resolve=True)] if cfg.get("tree") else \
        OmegaConf.to_container(cfg.trees, resolve=True)
    for spec in expand_specs(tree_specs):  # fail fast, before anything is measured
        if spec.get("kind") not in ("accuracy", "auto", "dynamic"):
            build_tree(spec)
    target, tokenizer = load_target(cfg.target)
    draft = load_target(cfg.draft)[0] if cfg.draft else None
    prompts = prompt_ids(cfg, tokenizer)

    @functools.cache
    def windows() -> torch.Tensor:  # [accuracy_windows, 256], loaded once, only if a drafter needs them
        return held_out_windows(tokenizer, 256, cfg.accuracy_windows, cfg.cache_dir)

    sampling = Sampling(cfg.temperature, cfg.top_p)

    def accuracies(folder: Path, measure, module) -> list[list[float]]:
        """At this run's sampling: a shipped drafter's file holds greedy ones; others are measured."""
        if sampling.greedy and (folder / ACCURACY_FILE).is_file():
            return json.loads((folder / ACCURACY_FILE).read_text())
        return measure(target, module, windows(), sampling=sampling)

    drafters = []
    for entry in cfg.drafters:
        # "eagle:sample" / "draft:sample": children drawn i.i.d. from the draft distribution at temperature > 0
        # (SpecInfer's rule) instead of top-k ranks; static trees only, and no predictions (they assume ranks)
        name, _, candidates = str(entry).partition(":")
        if candidates not in ("", "topk", "sample") or (candidates and name not in ("draft", "eagle")):
            raise ValueError(f"drafter {entry!r}: only draft and eagle take a candidates suffix, ':topk' or ':sample'")
        candidates = candidates or "topk"
        ranked = candidates == "topk"
        if name == "draft":
            if draft is None:
                raise ValueError("drafter 'draft' needs cfg.draft (a draft model)")
            accuracy = draft_model_accuracy(target, draft, windows(), sampling=sampling) if ranked else None
            drafters.append(DrafterSpec(entry, DraftModel(draft, candidates=candidates), accuracy,
                                        draft_cost_per_depth=draft_cost(draft)))
        elif name == "prompt_lookup":
            drafters.append(DrafterSpec("prompt_lookup", PromptLookup()))
        elif name == "medusa":
            folder = heads_folder(cfg.medusa)
            heads = MedusaHeads.from_pretrained(folder, target)
            accuracy = accuracies(folder, head_accuracy, heads)
            drafters.append(DrafterSpec("medusa", Medusa(heads), accuracy, max_depth=heads.num_heads,
                                        draft_cost_fixed=medusa_cost(heads, target.config.hidden_size)))
        elif name == "eagle":
            from treespec.heads.eagle import Eagle, EagleModel
            from treespec.train.eagle import depth_rank_accuracy

            folder = heads_folder(cfg.eagle)
            model = EagleModel.from_pretrained(folder, target)
            accuracy = accuracies(folder, depth_rank_accuracy, model) if ranked else None
            drafters.append(DrafterSpec(entry, Eagle(model, candidates=candidates), accuracy,
                                        draft_cost_per_depth=eagle_cost(model)))
        else:
            raise ValueError(f"unknown drafter {entry!r}; choose from draft, prompt_lookup, medusa, eagle "
                             "(draft and eagle also as draft:sample, eagle:sample)")
    logger = RunLogger(out_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project, name="compare-trees",
                       config=OmegaConf.to_container(cfg, resolve=True))
    result = run_comparison(target, drafters, tree_specs, prompts, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, top_p=cfg.top_p, repeats=cfg.repeats,
                            cost_sizes=tuple(cfg.cost_sizes), max_nodes=cfg.max_nodes, peers=cfg.peers,
                            assistant=draft, out_dir=out_dir, logger=logger)
    logger.finish()
    return result


def prompt_ids(cfg, tokenizer) -> list[torch.Tensor]:
    from treespec import reference

    texts = reference.prompts()[: cfg.prompts]
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def heads_folder(spec: str) -> Path:
    from treespec import reference

    return reference.MODELS_DIR / spec.split(":", 1)[1] if spec.startswith("reference:") else Path(spec)
