"""The drafter-training job (``scripts/train_heads.py drafter=medusa|eagle``): data (self-distilled by
default), the training loop, export with per-depth rank accuracies, and an end-of-run decoding evaluation
whose per-step acceptance lengths are logged (histogram + mean) with tokens/s against vanilla decoding.

What differs per drafter is its ``Recipe`` (train/recipe.py), found by the drafter's registry name.
"""

from __future__ import annotations

import json
import math
import time

import torch
from omegaconf import OmegaConf

from treespec.autotree import auto_chooser, measure_cost_curve
from treespec.bench import Config, measure
from treespec.reference import load_model
from treespec.tree_spec import build_tree, check_tree_spec

from . import eagle, eagle3, medusa
from .data import TokenBatches, eval_windows, prepare_tokens, self_distill
from .lm import fingerprint
from .log import RunLogger
from .loop import OptimConfig, train

RECIPES = {"medusa": medusa.recipe, "eagle": eagle.recipe, "eagle3": eagle3.recipe}  # registry name → recipe


def eval_tree_spec(cfg):
    """The end-of-run evaluation's tree spec: ``tree=...`` when given, else the drafter's eval_tree."""
    spec = cfg.get("tree") or cfg.drafter.get("eval_tree")
    return OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec


def check_config(cfg) -> None:
    """Everything that can be wrong in the config, raised before any model is loaded or trained."""
    if cfg.drafter.name not in RECIPES:
        raise ValueError(f"drafter={cfg.drafter.name!r} cannot be trained; trainable drafters: {', '.join(RECIPES)}")
    spec = eval_tree_spec(cfg)
    if spec is None:
        raise ValueError("no evaluation tree: set tree=... or the drafter's eval_tree")
    check_tree_spec(spec)


def training_tokens(cfg, target, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams; the train stream is self-distilled when the data config asks."""
    corpus_cfg = OmegaConf.to_container(cfg.data.corpus, resolve=True)
    _, train_tokens, val_tokens = prepare_tokens(corpus_cfg, len(tokenizer), cfg.data.cache_dir, tokenizer=tokenizer)
    if cfg.data.get("self_distill"):
        sd = cfg.data.self_distill
        t0 = time.time()
        train_tokens = self_distill(target, train_tokens, n_prompts=sd.prompts, prompt_tokens=sd.prompt_tokens,
                                    new_tokens=sd.new_tokens, temperature=sd.temperature, batch_size=sd.batch_size,
                                    seed=cfg.seed, cache_dir=cfg.data.cache_dir, eos_token_id=tokenizer.eos_token_id)
        print(f"self-distillation data: {len(train_tokens)} tokens ({time.time() - t0:.0f} s)")
    return train_tokens, val_tokens


def decoding_eval(cfg, target, recipe, accuracy, val_tokens) -> tuple[dict, list[int]]:
    """Decode held-out windows with the trained drafter on the evaluation tree, against vanilla."""
    e, spec = cfg.eval, eval_tree_spec(cfg)
    choose = auto_chooser(measure_cost_curve(target)) if spec.get("kind") == "auto" else None
    tree = build_tree(spec, accuracy=accuracy, choose=choose)
    prompts = [w[None, : e.prompt_tokens] for w in eval_windows(val_tokens, e.prompt_tokens, e.prompts)]
    rows = measure(target, [Config(cfg.drafter.name, recipe.drafter(), tree)], prompts,
                   max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=cfg.seed)
    drafter_row = rows[-1]
    return {"eval_tree_nodes": len(tree), "eval_mean_accept_length": drafter_row.tau,
            "eval_tokens_per_s": drafter_row.tokens_per_s, "eval_vanilla_tokens_per_s": rows[0].tokens_per_s,
            "eval_speedup": drafter_row.speedup}, drafter_row.accept_lengths


def run(cfg) -> dict:
    """The ``scripts/train_heads.py`` job."""
    check_config(cfg)
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    target, tokenizer = load_model(cfg.target)
    for p in target.parameters():
        p.requires_grad_(False)
    train_tokens, val_tokens = training_tokens(cfg, target, tokenizer)

    d = cfg.drafter
    torch.manual_seed(cfg.seed)
    recipe = RECIPES[d.name](cfg, target, train_tokens)
    module = recipe.module
    batches = TokenBatches(train_tokens, t.seq_len, t.batch_size, seed=cfg.seed)
    total_steps = t.max_steps or math.ceil(t.epochs * batches.steps_per_epoch)
    val = eval_windows(val_tokens, t.seq_len, t.eval_windows)
    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"{d.name}: {recipe.description}, {n_params / 1e6:.2f}M trainable parameters, {total_steps} steps")

    logger = RunLogger(cfg.run_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project,
                       name=f"heads-{d.name}", config=OmegaConf.to_container(cfg, resolve=True), resume=cfg.resume)
    result = train(
        module, recipe.loss, batches.batch,
        total_steps=total_steps, optim=OptimConfig(**cfg.optim), run_dir=cfg.run_dir,
        fingerprint={**module.config, "target": fingerprint(target), "seq_len": t.seq_len, "seed": cfg.seed},
        evaluate=lambda: recipe.evaluate(val),
        eval_every=t.eval_every, ckpt_every=t.ckpt_every, log_every=t.log_every, resume=cfg.resume,
        logger=logger, progress=t.progress, stop_after=t.stop_after, precision=t.precision,
    )
    summary = {"drafter": d.name, "trainable_parameters": n_params, "steps": result.step,
               "tokens_seen": result.tokens_seen, "train_wall_time_s": result.wall_time,
               "train_loss": result.train_loss}
    if result.step >= total_steps:
        final_metrics, accuracy = recipe.export(val, cfg.export_dir)
        summary.update(final_metrics)
        eval_metrics, accept_lengths = decoding_eval(cfg, target, recipe, accuracy, val_tokens)
        summary.update(eval_metrics)
        logger.histogram("eval/accept_length", accept_lengths, step=result.step)
        logger.log({**eval_metrics, **final_metrics}, step=result.step)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith("eval_") or "_top" in k}, indent=1))
    logger.summary(summary)
    logger.finish()
    return summary
