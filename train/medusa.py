"""Training Medusa heads on a frozen target (``scripts/train_heads.py drafter=medusa``).

Medusa-1 recipe (Cai et al. 2024): the backbone is frozen; head k learns token t+k+2 from the target's
final hidden state at t with loss Σ_k w_k · CE_k, w_k = decay^k. Data is corpus text or, by default,
self-distillation: continuations the target itself sampled from corpus prompts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.drafter import target_hidden
from treespec.heads.accuracy import accuracy_metrics
from treespec.heads.checkpoint import vocab_size_of
from treespec.heads.medusa import Medusa, MedusaHeads, rank_accuracy

from .recipe import Recipe


def medusa_loss(target, heads: MedusaHeads, batch: torch.Tensor, decay: float) -> tuple[torch.Tensor, dict]:
    """batch [b, s + 1]. Head k at position t is scored on token t + k + 2."""
    _, hidden = target_hidden(target, batch[:, :-1])  # [b, s, h]
    logits = heads(hidden)  # [K, b, s, V]
    s = hidden.shape[1]
    total, metrics = 0.0, {}
    for k in range(heads.num_heads):
        ce = F.cross_entropy(logits[k, :, : s - k - 1].flatten(0, 1).float(), batch[:, k + 2 :].flatten())
        total = total + decay**k * ce
        metrics[f"ce_head{k}"] = ce.item()
    return total, metrics


def recipe(cfg, target, train_tokens=None) -> Recipe:
    d = cfg.drafter
    heads = MedusaHeads(target.config.hidden_size, vocab_size_of(target), num_heads=d.num_heads,
                        num_layers=d.num_layers, share_lm_head=d.share_lm_head, lm_head=target.get_output_embeddings())
    return Recipe(heads, lambda batch: medusa_loss(target, heads, batch, d.loss_decay),
                  lambda val: accuracy_metrics(rank_accuracy(target, heads, val, top_k=5)),
                  lambda val: rank_accuracy(target, heads, val), lambda: Medusa(heads), f"{d.num_heads} heads")
