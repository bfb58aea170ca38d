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
