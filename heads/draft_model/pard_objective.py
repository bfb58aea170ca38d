"""Adapting a trained draft model into a PARD model (``scripts/train_heads.py drafter=pard``; An et al. 2026), the
draft model's distillation (heads/draft_model/objective.py) extended to the masks a PARD pass is fed.

**Start.** PARD adapts an existing draft model: ``drafter.source`` (reference:draft by default) is loaded as it is,
its vocabulary checked against the target's, and its config records the PARD settings (``parallel`` k, the mask
token: heads/draft_model/parallel.py), so the exported folder drafts k depths in one pass wherever it is loaded.

**What one window trains, in one forward** (``parallel.anchored_hidden``). The window's tokens attend causally as
in the draft's own training: every position is trained at depth 1, the plain next-token distillation, so the model
stays a draft model. Then, for up to ``anchors`` anchors a per window (drawn as DFlash's are, among the positions
whose next token is trained on: heads/training/anchors.py), k − 1 masks at positions a + 1 .. a + k − 1 that see the
window's tokens <= a (of a's conversation in a packed batch) and their own block's earlier masks only, as decoding
feeds them after the root a; mask j predicts the token x_{a+j+1}. PARD's own training anchors every position and
then drops mask blocks at random ("conditional drop", down to a fraction of them) to keep the pass short: drawing
a fixed number of anchors per window is that drop with a fixed rate, and every block here keeps all k − 1 masks.

**Loss.** Every scored prediction (depth 1 at every position whose next token is trained on, and every mask whose
token lies in the window, is trained on and in a's conversation) weighs the same: the forward KL(p_target ‖ q_draft)
from the target's teacher-forced distribution at the position before the predicted token, plus ``ce_weight`` × the
cross-entropy of the data's token. Metrics: ``kl`` and ``top1`` (depth 1, as the draft model's recipe logs them),
each depth's ``kl{d}`` and ``top1_{d}`` (agreement with the target's argmax), and ``tau``: 1 + the mean count of
leading depths of an anchor's block whose argmax is the target's, what greedy decoding of the k depths as a chain
accepts.

The anchors come from torch's global generator, which the training loop reseeds from (seed, step, micro-batch), and
the draft draws no other random numbers: a resumed run is exactly the uninterrupted one. Evaluation draws from a
fixed seed.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from treespec.heads.checkpoints.drafter_folder import check_same_vocab
from treespec.heads.draft_model.objective import check_weight_and_export, saver
from treespec.heads.draft_model.parallel import (
    ParallelDraft,
    anchored_hidden,
    mark_pard,
    pard_settings,
    rank_accuracy,
    vocab_rows,
)
from treespec.heads.training.anchors import anchor_positions, sample_anchors
from treespec.heads.training.batches import batch_parts, shifted_mask
from treespec.heads.training.objective import Recipe, mean_metrics
from treespec.heads.training.segments import packed_positions, segment_ids
from treespec.heads.training.target_states import target_hidden
from treespec.layer_types import attention_layers, is_hybrid
from treespec.reference import load_model


def pard_loss(target, model, batch, *, parallel: int, mask_token_id: int, anchors: int = 32, ce_weight: float = 0.0,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """batch: [b, S] windows or a dict batch (heads/training/batches.py) → (the mean KL + ce_weight · CE over every
    scored prediction, metrics) (module docstring)."""
    positions = packed_positions(batch, model.device)
    ids, loss_mask, target = batch_parts(batch, target, model.device)
    b, s = ids.shape
    n, masks = s - 1, parallel - 1  # position j < n predicts token j + 1
    segments = None if positions is None else segment_ids(positions)
    chosen, real = sample_anchors(anchor_positions(ids, loss_mask, segments), anchors, generator)  # [b, m], a <= n − 1
    hidden = anchored_hidden(model, ids[:, :n], chosen, parallel, mask_token_id,
                             None if positions is None else positions[:, :n],
                             None if segments is None else segments[:, :n])  # [b, n + m(k − 1), h]
    _, last = target_hidden(target, ids[:, :n])  # [b, n, H], no grad
    # depth 1: every position whose next token is scored
    plain = (torch.ones(b, n, dtype=torch.bool, device=ids.device) if loss_mask is None
             else shifted_mask(loss_mask, 1, n, segments))  # [b, n]
    # mask j of anchor a: the token a + j + 1, the target's distribution at a + j
    at = chosen[:, :, None] + torch.arange(1, parallel, device=ids.device)  # [b, m, k − 1]
    clamped = at.clamp(max=n - 1)
    scored = (at < n) & real[:, :, None]
    if loss_mask is not None:
        scored &= loss_mask.bool().gather(1, (clamped + 1).flatten(1)).view_as(at)
    if segments is not None:
        scored &= segments.gather(1, (clamped + 1).flatten(1)).view_as(at) == segments.gather(1, chosen)[:, :, None]
    rows = torch.arange(b, device=ids.device)[:, None, None].expand_as(at)[scored]
    outputs = torch.cat([hidden[:, :n][plain], hidden[:, n:].reshape(b, -1, masks, hidden.shape[-1])[scored]])
    teacher = torch.cat([last[plain], last[rows, clamped[scored]]])  # [N, H]
    tokens = torch.cat([ids[:, 1:][plain], ids[rows, clamped[scored] + 1]])  # [N]
    n_plain = int(plain.sum())
    depth = torch.cat([torch.zeros_like(tokens[:n_plain]),
                       torch.arange(1, parallel, device=ids.device).expand_as(at)[scored]])  # [N]: depth − 1
    if tokens.shape[0] == 0:  # nothing to learn in this batch: zero, keeping the graph
        return hidden.sum() * 0.0, {"kl": 0.0, "ce": 0.0, "top1": 0.0, "tau": 1.0}
    with torch.no_grad():
        log_p = torch.log_softmax(target.get_output_embeddings()(teacher).float(), dim=-1)  # [N, V]
    log_q = torch.log_softmax(model.get_output_embeddings()(outputs).float(), dim=-1)  # [N, V]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]
    ce = F.nll_loss(log_q, tokens, reduction="none")
    loss = kl.mean() + ce_weight * ce.mean() if ce_weight else kl.mean()
    with torch.no_grad():
        hit = log_q.argmax(-1) == log_p.argmax(-1)  # [N]
        first, block = torch.zeros_like(plain), torch.zeros_like(scored)
        first[plain], block[scored] = hit[:n_plain], hit[n_plain:]
        matches = torch.cat([first.gather(1, chosen)[:, :, None], block], dim=2)  # [b, m, k]: the anchor's depths
        accepted = matches.long().cumprod(-1).sum(-1)[real].float()
        metrics = {"kl": kl[depth == 0].mean().item(), "ce": ce.mean().item(), "top1": hit[depth == 0].float().mean()
                   .item(), "tau": 1.0 + (accepted.mean().item() if accepted.numel() else 0.0)}
        count = torch.zeros(parallel, device=kl.device).index_add_(0, depth, torch.ones_like(kl))
        kl_sum = torch.zeros_like(count).index_add_(0, depth, kl)
        hit_sum = torch.zeros_like(count).index_add_(0, depth, hit.float())
        for d, (c, kl_d, hit_d) in enumerate(zip(count.tolist(), kl_sum.tolist(), hit_sum.tolist(), strict=True)):
            if c:
                metrics.update({f"kl{d + 1}": kl_d / c, f"top1_{d + 1}": hit_d / c})
    return loss, metrics


@torch.no_grad()
def pard_metrics(target, model, windows, *, batch_size: int = 8, seed: int = 0, **options) -> dict:
    """The training metrics averaged over ``windows`` (anchors drawn from ``seed``: the same every evaluation), the
    model in eval mode."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    metrics = mean_metrics(lambda batch: pard_loss(target, model, batch, generator=generator, **options), windows,
                           batch_size)
    model.train(was_training)
    return metrics


def check_settings(cfg) -> None:
    """Refuse, before any model loads, a PARD config this recipe cannot train (conf/drafter/pard.yaml)."""
    d = cfg.drafter
    if not isinstance(d.get("source"), str) or not d.get("source"):
        raise ValueError(f"drafter.source must name the trained draft model PARD adapts (reference:draft or a "
                         f"folder), got {d.get('source')!r}")
    for key, low in (("parallel", 2), ("anchors", 1)):
        value = d.get(key)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"drafter.{key} must be an integer >= {low}, got {value!r}")
    token = d.get("mask_token_id")
    if token is not None and (isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0):
        raise ValueError(f"drafter.mask_token_id must be a token id (an integer >= 0) or null, got {token!r}")
    check_weight_and_export(d)


def recipe(cfg, target, train_tokens=None) -> Recipe:
    """The recipe ``pard`` (conf/drafter/pard.yaml): ``drafter.source`` adapted to fill ``drafter.parallel``
    positions per pass. Its export is a transformers model folder (PARD's settings in its config.json), the target's
    tokenizer beside it."""
    d = cfg.drafter
    model = load_model(d.source, dtype=torch.float32)[0].to(target.device)
    check_same_vocab(model, target, "draft model")
    if is_hybrid(model.config) or any(window is not None for window in attention_layers(model.config)):
        raise ValueError(f"drafter.source={d.source}: PARD's training pass attends through a mask of its own, which "
                         "would drop a sliding window and cannot hold recurrent layers: adapt a draft model whose "
                         "layers all attend fully")
    mask_token_id = vocab_rows(model) - 1 if d.get("mask_token_id") is None else int(d.mask_token_id)
    mark_pard(model, int(d.parallel), mask_token_id)
    parallel, ce_weight = pard_settings(model.config)[0], float(d.get("ce_weight", 0.0))
    options = {"parallel": parallel, "mask_token_id": mask_token_id, "anchors": int(d.anchors)}
    n_params = sum(p.numel() for p in model.parameters())
    description = (f"PARD from {d.source} ({n_params / 1e6:.2f}M parameters): {parallel} positions per pass (the "
                   f"root's and {parallel - 1} masks of token {mask_token_id}), {d.anchors} anchors per window, loss "
                   "KL" + (f" + {ce_weight:g} x CE" if ce_weight else ""))
    return Recipe(model.train(), lambda batch: pard_loss(target, model, batch, ce_weight=ce_weight, **options),
                  lambda val: pard_metrics(target, model, val, **options),
                  lambda val: rank_accuracy(target, model, val, parallel=parallel, mask_token_id=mask_token_id,
                                            depth=d.get("accuracy_depth", parallel)),
                  lambda: ParallelDraft(model), description, save=saver(model, d), tokenizer_beside=True)
