"""Training an EAGLE drafter on a frozen target (``scripts/train_heads.py drafter=eagle``).

EAGLE-1 recipe (Li et al. 2024): the target's features are computed online (frozen, no grad); entry j
pairs token x_{j+1} with the target feature f_j (plus Gaussian noise, which makes the drafter robust to
the errors of its own features at inference) and predicts f_{j+1}. Loss: SmoothL1 between predicted
and target features, plus ``token_weight`` (EAGLE-1: 0.1) × the cross-entropy of the drafter's
next-token distribution against the target's, lm_head(f_{j+1}) (soft labels).

Training-time test (EAGLE-3, Li et al. 2025): at inference the drafter's deeper tree nodes are fed its
own features. ``unroll_steps`` extra passes train exactly that: step k feeds entry j the output of step
k − 1 at entry j − 1, and entry j attends to what it would see when drafting depth k from the root at
entry j − k: step-0 entries up to j − k (built from target features), then its own chain, one entry per
step (``unroll_mask``). Step k's loss is weighted ``unroll_decay ** k``. Each step costs one more pass
of the one-layer drafter, cheap beside the target's forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from treespec.sampling import GREEDY, Sampling
from treespec.verify import rank_acceptance


def target_states(target, input_ids: torch.Tensor, feature_layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's input features [b, s, L·h] (its feature layers side by side, as generate() passes
    them) and the last, final-norm hidden state [b, s, h], without the target's logits."""
    with torch.no_grad():
        out = target.base_model(input_ids=input_ids, output_hidden_states=tuple(feature_layers) != (-1,))
        last = out.last_hidden_state
        if tuple(feature_layers) == (-1,):
            return last, last
        return torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1), last


def unroll_mask(n: int, step: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, n, (step + 1)·n] for unrolled step ``step`` >= 1 over keys of steps
    0..step (n entries each, in the cache in that order): entry j sees step-0 entries i <= j − step and,
    of each step m in 1..step, entry j − step + m only (its own chain; m = step is itself)."""
    j = torch.arange(n, device=device)[:, None]  # [q, 1]
    i = torch.arange(n, device=device)[None, :]  # [1, t]
    blocks = [i <= j - step] + [i == j - step + m for m in range(1, step + 1)]  # each [q, t]
    allowed = torch.cat(blocks, dim=1)  # [q, (step + 1)·t]
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.masked_fill(allowed, 0.0)[None, None]


def step_loss(model, g, f_next, p_target, valid, token_weight: float, feature_weight: float) -> tuple:
    """g, f_next [b, n, h]; p_target [b, n, V]; valid [n] bool → (loss, feature loss, CE, top-1 agreement)."""
    g, f_next, p_target = g[:, valid], f_next[:, valid], p_target[:, valid]
    feature = F.smooth_l1_loss(g.float(), f_next.float())
    log_q = torch.log_softmax(model.logits(g).float(), dim=-1)  # [b, n', V]
    ce = -(p_target * log_q).sum(-1).mean()
    top1 = (log_q.argmax(-1) == p_target.argmax(-1)).float().mean()
    return feature_weight * feature + token_weight * ce, feature, ce, top1


def unrolled(target, model, batch: torch.Tensor, *, steps: int, noise_std: float = 0.0):
    """The drafter's predictions on ``batch`` [b, S] (entries j = 0..S−2 pair token j + 1 with the target
    feature at j) for draft depths 1..steps + 1 → (f_next [b, n, h], target_logits [b, n, V], steps), where
    ``steps`` yields (k, g [b, n, h], valid) lazily: step k = depth k + 1; ``valid`` selects the entries
    whose chain starts inside the window. target_logits at entry j are the target's for token j + 2."""
    from transformers import DynamicCache

    inputs, last = target_states(target, batch, model.feature_layers)  # [b, S, L·h], [b, S, h]
    tokens, f_next = batch[:, 1:], last[:, 1:]  # [b, n], [b, n, h]: entry j predicts f_{j+1}
    with torch.no_grad():
        target_logits = model.logits(f_next).float()  # [b, n, V]: the target's next token
    features = inputs[:, :-1]
    if noise_std > 0 and model.training:
        features = features + noise_std * torch.randn_like(features)
    n = tokens.shape[1]
    steps = min(steps, n - 1)  # step k scores entries k..n-1

    def run():
        cache = DynamicCache(config=model.layer_config) if steps else None
        g = model(tokens, model.fuse(features), cache=cache)  # [b, n, h], causal
        yield 0, g, slice(None)
        positions = torch.arange(n, device=g.device)[None]
        for k in range(1, steps + 1):
            own = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # entry j pairs with step k−1's g at j−1
            mask = unroll_mask(n, k, dtype=g.dtype, device=g.device)
            g = model(tokens, own, attention_mask=mask, position_ids=positions, cache=cache)
            yield k, g, torch.arange(n, device=g.device) >= k

    return f_next, target_logits, run()


def eagle_loss(target, model, batch: torch.Tensor, *, noise_std: float = 0.0, token_weight: float = 0.1,
               feature_weight: float = 1.0, unroll_steps: int = 0, unroll_decay: float = 0.8) -> tuple:
    """batch [b, S] → (Σ_k unroll_decay^k · (feature_weight · SmoothL1 + token_weight · CE) over steps
    0..unroll_steps, metrics)."""
    f_next, target_logits, steps = unrolled(target, model, batch, steps=unroll_steps, noise_std=noise_std)
    p_target = torch.softmax(target_logits, dim=-1)  # [b, n, V]: soft labels
    total, metrics = 0.0, {}
    for k, g, valid in steps:
        loss, feature, ce, top1 = step_loss(model, g, f_next, p_target, valid, token_weight, feature_weight)
        total = total + unroll_decay**k * loss
        metrics.update({f"feature_loss{k}": feature.item(), f"ce{k}": ce.item(), f"top1_{k}": top1.item()})
    return total, metrics


@torch.no_grad()
def eagle_accuracy(target, model, windows: torch.Tensor, unroll_steps: int, batch_size: int = 8) -> dict:
    """Mean over ``windows`` [n, S] of the noise-free training metrics: per step, how often the drafter's
    top-1 token is the target's (``top1_k``), its feature loss and CE."""
    totals: dict[str, float] = {}
    batches = windows.split(batch_size)
    for batch in batches:
        _, metrics = eagle_loss(target, model, batch, unroll_steps=unroll_steps)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / len(batches)
    return totals


@torch.no_grad()
def depth_rank_accuracy(target, model, windows: torch.Tensor, depth: int = 8, top_k: int = 10,
                        batch_size: int = 4, sampling: Sampling = GREEDY) -> list[list[float]]:
    """acc[d][r]: the chance that the drafter's rank-r token at draft depth d + 1 is the one the target
    emits (``verify.rank_acceptance``: greedy, that it is the target's argmax), drafting from the root over
    its own features along the window's tokens (what an accepted tree path feeds it), on held-out
    ``windows`` [n, S]. Ranks are mutually exclusive, as analysis.grow_tree expects; these drive
    accuracy-grown static trees and the comparison's predictions, as Medusa's head accuracies do."""
    was_training = model.training
    model.eval()
    hits, counts = torch.zeros(depth, top_k), torch.zeros(depth)
    for batch in windows.split(batch_size):
        _, target_logits, steps = unrolled(target, model, batch, steps=depth - 1)
        for k, g, valid in steps:
            top = model.logits(g[:, valid]).topk(top_k, dim=-1).indices  # [b, n', R]
            hits[k] += rank_acceptance(top, target_logits[:, valid], sampling).flatten(0, 1).sum(0)
            counts[k] += top.shape[0] * top.shape[1]
    model.train(was_training)
    return (hits / counts.clamp(min=1)[:, None]).tolist()


def fused_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, mid and high features: after the first layer, after the middle one, and the last
    (final-norm) hidden state."""
    return (1, max(1, num_hidden_layers // 2), -1)


def eagle_recipe(cfg, target):
    """The run() recipe for ``drafter=eagle`` (conf/drafter/eagle.yaml)."""
    from treespec.heads.base import ACCURACY_FILE
    from treespec.heads.eagle import Eagle, EagleModel

    from .heads import Recipe

    d = cfg.drafter
    if d.feature_layers:
        layers = tuple(d.feature_layers)
    else:
        layers = fused_layers(target.config.num_hidden_layers) if d.fusion else (-1,)
    model = EagleModel(target, feature_layers=layers)

    def loss(batch):
        return eagle_loss(target, model, batch, noise_std=d.noise_std, token_weight=d.token_weight,
                          feature_weight=d.feature_weight, unroll_steps=d.unroll_steps, unroll_decay=d.unroll_decay)

    def finish(val, export_dir):
        metrics = {f"eagle_{k}": v for k, v in eagle_accuracy(target, model, val, d.unroll_steps).items()}
        acc = depth_rank_accuracy(target, model, val, depth=d.accuracy_depth)
        model.save_pretrained(export_dir)
        (Path(export_dir) / ACCURACY_FILE).write_text(json.dumps(acc))
        metrics.update({f"depth{k + 1}_top1": row[0] for k, row in enumerate(acc)})
        return metrics, acc

    return Recipe(model, loss, lambda val: eagle_accuracy(target, model, val, d.unroll_steps), finish,
                  lambda: Eagle(model), f"feature layers {layers}, {d.unroll_steps} unrolled training step(s)")
