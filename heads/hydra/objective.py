"""Training Hydra heads on a frozen target (``scripts/train_heads.py drafter=hydra``).

Hydra (Ankner et al. 2024) trains as Medusa-1 does, the backbone frozen, with one difference that is the method:
head k at position t is teacher forced on the path the data continues with, t + 1 .. t + k + 1, so it learns the
token after a path, not after a context alone (heads/hydra/drafter.py's ``head_outputs``). The loss is
Σ_k decay^k · L_k over the positions whose next token is trained on (chat data: its loss mask), with L_k

* ``distill: false``: cross-entropy against the data's token t + k + 2 (Hydra);
* ``distill: true``: Hydra++'s teacher distillation, the cross-entropy against the target's own distribution at
  t + k + 1 (soft labels, the KL to the target up to its entropy): the heads learn what the target would say after
  that path, every token's probability, not one sample of it. On self-distilled data (the default) the data's
  tokens are themselves target samples; distillation then removes the sampling noise from the labels.

The prefix-attention layer (``prefix_attention``) trains with the heads, run causally over each window's hidden
states: what the drafter's cache over the committed positions computes during decoding. In a packed batch
(heads/training/segments.py) it and the target attend inside each conversation, and head k at t is scored only where
t and
t + k + 2 lie in one conversation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.heads.hydra.drafter import Hydra, head_outputs, rank_accuracy
from treespec.heads.hydra.network import HydraHeads
from treespec.heads.training.accuracy import accuracy_metrics
from treespec.heads.training.batches import batch_parts, shifted_mask
from treespec.heads.training.objective import Recipe, mean_metrics
from treespec.heads.training.segments import packed_positions, segment_ids
from treespec.heads.training.target_states import target_hidden


def hydra_loss(target, heads: HydraHeads, batch, decay: float, distill: bool) -> tuple[torch.Tensor, dict]:
    """batch [b, s + 1] (or a dict batch, heads/training/batches.py). Head k at t, its path batch[t + 1 .. t + k +
    1], is scored
    on token t + k + 2 (``distill``: on the target's distribution after that path)."""
    positions = packed_positions(batch, heads.device)
    batch, loss_mask, target = batch_parts(batch, target, heads.device)
    _, hidden = target_hidden(target, batch[:, :-1])  # [b, s, h]
    teacher = target.get_output_embeddings()(hidden) if distill else None  # [b, s, V]: the target's after t
    s = hidden.shape[1]
    # packed: per-conversation positions with no cache and no mask, so the prefix layer's attention stays inside
    base = heads.base(hidden.to(heads.dtype), position_ids=None if positions is None else positions[:, :s])  # [b, s, h]
    segments = None if positions is None else segment_ids(positions)
    total, metrics = 0.0, {}
    for k, x in enumerate(head_outputs(heads, base, batch)):  # x [b, s - k - 1, h]
        n = s - k - 1
        keep = (torch.ones(batch.shape[0], n, dtype=torch.bool, device=batch.device) if loss_mask is None
                else shifted_mask(loss_mask, k + 2, n, segments))  # [b, n]
        if not bool(keep.any()):
            term = x.sum() * 0.0
            total = total + term
            continue
        # the vocabulary projection on the scored rows only: a [b, s, V] stack per head dominates a CPU step
        log_q = F.log_softmax(heads.project(k, x[keep]).float(), dim=-1)  # [m, V]
        labels = batch[:, k + 2 :][keep]  # [m]
        ce = F.nll_loss(log_q, labels)
        metrics[f"ce_head{k}"] = ce.item()
        metrics[f"top1_head{k}"] = (log_q.argmax(-1) == labels).float().mean().item()
        term = ce
        if distill:
            p = F.softmax(teacher[:, k + 1 :][keep].float(), dim=-1)  # [m, V]
            term = -(p * log_q).sum(-1).mean()
            metrics[f"distill_head{k}"] = term.item()
        total = total + decay**k * term
    return total, metrics


def recipe(cfg, target, train_tokens=None) -> Recipe:
    d = cfg.drafter
    heads = HydraHeads(target, num_heads=d.num_heads, num_layers=d.num_layers, share_lm_head=d.share_lm_head,
                       prefix_attention=d.prefix_attention)

    def loss(batch):
        return hydra_loss(target, heads, batch, d.loss_decay, d.distill)

    def evaluate(val):
        if torch.is_tensor(val):
            return accuracy_metrics(rank_accuracy(target, heads, val, top_k=5))
        return mean_metrics(loss, val, 8)

    parts = [f"{d.num_heads} heads of {d.num_layers} block(s)", "prefix attention" if d.prefix_attention else None,
             "teacher distillation" if d.distill else None]
    return Recipe(heads, loss, evaluate, lambda val: rank_accuracy(target, heads, val),
                  lambda: Hydra(heads, lean=d.get("lean", True)), ", ".join(p for p in parts if p))
