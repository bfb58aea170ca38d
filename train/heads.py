"""Training drafters on a frozen target (``scripts/train_heads.py drafter=medusa`` or ``drafter=eagle``).

run() is shared: data (self-distilled by default), the training loop, export and the end-of-run decoding
evaluation; a ``Recipe`` supplies what differs per drafter (module, loss, metrics, export). The EAGLE
recipe lives in train/eagle.py; Medusa's is below.

Medusa-1 recipe (Cai et al. 2024): the backbone is frozen; head k learns token t+k+2 from the target's
final hidden state at t with loss Σ_k w_k · CE_k, w_k = decay^k. Data is corpus text or, by default,
self-distillation: continuations the target itself sampled from corpus prompts. After training the
heads' per-depth top-k accuracies are measured on held-out text; they drive accuracy-built trees
(treespec.policy) and the run ends with a decoding evaluation whose per-step acceptance lengths are
logged (histogram + mean) with tokens/s against vanilla decoding.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from treespec.sampling import GREEDY, Sampling
from treespec.verify import rank_acceptance

TOP_K = 10  # ranks measured per head for accuracy-driven trees


def load_target(spec: str, dtype=torch.float32):
    """``reference:<name>`` (a shipped model) or a transformers model folder → (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith("reference:"):
        from treespec import reference

        return reference.load(spec.split(":", 1)[1], dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(spec)


def target_features(target, input_ids: torch.Tensor) -> torch.Tensor:
    """Final (post-norm) hidden states [b, s, h], without computing the target's logits."""
    with torch.no_grad():
        return target.base_model(input_ids=input_ids).last_hidden_state


def medusa_loss(target, heads, batch: torch.Tensor, decay: float) -> tuple[torch.Tensor, dict]:
    """batch [b, s + 1]. Head k at position t is scored on token t + k + 2."""
    hidden = target_features(target, batch[:, :-1])  # [b, s, h]
    logits = heads(hidden)  # [K, b, s, V]
    s = hidden.shape[1]
    total, metrics = 0.0, {}
    for k in range(heads.num_heads):
        ce = F.cross_entropy(logits[k, :, : s - k - 1].flatten(0, 1).float(), batch[:, k + 2 :].flatten())
        total = total + decay**k * ce
        metrics[f"ce_head{k}"] = ce.item()
    return total, metrics


@torch.no_grad()
def head_accuracy(target, heads, windows: torch.Tensor, top_k: int = TOP_K, batch_size: int = 8,
                  sampling: Sampling = GREEDY) -> list[list[float]]:
    """acc[k][r]: the chance that head k's rank-r token at t is the token t + k + 2 the target emits
    (``verify.rank_acceptance``; greedy: the target's argmax), teacher forced on ``windows`` [n, s + 1]
    (ranks mutually exclusive, as analysis.grow_tree expects). The walker accepts the target's own
    choices, not the corpus's, so that is what the heads are scored against."""
    hits = torch.zeros(heads.num_heads, top_k)
    counts = torch.zeros(heads.num_heads)
    for batch in windows.split(batch_size):
        hidden = target_features(target, batch[:, :-1])  # [b, s, h]
        target_logits = target.get_output_embeddings()(hidden)  # [b, s, V]: the target's token t + 1
        logits = heads(hidden)  # [K, b, s, V]
        s = hidden.shape[1]
        for k in range(heads.num_heads):
            top = logits[k, :, : s - k - 1].topk(top_k, dim=-1).indices  # [b, s-k-1, R]
            hits[k] += rank_acceptance(top, target_logits[:, k + 1 :], sampling).flatten(0, 1).sum(0)
            counts[k] += top.shape[0] * top.shape[1]
    return (hits / counts[:, None]).tolist()


def accuracy_metrics(acc: list[list[float]]) -> dict:
    return {m: v for k, row in enumerate(acc) for m, v in
            ((f"head{k}_top1", row[0]), (f"head{k}_top5", sum(row[:5])))}


@dataclass
class Recipe:
    """What run() needs to know about one kind of drafter."""

    module: torch.nn.Module                              # the trainable drafter
    loss: Callable[[torch.Tensor], tuple]                # batch → (loss, metrics)
    evaluate: Callable[[torch.Tensor], dict]             # validation windows → metrics, during training
    finish: Callable[[torch.Tensor, str], tuple]         # (windows, export dir) → (metrics, tree accuracy); exports
    drafter: Callable[[], object]                        # the trained module as a treespec Drafter
    description: str


def medusa_recipe(cfg, target) -> Recipe:
    from treespec.heads.base import ACCURACY_FILE, vocab_size_of
    from treespec.heads.medusa import Medusa, MedusaHeads

    d = cfg.drafter
    heads = MedusaHeads(target.config.hidden_size, vocab_size_of(target), num_heads=d.num_heads,
                        num_layers=d.num_layers, share_lm_head=d.share_lm_head, lm_head=target.get_output_embeddings())

    def finish(val, export_dir):
        acc = head_accuracy(target, heads, val)
        heads.save_pretrained(export_dir)
        (Path(export_dir) / ACCURACY_FILE).write_text(json.dumps(acc))
        return accuracy_metrics(acc), acc

    return Recipe(heads, lambda batch: medusa_loss(target, heads, batch, d.loss_decay),
                  lambda val: accuracy_metrics(head_accuracy(target, heads, val, top_k=5)), finish,
                  lambda: Medusa(heads), f"{d.num_heads} heads")


def training_tokens(cfg, target, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams; the train stream is self-distilled when the data config asks."""
    from omegaconf import OmegaConf

    from .data import prepare_tokens, self_distill
    from .lm import fingerprint

    corpus_cfg = OmegaConf.to_container(cfg.data.corpus, resolve=True)
    _, train_tokens, val_tokens = prepare_tokens(corpus_cfg, len(tokenizer), cfg.data.cache_dir, tokenizer=tokenizer)
    if cfg.data.get("self_distill"):
        sd = cfg.data.self_distill
        key = json.dumps({"target": cfg.target, **OmegaConf.to_container(sd), "seed": cfg.seed,
                          "n": len(train_tokens), "fp": fingerprint(target)}, sort_keys=True)
        path = Path(cfg.data.cache_dir) / f"distill-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt"
        t0 = time.time()
        train_tokens = self_distill(target, train_tokens, n_prompts=sd.prompts, prompt_tokens=sd.prompt_tokens,
                                    new_tokens=sd.new_tokens, temperature=sd.temperature, batch_size=sd.batch_size,
                                    seed=cfg.seed, cache_path=path, eos_token_id=tokenizer.eos_token_id)
        print(f"self-distillation data: {len(train_tokens)} tokens ({time.time() - t0:.0f} s, cached at {path})")
    return train_tokens, val_tokens


def run(cfg) -> dict:
    """The ``scripts/train_heads.py`` job."""
    from omegaconf import OmegaConf

    from treespec.bench import Config, measure
    from treespec.policy import build_tree

    from .data import TokenBatches, eval_windows
    from .eagle import eagle_recipe
    from .lm import fingerprint
    from .log import RunLogger
    from .loop import OptimConfig, train

    recipes = {"medusa": medusa_recipe, "eagle": eagle_recipe}
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    if cfg.drafter.name not in recipes:
        raise ValueError(f"drafter={cfg.drafter.name!r} cannot be trained yet; available: {', '.join(recipes)}")
    target, tokenizer = load_target(cfg.target)
    for p in target.parameters():
        p.requires_grad_(False)
    train_tokens, val_tokens = training_tokens(cfg, target, tokenizer)

    d = cfg.drafter
    torch.manual_seed(cfg.seed)
    recipe = recipes[d.name](cfg, target)
    module = recipe.module
    batches = TokenBatches(train_tokens, t.seq_len, t.batch_size, seed=cfg.seed)
    total_steps = t.max_steps or math.ceil(t.epochs * batches.steps_per_epoch)
    val = eval_windows(val_tokens, t.seq_len, t.eval_windows)
    n_params = sum(p.numel() for p in module.parameters())
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
        final_metrics, accuracy = recipe.finish(val, cfg.export_dir)
        summary.update(final_metrics)
        # Decoding evaluation: acceptance length per step (histogram + mean) and tokens/s vs vanilla.
        e = cfg.eval
        tree = build_tree(OmegaConf.to_container(cfg.tree, resolve=True), accuracy=accuracy)
        prompts = [w[None, : e.prompt_tokens] for w in eval_windows(val_tokens, e.prompt_tokens, e.prompts)]
        rows = measure(target, [Config(d.name, recipe.drafter(), tree)], prompts, max_new_tokens=e.max_new_tokens,
                       temperature=e.temperature, seed=cfg.seed)
        drafter_row = rows[-1]
        logger.histogram("eval/accept_length", drafter_row.accept_lengths, step=result.step)
        summary.update({"eval_tree_nodes": len(tree), "eval_mean_accept_length": drafter_row.tau,
                        "eval_tokens_per_s": drafter_row.tokens_per_s,
                        "eval_vanilla_tokens_per_s": rows[0].tokens_per_s, "eval_speedup": drafter_row.speedup})
        logger.log({k: v for k, v in summary.items() if k.startswith("eval_") or k in final_metrics}, step=result.step)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith("eval_") or "_top" in k}, indent=1))
    logger.summary(summary)
    logger.finish()
    return summary
