"""Medusa-2: the heads trained jointly with the target (``scripts/train_heads.py drafter=medusa2``).

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", §2.3.2:
the backbone is fine-tuned together with the heads, so its last hidden state becomes easier to draft from,
while the model's own next-token prediction must not get worse. The three ingredients of the paper:

- **Combined loss**: L = L_LM + λ0 · Σ_k λ_k · L_k, with L_k head k's cross-entropy (λ_k = ``loss_decay``^k,
  as Medusa-1; λ0 = ``heads_weight``, small because the heads' losses are larger than the LM loss).
- **Self-distillation** (the paper's §2.3.2 "Self-Distillation" for Medusa-2, where the training data are the
  model's own outputs): L_LM is the KL divergence from the frozen ORIGINAL model's next-token distribution to
  the fine-tuned one's, KL(p_original ‖ p_finetuned), rather than cross-entropy against the data, so the fine-
  tuned target keeps the original's distribution; ``lm_weight`` adds the data cross-entropy too (0 by default).
- **Heads warm-up and differential learning rates**: the first ``heads_warmup_steps`` steps train the heads
  alone on the frozen backbone (Medusa-1, the paper's two-stage schedule); then both train, the backbone at
  ``backbone_lr_scale`` × the heads' rate.

**Full fine-tuning, not LoRA.** The whole target is trained (every parameter but none frozen). This keeps the
product a stock transformers model folder (``final/target``) that any loader, exporter or serving stack reads
with no adapter merge, adds no dependency (peft), and on the reference target (15.5M parameters) costs little.
The price is memory: AdamW state for every target weight (about 3× the model), which rules out 7B+ targets on one
device; LoRA adapters would be the way there (not built).

The fine-tuned target is what decoding is lossless against: the heads are drafted from ITS hidden states and
verified by IT. The export holds both: the heads (``final/``, Medusa's layout, loaded by ``treespec.heads.load``
for that target) and the fine-tuned target with the tokenizer (``final/target``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.medusa.drafter import Medusa, rank_accuracy
from treespec.heads.medusa.network import MedusaHeads
from treespec.heads.medusa.objective import heads_loss
from treespec.heads.training.accuracy import accuracy_metrics
from treespec.heads.training.batches import batch_parts, shifted_mask, split_batch
from treespec.heads.training.objective import TARGET_FOLDER, Recipe
from treespec.heads.training.segments import PackedModel, packed_positions, segment_ids


class JointMedusa(nn.Module):
    """The trainable pair: ``backbone`` (a copy of the target, fine-tuned) and its Medusa ``heads``, which
    project through the backbone's own lm_head. The frozen original is kept outside the module's parameters."""

    def __init__(self, target, d):
        super().__init__()
        self.backbone = copy.deepcopy(target)
        for p in self.backbone.parameters():
            p.requires_grad_(True)
        self._original = [target]  # a list: the teacher stays out of parameters(), state_dict() and checkpoints
        self.heads = MedusaHeads(target.config.hidden_size, vocab_size_of(target), num_heads=d.num_heads,
                                 num_layers=d.num_layers, share_lm_head=d.share_lm_head,
                                 lm_head=self.backbone.get_output_embeddings())
        self.settings = {k: d[k] for k in ("loss_decay", "heads_weight", "lm_weight", "distill_weight",
                                            "heads_warmup_steps", "backbone_lr_scale")}
        self.config = {**self.heads.config, "joint": self.settings}
        self.joint = self.settings["heads_warmup_steps"] == 0

    @property
    def original(self):
        return self._original[0]

    def frozen_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's lm_head without gradients to its weight: the warm-up's projection."""
        head = self.backbone.get_output_embeddings()
        return F.linear(hidden, head.weight.detach(), None if head.bias is None else head.bias.detach())

    # -- the training loop's hooks (train/training/loop.py) ------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Heads alone until ``heads_warmup_steps``, then jointly: a pure function of the step (exact resume)."""
        self.joint = step >= self.settings["heads_warmup_steps"]

    def lr_scales(self):
        """The heads at the schedule's rate (the first group, the one ``train/lr`` logs), the backbone slower."""
        backbone = [p for n, p in self.named_parameters() if n.startswith("backbone.")]
        others = [p for n, p in self.named_parameters() if not n.startswith("backbone.")]
        return [(others, 1.0), (backbone, self.settings["backbone_lr_scale"])]

    def save_pretrained(self, folder) -> None:
        """The heads in Medusa's layout in ``folder``, the fine-tuned target in ``folder/target``."""
        self.heads.save_pretrained(folder)
        self.backbone.save_pretrained(f"{folder}/{TARGET_FOLDER}")

    # -- the loss ------------------------------------------------------------------------------------------
    def loss(self, batch, measure_lm: bool = False) -> tuple[torch.Tensor, dict]:
        """batch [b, s + 1] (or a dict batch with a loss mask) → (loss, metrics). Before the warm-up's end the
        backbone runs without gradients and only the heads' term is trained (the LM terms, which need the
        original's forward too, are then computed only when ``measure_lm``)."""
        device = next(self.heads.parameters()).device
        positions = packed_positions(batch, device)
        tokens, loss_mask, _ = batch_parts(batch, None, device)
        inputs = tokens[:, :-1]  # [b, s]
        segments = None if positions is None else segment_ids(positions)
        # packed (heads/training/segments.py): both targets' attention inside each conversation
        backbone, original = ((self.backbone, self.original) if positions is None else
                              (PackedModel(self.backbone, positions), PackedModel(self.original, positions)))
        with torch.set_grad_enabled(self.joint and torch.is_grad_enabled()):
            hidden = backbone.base_model(input_ids=inputs).last_hidden_state  # [b, s, h]
        # the heads project through the backbone's lm_head, which the warm-up leaves frozen too (Medusa-1)
        shared = self.heads.projections is None
        projections = [self.frozen_lm_head] * self.heads.num_heads if shared and not self.joint else None
        heads_term, metrics = heads_loss(self.heads, hidden, tokens, loss_mask, self.settings["loss_decay"],
                                         projections, segments)
        if not (self.joint or measure_lm):
            return heads_term, metrics
        lm, metrics_lm = self.lm_terms(hidden, tokens, loss_mask, original, segments)
        metrics.update(metrics_lm)
        if not self.joint:
            return heads_term, metrics
        s = self.settings
        return s["distill_weight"] * lm["distill"] + s["lm_weight"] * lm["ce"] + s["heads_weight"] * heads_term, metrics

    def lm_terms(self, hidden, tokens, loss_mask, original_model=None, segments=None) -> tuple[dict, dict]:
        """The fine-tuned target's own next-token terms: cross-entropy against the data and KL(p_original ‖
        p_finetuned), each averaged over the (trained-on) positions. ``original_model``: the frozen original as
        the batch needs it called (a packed batch's ``PackedModel``), ``segments`` its conversations."""
        logits = self.backbone.get_output_embeddings()(hidden).float()  # [b, s, V]
        with torch.no_grad():
            original = (original_model or self.original)(input_ids=tokens[:, :-1]).logits.float()  # [b, s, V]
        keep = (shifted_mask(loss_mask, 1, logits.shape[1], segments) if loss_mask is not None
                else torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device))  # [b, s]
        log_q, log_p = F.log_softmax(logits[keep], -1), F.log_softmax(original[keep], -1)  # [n, V]
        ce = F.nll_loss(log_q, tokens[:, 1:][keep])
        distill = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        original_ce = F.nll_loss(log_p, tokens[:, 1:][keep])
        return {"ce": ce, "distill": distill}, {"lm_ce": ce.item(), "original_lm_ce": original_ce.item(),
                                                "kl_to_original": distill.item()}


@torch.no_grad()
def joint_metrics(module: JointMedusa, val, batch_size: int = 8) -> dict:
    """The loss terms (per-head CE, the fine-tuned and the original target's held-out LM loss, the KL between
    them) averaged over the validation windows or dict batch."""
    pieces = split_batch(val, batch_size)
    totals: dict[str, float] = {}
    for piece in pieces:
        for k, v in module.loss(piece, measure_lm=True)[1].items():
            totals[k] = totals.get(k, 0.0) + v / len(pieces)
    return totals


def check_settings(cfg, world_size: int) -> None:
    """What Medusa-2 cannot do, before any model loads."""
    if cfg.data.get("features"):
        raise ValueError("drafter=medusa2 fine-tunes the target, so stored target features (data.features) cannot "
                         "stand in for it: drop data.features")
    if world_size > 1:  # the warm-up leaves the backbone without gradients, which DDP refuses
        raise ValueError("drafter=medusa2 trains in one process (run it without torchrun)")
    if not (cfg.drafter.lm_weight > 0 or cfg.drafter.distill_weight > 0):  # only the heads' loss would move it
        raise ValueError(f"drafter.lm_weight={cfg.drafter.lm_weight} and drafter.distill_weight="
                         f"{cfg.drafter.distill_weight}: nothing would hold the fine-tuned target's distribution to "
                         "the original's (set distill_weight > 0, the default 1.0, or lm_weight > 0)")
    if cfg.drafter.heads_warmup_steps >= (cfg.trainer.max_steps or 0) > 0:
        raise ValueError(f"drafter.heads_warmup_steps={cfg.drafter.heads_warmup_steps} leaves no joint step of "
                         f"trainer.max_steps={cfg.trainer.max_steps}: the target would not be fine-tuned")


def recipe(cfg, target, train_tokens=None) -> Recipe:
    module = JointMedusa(target, cfg.drafter)

    def evaluate(val):
        if torch.is_tensor(val):
            return {**accuracy_metrics(rank_accuracy(module.backbone, module.heads, val, top_k=5)),
                    **joint_metrics(module, val)}
        return joint_metrics(module, val)

    return Recipe(module, module.loss, evaluate, lambda val: rank_accuracy(module.backbone, module.heads, val),
                  lambda: Medusa(module.heads), f"{cfg.drafter.num_heads} heads trained jointly with the target",
                  target=module.backbone)
