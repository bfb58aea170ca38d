"""Language-model pieces of training: build a Llama from a config, its loss, its evaluation."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.train.training import config_checks, distributed
from treespec.train.training.data import TokenBatches, eval_windows, prepare_tokens
from treespec.train.training.distributed import record
from treespec.train.training.log import RunLogger
from treespec.train.training.loop import OptimConfig, train


def build_llama(model_cfg: dict, vocab_size: int, tokenizer=None, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` from a plain dict of architecture values."""
    cfg = dict(model_cfg)
    cfg.pop("name", None)
    heads = cfg.pop("num_attention_heads")
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_attention_heads=heads,
        num_key_value_heads=cfg.pop("num_key_value_heads", heads),
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
        **cfg,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lm_loss(model, batch) -> tuple[torch.Tensor, dict]:
    """Next-token cross-entropy. batch: [b, s + 1] token ids, or a dict batch (train/training/data.py) whose loss mask
    selects the predicted tokens."""
    if torch.is_tensor(batch):
        logits = model(input_ids=batch[:, :-1]).logits  # [b, s, v]
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()), {}
    ids, mask = batch["input_ids"], batch.get("loss_mask")
    logits = model(input_ids=ids[:, :-1]).logits
    keep = mask[:, 1:].bool() if mask is not None else torch.ones_like(ids[:, 1:], dtype=torch.bool)
    return F.cross_entropy(logits[keep].float(), ids[:, 1:][keep]), {}


@torch.no_grad()
def evaluate_lm(model, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Mean validation loss and top-1 next-token accuracy over ``windows`` [n, s + 1]."""
    total_loss, total_correct, total = 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits.float()
        target = batch[:, 1:]
        total_loss += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        total_correct += (logits.argmax(-1) == target).sum().item()
        total += target.numel()
    return {"loss": total_loss / total, "top1": total_correct / total}


def fingerprint(model) -> dict:
    """What a checkpoint must match to be resumed into ``model``: its architecture values."""
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
    return {k: getattr(model.config, k, None) for k in keys}


def check_config(cfg) -> None:
    """What can be wrong in the config, raised before any data is tokenised or model built."""
    config_checks.check_job(cfg)
    config_checks.check_model(cfg.model)
    config_checks.check_export_dtype(cfg.export_dtype)
    if cfg.trainer.seq_len > cfg.model.max_position_embeddings:
        raise ValueError(f"trainer.seq_len={cfg.trainer.seq_len} exceeds model.max_position_embeddings="
                         f"{cfg.model.max_position_embeddings}")


@record
def run(cfg) -> dict:
    """The ``scripts/train_lm.py`` job: tokens → model → the training loop → exported model (every rank under
    torchrun; rank 0 writes and returns the summary)."""
    check_config(cfg)
    return distributed.run_job(cfg, _run)


def _run(cfg, ctx) -> dict:
    t = cfg.trainer
    corpus_cfg = OmegaConf.to_container(cfg.data.corpus, resolve=True)
    with distributed.rank0_first(ctx):  # rank 0 trains the tokenizer and encodes the corpus, the others read them
        tokenizer, train_tokens, val_tokens = prepare_tokens(corpus_cfg, cfg.data.vocab_size, cfg.data.cache_dir)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = build_llama(model_cfg, len(tokenizer), tokenizer, seed=cfg.seed).to(ctx.device)
    batches = TokenBatches(train_tokens, t.seq_len, t.batch_size, seed=cfg.seed)
    total_steps = t.max_steps or math.ceil(t.epochs * batches.steps_per_epoch)
    val = eval_windows(val_tokens, t.seq_len, t.eval_windows)
    if len(val) == 0:  # a small corpus's validation split: evaluating it would divide by zero tokens
        raise ValueError(f"the corpus's validation split holds {len(val_tokens)} tokens, less than one window of "
                         f"trainer.seq_len + 1 = {t.seq_len + 1}: raise data.corpus.val_fraction "
                         f"({cfg.data.corpus.val_fraction}) or lower trainer.seq_len")
    n_params = sum(p.numel() for p in model.parameters())
    if ctx.is_main:
        print(f"{cfg.model.name}: {n_params / 1e6:.2f}M parameters, {len(train_tokens)} train tokens, "
              f"{total_steps} steps of {t.batch_size}x{t.seq_len}"
              + (f", {ctx.world_size} ranks ({ctx.strategy})" if ctx.distributed else ""))

    forward = torch.compile(model) if t.compile else model
    logger = None
    if ctx.is_main:
        logger = RunLogger(cfg.run_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project,
                           name=f"lm-{cfg.model.name}", config=OmegaConf.to_container(cfg, resolve=True),
                           resume=cfg.resume)
    t0 = time.time()
    result = train(
        model, lambda batch: lm_loss(forward, batch), batches.batch,
        total_steps=total_steps, optim=OptimConfig(**cfg.optim), run_dir=cfg.run_dir,
        fingerprint={**fingerprint(model), "seq_len": t.seq_len, "batch_size": t.batch_size, "seed": cfg.seed,
                     "data": {"corpus": corpus_cfg, "vocab_size": cfg.data.vocab_size}},  # other data: no resume
        evaluate=lambda: evaluate_lm(forward, val), eval_every=t.eval_every, ckpt_every=t.ckpt_every,
        log_every=t.log_every, resume=cfg.resume, logger=logger, progress=t.progress,
        stop_after=t.stop_after, precision=t.precision, grad_accum=t.get("grad_accum", 1), seed=cfg.seed, dist=ctx,
    )
    if not ctx.is_main:
        return {}
    if result.full_state is not None:  # FSDP: export from an unsharded copy holding the trained weights
        model = build_llama(model_cfg, len(tokenizer), tokenizer, seed=cfg.seed)
        missing = model.load_state_dict(result.full_state, strict=False).missing_keys
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {id(params[k]) for k in result.full_state if k in params}
        if any(id(params.get(k)) not in loaded for k in missing):  # only tied copies (lm_head = embed) may be absent
            raise RuntimeError(f"the gathered FSDP state lacks {missing}")
    summary = {
        "model": cfg.model.name, "parameters": n_params, "steps": result.step, "total_steps": total_steps,
        "tokens_seen": result.tokens_seen, "epochs": result.tokens_seen / len(train_tokens),
        "train_tokens": len(train_tokens), "val_tokens": len(val_tokens), "train_wall_time_s": result.wall_time,
        "session_wall_time_s": time.time() - t0, "train_loss": result.train_loss, "world_size": ctx.world_size,
        **{f"val_{k}": v for k, v in result.eval_metrics.items()},
    }
    if result.step >= total_steps:
        export = Path(cfg.export_dir)
        model.cpu().to(getattr(torch, cfg.export_dtype)).save_pretrained(export)
        tokenizer.save_pretrained(export)
        summary["export_dir"] = str(export)
    logger.summary(summary)
    logger.finish()
    return summary
