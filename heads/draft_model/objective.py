"""Training a draft model for a frozen target (``scripts/train_heads.py drafter=draft``): knowledge distillation
(Hinton et al. 2015), as DistillSpec (Zhou et al. 2024) does for speculative decoding: the draft learns the target's
next-token distribution, not the data's tokens, since what a verifier accepts is what the target would say.

The network is a fresh small Llama of the target's vocabulary (heads/draft_model/network.py). The loss at a scored
position j (the token j + 1 is trained on: the loss mask of chat data; every position of corpus windows) is the
forward KL(p_target ‖ q_draft) over the whole vocabulary, plus ``ce_weight`` × the cross-entropy of the data's
token j + 1 (0 by default: on the target's own answers that token is the target's greedy choice, which the KL
already covers). The target's distribution is its lm_head over its last hidden state, computed online or read from
stored features (``data.features``: only the last hidden state is stored, ``target_layers`` asks for nothing
else), as the EAGLE recipes get theirs. Only the scored positions are projected onto the vocabulary, so a chat
batch's prompts and padding cost no vocabulary-sized logits.

The draft draws no random numbers while training (no dropout, no noise), so a resumed run is exactly the
uninterrupted one (the loop restores the optimiser and the step's batch).
"""

from __future__ import annotations

import copy
import numbers
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from treespec.heads.draft_model.drafter import DraftModel, rank_accuracy
from treespec.heads.draft_model.network import INITS, check_arch, matmul_weights, new_draft_model
from treespec.heads.training.batches import batch_parts, shifted_mask
from treespec.heads.training.objective import Recipe, mean_metrics
from treespec.heads.training.segments import PackedModel, packed_positions, segment_ids
from treespec.heads.training.target_states import target_hidden
from treespec.reference import float_dtype


def draft_loss(target, model, batch, *, ce_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """batch [b, S] token windows (or a dict batch: loss mask, stored features; heads/training/batches.py) → (KL +
    ce_weight ·
    CE averaged over the scored positions, metrics: ``kl``, ``ce`` (the data's next token), ``top1`` (the draft's
    argmax is the target's))."""
    positions = packed_positions(batch, model.device)
    ids, loss_mask, target = batch_parts(batch, target, model.device)
    inputs, n = ids[:, :-1], ids.shape[1] - 1  # position j predicts token j + 1
    segments = None if positions is None else segment_ids(positions)
    scored = (torch.ones(ids.shape[0], n, dtype=torch.bool, device=ids.device) if loss_mask is None
              else shifted_mask(loss_mask, 1, n, segments))  # [b, n]
    _, last = target_hidden(target, inputs)  # [b, n, H], no grad
    draft = model if positions is None else PackedModel(model, positions)  # packed: attention inside each conversation
    hidden = draft.base_model(input_ids=inputs).last_hidden_state  # [b, n, h]
    if not bool(scored.any()):  # nothing to learn in this batch: keep the graph, add nothing
        zero = hidden.sum() * 0.0
        return zero, {"kl": 0.0, "ce": 0.0, "top1": 0.0}
    with torch.no_grad():
        log_p = torch.log_softmax(target.get_output_embeddings()(last[scored]).float(), dim=-1)  # [N, V]
    log_q = torch.log_softmax(model.get_output_embeddings()(hidden[scored]).float(), dim=-1)  # [N, V]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ce = F.nll_loss(log_q, ids[:, 1:][scored])
    top1 = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
    loss = kl + ce_weight * ce if ce_weight else kl
    return loss, {"kl": kl.item(), "ce": ce.item(), "top1": top1.item()}


@torch.no_grad()
def draft_metrics(target, model, val, batch_size: int = 8) -> dict:
    """The training metrics averaged over ``val`` ([n, S] windows or a dict batch), the module in eval mode."""
    was_training = model.training
    model.eval()
    metrics = mean_metrics(lambda batch: draft_loss(target, model, batch), val, batch_size)
    model.train(was_training)
    return metrics


def arch_of(d) -> dict:
    arch = d.get("arch")
    return OmegaConf.to_container(arch, resolve=True) if OmegaConf.is_config(arch) else arch


def check_settings(cfg) -> None:
    """Refuse, before any model loads, a drafter config this recipe cannot train (conf/drafter/draft.yaml)."""
    d = cfg.drafter
    check_arch(arch_of(d))
    if d.get("init", "random") not in INITS:
        raise ValueError(f"drafter.init must be one of {', '.join(INITS)}, got {d.get('init')!r}")
    check_weight_and_export(d)
    positions = arch_of(d).get("max_position_embeddings")
    if positions is not None and positions < cfg.trainer.seq_len:
        raise ValueError(f"drafter.arch.max_position_embeddings={positions} is below trainer.seq_len="
                         f"{cfg.trainer.seq_len}")


def check_weight_and_export(d) -> None:
    """``drafter.ce_weight`` and ``drafter.export_dtype``, which every draft-model recipe reads."""
    weight = d.get("ce_weight", 0.0)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not weight >= 0:
        raise ValueError(f"drafter.ce_weight must be a number >= 0, got {weight!r}")
    try:
        float_dtype(d.get("export_dtype", "float32"))
    except ValueError:
        raise ValueError(f"drafter.export_dtype must be float32, bfloat16 or float16, got {d.get('export_dtype')!r}"
                         ) from None


def saver(model, d):
    """folder → writes ``model`` as a transformers folder in ``drafter.export_dtype`` (a copy when it differs)."""
    dtype = float_dtype(d.get("export_dtype", "float32"))

    def save(folder) -> None:
        (model if model.dtype == dtype else copy.deepcopy(model).to(dtype)).save_pretrained(Path(folder))

    return save


def recipe(cfg, target, train_tokens=None) -> Recipe:
    """The recipe for ``drafter=draft`` (conf/drafter/draft.yaml): a fresh draft of ``drafter.arch`` for ``target``.
    Its export is a transformers model folder in ``drafter.export_dtype``, the target's tokenizer beside it."""
    d = cfg.drafter
    init, ce_weight = d.get("init", "random"), float(d.get("ce_weight", 0.0))
    model = new_draft_model(target, arch_of(d), init)
    c = model.config
    n_params = sum(p.numel() for p in model.parameters())
    share = matmul_weights(model) / matmul_weights(target)
    description = (f"a {c.num_hidden_layers}-layer Llama of width {c.hidden_size} ({n_params / 1e6:.2f}M parameters; "
                   f"{share:.1%} of the target's per-token weights), init {init}, loss KL"
                   + (f" + {ce_weight:g} x CE" if ce_weight else ""))
    return Recipe(model, lambda batch: draft_loss(target, model, batch, ce_weight=ce_weight),
                  lambda val: draft_metrics(target, model, val),
                  lambda val: rank_accuracy(target, model, val, depth=d.get("accuracy_depth", 8)),
                  lambda: DraftModel(model), description, save=saver(model, d), tokenizer_beside=True)
