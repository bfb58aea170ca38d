"""Training draft heads on a frozen target (``scripts/train_heads.py drafter=medusa``).

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
from pathlib import Path

import torch
import torch.nn.functional as F

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
def head_accuracy(target, heads, windows: torch.Tensor, top_k: int = TOP_K, batch_size: int = 8) -> list[list[float]]:
    """acc[k][r]: how often head k's rank-r token is the true token t+k+2 on ``windows`` [n, s + 1]
    (mutually exclusive across r, as analysis.grow_tree expects)."""
    hits = torch.zeros(heads.num_heads, top_k)
    counts = torch.zeros(heads.num_heads)
    for batch in windows.split(batch_size):
        hidden = target_features(target, batch[:, :-1])
        logits = heads(hidden)  # [K, b, s, V]
        s = hidden.shape[1]
        for k in range(heads.num_heads):
            top = logits[k, :, : s - k - 1].topk(top_k, dim=-1).indices  # [b, s-k-1, R]
            truth = batch[:, k + 2 :, None]
            hits[k] += (top == truth).flatten(0, 1).float().sum(0)
            counts[k] += truth.numel()
    return (hits / counts[:, None]).tolist()


def accuracy_metrics(acc: list[list[float]]) -> dict:
    return {m: v for k, row in enumerate(acc) for m, v in
            ((f"head{k}_top1", row[0]), (f"head{k}_top5", sum(row[:5])))}


def run(cfg) -> dict:
    """The ``scripts/train_heads.py`` job."""
    from omegaconf import OmegaConf

    from treespec.bench import Config, measure
    from treespec.heads.base import vocab_size_of
    from treespec.heads.medusa import Medusa, MedusaHeads
    from treespec.policy import build_tree

    from .data import TokenBatches, eval_windows, prepare_tokens, self_distill
    from .lm import fingerprint
    from .log import RunLogger
    from .loop import OptimConfig, train

    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    if cfg.drafter.name != "medusa":
        raise ValueError(f"drafter={cfg.drafter.name!r} cannot be trained yet; available: medusa")
    target, tokenizer = load_target(cfg.target)
    for p in target.parameters():
        p.requires_grad_(False)
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

    d = cfg.drafter
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(target.config.hidden_size, vocab_size_of(target), num_heads=d.num_heads,
                        num_layers=d.num_layers, share_lm_head=d.share_lm_head, lm_head=target.get_output_embeddings())
    batches = TokenBatches(train_tokens, t.seq_len, t.batch_size, seed=cfg.seed)
    total_steps = t.max_steps or math.ceil(t.epochs * batches.steps_per_epoch)
    val = eval_windows(val_tokens, t.seq_len, t.eval_windows)
    n_params = sum(p.numel() for p in heads.parameters())
    print(f"medusa: {d.num_heads} heads, {n_params / 1e6:.2f}M trainable parameters, {total_steps} steps")

    logger = RunLogger(cfg.run_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project,
                       name=f"heads-{d.name}", config=OmegaConf.to_container(cfg, resolve=True), resume=cfg.resume)
    result = train(
        heads, lambda batch: medusa_loss(target, heads, batch, d.loss_decay), batches.batch,
        total_steps=total_steps, optim=OptimConfig(**cfg.optim), run_dir=cfg.run_dir,
        fingerprint={**heads.config, "target": fingerprint(target), "seq_len": t.seq_len, "seed": cfg.seed},
        evaluate=lambda: accuracy_metrics(head_accuracy(target, heads, val, top_k=5)),
        eval_every=t.eval_every, ckpt_every=t.ckpt_every, log_every=t.log_every, resume=cfg.resume,
        logger=logger, progress=t.progress, stop_after=t.stop_after, precision=t.precision,
    )
    summary = {"drafter": d.name, "trainable_parameters": n_params, "steps": result.step,
               "tokens_seen": result.tokens_seen, "train_wall_time_s": result.wall_time,
               "train_loss": result.train_loss}
    if result.step >= total_steps:
        acc = head_accuracy(target, heads, val)
        summary.update(accuracy_metrics(acc))
        heads.save_pretrained(cfg.export_dir)
        (Path(cfg.export_dir) / "head_accuracy.json").write_text(json.dumps(acc))
        # Decoding evaluation: acceptance length per step (histogram + mean) and tokens/s vs vanilla.
        e = cfg.eval
        tree = build_tree(OmegaConf.to_container(cfg.tree, resolve=True), accuracy=acc)
        prompts = [w[None, : e.prompt_tokens] for w in eval_windows(val_tokens, e.prompt_tokens, e.prompts)]
        rows = measure(target, [Config("medusa", Medusa(heads), tree)], prompts, max_new_tokens=e.max_new_tokens,
                       temperature=e.temperature, seed=cfg.seed)
        medusa_row = rows[-1]
        logger.histogram("eval/accept_length", medusa_row.accept_lengths, step=result.step)
        summary.update({"eval_tree_nodes": len(tree), "eval_mean_accept_length": medusa_row.tau,
                        "eval_tokens_per_s": medusa_row.tokens_per_s, "eval_vanilla_tokens_per_s": rows[0].tokens_per_s,
                        "eval_speedup": medusa_row.speedup})
        logger.log({k: v for k, v in summary.items() if k.startswith("eval_") or "head" in k}, step=result.step)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith("eval_") or "_top" in k}, indent=1))
    logger.summary(summary)
    logger.finish()
    return summary
