"""Training Medusa heads on a frozen target (``scripts/train_heads.py drafter=medusa``).

Medusa-1 recipe (Cai et al. 2024): the backbone is frozen; head k learns token t+k+2 from the target's
final hidden state at t with loss Σ_k w_k · CE_k, w_k = decay^k. Data is corpus text or, by default,
self-distillation: continuations the target itself sampled from corpus prompts. With a loss mask (chat
data) head k at t is scored only where token t + k + 2 is trained on; in a packed batch (heads/training/segments.py)
only
where t and t + k + 2 lie in one conversation, the target's attention kept inside each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.medusa.drafter import Medusa, rank_accuracy
from treespec.heads.medusa.network import MedusaHeads
from treespec.heads.training.accuracy import accuracy_metrics
from treespec.heads.training.batches import batch_parts, shifted_mask, split_batch
from treespec.heads.training.objective import Recipe
from treespec.heads.training.segments import packed_segments
from treespec.heads.training.target_states import target_hidden


def medusa_loss(target, heads: MedusaHeads, batch, decay: float) -> tuple[torch.Tensor, dict]:
    """batch [b, s + 1] (or a dict batch, train/training/data.py). Head k at position t is scored on token t + k + 2."""
    device = next(heads.parameters()).device
    segments = packed_segments(batch, device)
    batch, loss_mask, target = batch_parts(batch, target, device)
    _, hidden = target_hidden(target, batch[:, :-1])  # [b, s, h]
    return heads_loss(heads, hidden, batch, loss_mask, decay, segments=segments)


def heads_loss(heads: MedusaHeads, hidden: torch.Tensor, batch: torch.Tensor, loss_mask: torch.Tensor | None,
               decay: float, projections=None, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Σ_k decay^k · CE_k of the heads on ``hidden`` [b, s, h], the target's last hidden states over
    ``batch[:, :-1]`` (batch [b, s + 1]); ``loss_mask`` [b, s + 1] or None; ``projections``: the heads'
    vocabulary projections in place of their own (``MedusaHeads.forward``); ``segments`` [b, s + 1]: a packed
    batch's conversations (heads/training/segments.py)."""
    # each head's vocabulary projection runs on the rows it is scored on only: with chat data most rows are
    # prompt or padding, and a [K, b, s, V] stack of full-vocabulary logits dominates a CPU step
    projections = projections or heads.projections or [heads.shared_lm_head] * heads.num_heads
    outs = heads.blocks_out(hidden)  # [K, b, s, h]
    s = hidden.shape[1]
    total, metrics = 0.0, {}
    for k in range(heads.num_heads):
        keep = (torch.ones_like(batch[:, k + 2 :], dtype=torch.bool) if loss_mask is None
                else shifted_mask(loss_mask, k + 2, s - k - 1, segments))  # [b, s - k - 1]
        if bool(keep.any()):
            logits = projections[k](outs[k, :, : s - k - 1][keep])  # [n, V]
            ce = F.cross_entropy(logits.float(), batch[:, k + 2 :][keep])
        else:
            ce = outs[k].sum() * 0.0
        total = total + decay**k * ce
        metrics[f"ce_head{k}"] = ce.item()
    return total, metrics


@torch.no_grad()
def medusa_metrics(target, heads: MedusaHeads, batch, decay: float, batch_size: int = 8) -> dict:
    """The training metrics (per-head CE) averaged over a dict batch (chat data: masked)."""
    pieces = split_batch(batch, batch_size)
    totals: dict[str, float] = {}
    for piece in pieces:
        for k, v in medusa_loss(target, heads, piece, decay)[1].items():
            totals[k] = totals.get(k, 0.0) + v / len(pieces)
    return totals


def recipe(cfg, target, train_tokens=None) -> Recipe:
    d = cfg.drafter
    heads = MedusaHeads(target.config.hidden_size, vocab_size_of(target), num_heads=d.num_heads,
                        num_layers=d.num_layers, share_lm_head=d.share_lm_head, lm_head=target.get_output_embeddings())
    def evaluate(val):
        if torch.is_tensor(val):
            return accuracy_metrics(rank_accuracy(target, heads, val, top_k=5))
        return medusa_metrics(target, heads, val, d.loss_decay)

    return Recipe(heads, lambda batch: medusa_loss(target, heads, batch, d.loss_decay), evaluate,
                  lambda val: rank_accuracy(target, heads, val), lambda: Medusa(heads), f"{d.num_heads} heads")
