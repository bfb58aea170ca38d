"""A drafter kind's training objective, as the drafter-training job (train/training/drafter_job.py) takes it: a
``Recipe``. Each trainable kind's ``recipe(cfg, target, train_tokens)`` (heads/<kind>/kind.py) builds its own from
heads/<kind>/objective.py; ``train_tokens`` is the training stream, for recipes that need its statistics
(EAGLE-3's draft vocabulary). A loss reads batches through heads/training/batches.py and nothing of train/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec.heads.training.accuracy import accuracy_metrics, write_accuracy
from treespec.heads.training.batches import split_batch

# where a recipe that fine-tunes the target (Medusa-2) exports it, inside the drafter's export folder
TARGET_FOLDER = "target"


@dataclass
class Recipe:
    module: torch.nn.Module                              # the trainable drafter
    loss: Callable[[torch.Tensor | dict], tuple]         # batch (tokens [b, S] or a data.py dict) → (loss, metrics)
    evaluate: Callable[[torch.Tensor], dict]             # validation windows → metrics, during training
    rank_accuracy: Callable[[torch.Tensor], list]        # validation windows → acc[d][r], at export
    drafter: Callable[[], object]                        # the trained module as a treespec Drafter
    description: str
    target: torch.nn.Module | None = None                # the fine-tuned target the drafter pairs with (Medusa-2);
                                                         # None: the job's frozen target
    save: Callable[[Path], None] | None = None           # folder → writes the module; None: its save_pretrained
    tokenizer_beside: bool = False                       # the export is a whole model folder (a draft LM): the job
                                                         # saves the target's tokenizer in it, so it loads on its own

    def export(self, windows: torch.Tensor, folder) -> tuple[dict, list[list[float]]]:
        """Save the trained module (with a fine-tuned target, that too: its ``save_pretrained``) and its measured
        per-depth accuracies → (metrics, accuracies)."""
        acc = self.rank_accuracy(windows)
        (self.save or self.module.save_pretrained)(Path(folder))
        write_accuracy(folder, acc)
        return accuracy_metrics(acc), acc


@torch.no_grad()
def mean_metrics(loss: Callable, windows, batch_size: int) -> dict:
    """The metrics of ``loss(batch) -> (loss, metrics)`` averaged over ``windows`` split into batches (no
    gradients; the module's training switch is the caller's)."""
    totals: dict[str, float] = {}
    batches = split_batch(windows, batch_size)
    for batch in batches:
        for k, v in loss(batch)[1].items():
            totals[k] = totals.get(k, 0.0) + v / len(batches)
    return totals


def topk_distillation(p_target: torch.Tensor, log_q: torch.Tensor, k: int) -> torch.Tensor:
    """HASS's harmonized objective distillation (Zhang et al. 2024, "Learning Harmonized Representations for
    Speculative Sampling", eq. 4): −Σ_{x ∈ top-k of p} p(x) log q(x), per position: the drafter's ranking is
    pulled towards the target's on the k tokens a tree's top ranks draft. p_target, log_q [..., V] → [...]."""
    top_p, top_x = p_target.topk(min(k, p_target.shape[-1]), dim=-1)
    return -(top_p * log_q.gather(-1, top_x)).sum(-1)


# -- the token objective of the feature drafters (conf/drafter/{eagle,eagle3,dflash}.yaml ``loss``) --------------
# kl: the forward KL from the target's distribution p to the drafter's q (the published recipes). lk and lk_alpha:
# the LK losses (Samarin et al. 2026, "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding",
# arXiv 2602.23881), which aim at the acceptance rate itself instead of its proxy: a small drafter cannot reach
# KL = 0, and short of it the q that minimises KL is not the one that maximises acceptance.
TOKEN_LOSSES = ("kl", "lk", "lk_alpha")

# Rows per piece of a drafter loss's vocabulary-wide work (EAGLE-3's and DFlash's target and draft logits): a
# [128, 49152] float32 piece is 25 MB, under glibc's 32 MB mmap threshold, so the allocator reuses its heap instead of
# mapping and faulting in fresh pages for every whole-batch temporary (why it matters on a CPU step:
# results/notes/2026-12-04-eagle3-training-throughput.md).
ROWS = 128


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σ_x min(p(x), q(x)) = 1 − TV(p, q) over the last dimension: the probability that speculative sampling
    accepts a token drafted from q when the target samples from p (Leviathan et al. 2023). p, q [..., V] → [...]."""
    return torch.minimum(p, q).sum(-1)


def lk_loss(loss: str, kl: torch.Tensor, alpha: torch.Tensor, eta: float) -> torch.Tensor:
    """One draft depth's LK loss over its positions: ``kl``, ``alpha`` [n] (per position KL(p || q) and α, both with
    gradients) → 0-d, with ᾱ the positions' mean acceptance (the depth's expected acceptance rate):

    - ``lk``: the paper's hybrid LK^λ = λ · mean KL + (1 − λ) · (1 − ᾱ), λ = exp(−η · sg[ᾱ]) (sg: no gradient
      through λ; the paper's best η = 3). The TV term 1 − ᾱ is the acceptance rate itself, but its gradient is weak
      and noisy while q and p barely overlap (a cold start), so λ leans on KL while ᾱ is small and hands over to TV
      as the drafter aligns; one λ per draft depth, from that depth's batch.
    - ``lk_alpha``: LK^α = −log ᾱ, no hyperparameter: its gradient is TV's scaled by 1 / ᾱ, strong at a cold start.
      The log of the depth's mean α, not the mean of each position's log α, as the authors' implementation (their
      SpecForge pull request) takes it: a position the drafter cannot match does not dominate the loss.
    """
    check_loss(loss, TOKEN_LOSSES[1:])  # kl is none of them
    mean_alpha = alpha.mean()
    if loss == "lk_alpha":
        return -torch.log(mean_alpha.clamp(min=1e-6))
    weight = torch.exp(-eta * mean_alpha.detach())
    return weight * kl.mean() + (1 - weight) * (1 - mean_alpha)


def check_loss(loss, losses=TOKEN_LOSSES) -> None:
    """Refuse a drafter's ``loss`` that is none of ``losses`` (before any model loads, and in each loss function)."""
    if loss not in losses:
        raise ValueError(f"drafter.loss must be one of {', '.join(losses)}, got {loss!r}")
