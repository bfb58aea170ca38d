"""Training an EAGLE drafter on a frozen target (``scripts/train_heads.py drafter=eagle``).

EAGLE-1 recipe (Li et al. 2024): the target's features are computed online (frozen, no grad); entry j
pairs token x_{j+1} with the target feature f_j (plus Gaussian noise, which makes the drafter robust to
the errors of its own features at inference) and predicts f_{j+1}. Loss: SmoothL1 between predicted
and target features, plus ``token_weight`` (EAGLE-1: 0.1) × the cross-entropy of the drafter's
next-token distribution against the target's, lm_head(f_{j+1}) (soft labels); ``loss=lk`` or ``lk_alpha``: × the LK
loss instead (heads/training/objective.py, ``lk_loss``: acceptance over the full vocabulary, one draft depth per
unrolled step).

Training-time test: ``unroll_steps`` extra passes feed the drafter its own features, as deeper tree
nodes are at inference (``training_unroll``, over heads/training/unroll.py); step k's loss is weighted ``unroll_decay
** k``.

Batches are token windows [b, S] (every entry trained on) or dicts with a loss mask (chat data: entry j is
trained on when the token it predicts, j + 2, is) and possibly the target's stored hidden states
(train/training/features.py: the same code runs with a ``StoredTarget``). A packed batch (several conversations per
row, heads/training/segments.py) keeps the drafter's attention inside each conversation (heads/training/unroll.py)
and scores step k's
entry j only when its root j − k and the token it predicts, j + 2, lie in one conversation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treespec.heads.eagle.drafter import Eagle, EagleModel, rank_accuracy
from treespec.heads.eagle.network import fused_layers
from treespec.heads.training.batches import batch_parts, shifted_mask
from treespec.heads.training.objective import (
    Recipe,
    acceptance,
    check_loss,
    lk_loss,
    mean_metrics,
    topk_distillation,
)
from treespec.heads.training.segments import packed_positions, same_segment, segment_ids
from treespec.heads.training.target_states import target_hidden
from treespec.heads.training.unroll import unrolled
from treespec.heads.training.vocab_teacher import Teacher, training_vocab


def training_unroll(target, model: EagleModel, batch: torch.Tensor, *, steps: int, noise_std: float = 0.0,
                    positions: torch.Tensor | None = None):
    """The drafter's predictions on ``batch`` [b, S] (entries j = 0..S−2 pair token j + 1 with the target
    feature at j) for draft depths 1..steps + 1 → (f_next [b, n, h], target_logits [b, n, V], steps), where
    ``steps`` yields (k, g [b, n, h], valid) lazily: step k = depth k + 1 (heads/training/unroll.py, entries kept
    aligned with the window); ``valid`` selects the entries whose chain starts inside the window.
    target_logits at entry j are the target's for token j + 2. While the model trains, ``noise_std`` adds
    Gaussian noise to the target features it reads (EAGLE-1). ``positions`` [b, S]: a packed batch's position ids
    (heads/training/unroll.py)."""
    inputs, last = target_hidden(target, batch, model.feature_layers)  # [b, S, L·h], [b, S, h]
    f_next = last[:, 1:]  # [b, n, h]: entry j predicts f_{j+1}
    with torch.no_grad():
        target_logits = model.logits(f_next).float()  # [b, n, V]: the target's next token
    features = inputs[:, :-1]
    if noise_std > 0 and model.training:
        features = features + noise_std * torch.randn_like(features)
    n = f_next.shape[1]

    def run():
        for k, g in unrolled(model, batch, model.fuse(features), steps, by_root=False, positions=positions):
            yield k, g, (slice(None) if k == 0 else torch.arange(n, device=g.device) >= k)

    return f_next, target_logits, run()


def step_loss(model, g, f_next, p_target, valid, token_weight: float, feature_weight: float,
              mask: torch.Tensor | None = None, topk_distill: int = 0, topk_weight: float = 1.0,
              loss: str = "kl", eta: float = 3.0, neg_entropy: torch.Tensor | None = None,
              *, teacher: Teacher, best: torch.Tensor, mass: torch.Tensor | None = None) -> tuple:
    """g, f_next [b, n, h]; p_target [b, n, N] (N: the training vocabulary's, else V); valid [n] bool or a slice;
    mask [b, n] bool or None (every entry) → (loss, feature loss, CE, top-1 agreement, acceptance α) over the valid,
    masked entries; ``topk_distill`` = K > 0 adds HASS's top-K distillation × ``topk_weight``
    (heads/training/objective.py). ``loss`` lk, lk_alpha: the token term is the LK loss (``eta``: lk's), its KL from
    ``neg_entropy`` [b, n] (Σ p log p). ``teacher`` (heads/training/vocab_teacher.py) maps draft ids to target ids,
    ``best`` [b, n] is the target's argmax and ``mass`` [b, n] its probability inside a training vocabulary (None:
    none): top-1 and α are measured against the full target."""
    keep = valid if mask is None else (mask & valid[None] if torch.is_tensor(valid) else mask)
    if mask is not None and not bool(keep.any()):  # nothing to learn at this step: keep the graph, add nothing
        zero = g.sum() * 0.0
        return zero, zero.detach(), zero.detach(), zero.detach(), zero.detach()
    pick = (lambda t: None if t is None else t[:, keep]) if mask is None else (lambda t: None if t is None else t[keep])
    g, f_next, p_target, neg_entropy, best, mass = map(pick, (g, f_next, p_target, neg_entropy, best, mass))
    feature = F.smooth_l1_loss(g.float(), f_next.float())
    log_q = torch.log_softmax(model.draft_logits(g).float(), dim=-1)  # [b, n', N]
    cross = -(p_target * log_q).sum(-1)
    ce = cross.mean()
    top1 = (teacher.target_ids(log_q.argmax(-1)) == best).float().mean()
    p_full = p_target if mass is None else p_target * mass[..., None]  # α against the full target: outside, never
    if loss == "kl":
        alpha = acceptance(p_full, log_q.detach().exp()).mean()
        token = ce
    else:
        alphas = acceptance(p_target, log_q.exp())  # against p over the vocabulary: what LK raises (EAGLE-3's α_r)
        alpha = (alphas.detach() if mass is None else acceptance(p_full, log_q.detach().exp())).mean()
        token = lk_loss(loss, (neg_entropy + cross).flatten(), alphas.flatten(), eta)
    total = feature_weight * feature + token_weight * token
    if topk_distill:
        total = total + topk_weight * topk_distillation(p_target, log_q, topk_distill).mean()
    return total, feature, ce, top1, alpha


def eagle_loss(target, model, batch: torch.Tensor, *, noise_std: float = 0.0, token_weight: float = 0.1,
               feature_weight: float = 1.0, unroll_steps: int = 0, unroll_decay: float = 0.8,
               topk_distill: int = 0, topk_weight: float = 1.0, loss: str = "kl", lk_eta: float = 3.0) -> tuple:
    """batch [b, S] (or a dict batch, train/training/data.py) → (Σ_k unroll_decay^k · (feature_weight · SmoothL1 +
    token_weight · CE, or the LK loss under ``loss`` lk / lk_alpha with ``lk_eta``) over steps 0..unroll_steps,
    metrics: per step ``feature_loss{k}``, ``ce{k}``, ``top1_{k}`` and ``alpha_{k}``, the mean acceptance
    probability Σ min(p, q))."""
    check_loss(loss)
    positions = packed_positions(batch, model.device)
    ids, loss_mask, target = batch_parts(batch, target, model.device)
    f_next, target_logits, steps = training_unroll(target, model, ids, steps=unroll_steps, noise_std=noise_std,
                                                   positions=positions)
    # soft labels [b, n, N]; with a training vocabulary, the target's restricted and renormalised, and an entry whose
    # target argmax lies outside it leaves the loss (heads/training/vocab_teacher.py)
    teacher = Teacher(model.lm_head, model.vocab, target_logits.device)
    log_p, mass, best = teacher.split(target_logits)
    del target_logits
    p_target = log_p.exp()
    neg_entropy = None if loss == "kl" else (p_target * log_p).sum(-1)
    n = f_next.shape[1]
    mask = None if loss_mask is None else shifted_mask(loss_mask, 2, n)  # entry j predicts token j + 2
    if model.vocab is not None:
        held = teacher.holds(best)
        mask = held if mask is None else mask & held
    segments = None if positions is None else segment_ids(positions)
    total, metrics = 0.0, {}
    for k, g, valid in steps:
        # packed: step k's entry j is drafted from root j − k; root and predicted token in one conversation
        inside = mask if segments is None else mask & same_segment(segments, -k, 2, n)
        step, feature, ce, top1, alpha = step_loss(model, g, f_next, p_target, valid, token_weight, feature_weight,
                                                   inside, topk_distill, topk_weight, loss, lk_eta, neg_entropy,
                                                   teacher=teacher, best=best, mass=mass)
        total = total + unroll_decay**k * step
        metrics.update({f"feature_loss{k}": feature.item(), f"ce{k}": ce.item(), f"top1_{k}": top1.item(),
                        f"alpha_{k}": alpha.item()})
    return total, metrics


@torch.no_grad()
def eagle_metrics(target, model, windows: torch.Tensor, unroll_steps: int, batch_size: int = 8) -> dict:
    """Mean over ``windows`` [n, S] (or a dict batch) of the noise-free training metrics: per step, how often
    the drafter's top-1 token is the target's (``top1_k``), its acceptance α (``alpha_k``), feature loss and CE."""
    return mean_metrics(lambda batch: eagle_loss(target, model, batch, unroll_steps=unroll_steps), windows,
                        batch_size)


def target_layers(d, num_hidden_layers: int) -> tuple[int, ...]:
    """The target hidden states the drafter reads (``drafter.feature_layers``, else the fusion switch's low/mid/
    high ones, else the last): what offline features must hold besides the last one."""
    if d.feature_layers:
        return tuple(d.feature_layers)
    return fused_layers(num_hidden_layers) if d.fusion else (-1,)


def recipe(cfg, target, train_tokens=None) -> Recipe:
    """The recipe for ``drafter=eagle`` (conf/drafter/eagle.yaml)."""
    d = cfg.drafter
    layers = target_layers(d, target.config.num_hidden_layers)
    model = EagleModel(target, feature_layers=layers, variant=d.variant)
    vocab_note = training_vocab(model, d.get("train_vocab"), target, train_tokens)

    def loss(batch):
        return eagle_loss(target, model, batch, noise_std=d.noise_std, token_weight=d.token_weight,
                          feature_weight=d.feature_weight, unroll_steps=d.unroll_steps, unroll_decay=d.unroll_decay,
                          topk_distill=d.get("topk_distill", 0), topk_weight=d.get("topk_weight", 1.0),
                          loss=d.loss, lk_eta=d.lk_eta)

    return Recipe(model, loss, lambda val: eagle_metrics(target, model, val, d.unroll_steps),
                  lambda val: rank_accuracy(target, model, val, depth=d.accuracy_depth), lambda: Eagle(model),
                  f"feature layers {layers}, {d.unroll_steps} unrolled training step(s), {d.loss} loss{vocab_note}")
