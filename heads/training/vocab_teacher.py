"""The target's side of a loss over a *training vocabulary* (heads/drafting/vocab.py, ``TrainingVocab``): a drafter
that projects through the target's frozen lm_head learns over its N most frequent training tokens only, through those N
rows (DFlash's and EAGLE-1's ``drafter.train_vocab``). On a small target the full head is most of a training step:
the drafter's forward and backward over it then cost N/V; the teacher's full product (no gradient) remains, because
acceptance is measured against the full target distribution.

The target's distribution is restricted to the N tokens and renormalised, as EAGLE-3 trains its draft vocabulary
(heads/eagle3/objective.py); a prediction whose target argmax lies outside cannot be drafted right and leaves the loss.
"""

from __future__ import annotations

import torch

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.drafting.vocab import DraftVocab, token_counts


class Teacher:
    """The frozen target's side of the loss: its final-norm states [r, H] through its ``lm_head`` → (log p [r, N],
    the full distribution's mass inside the vocabulary [r] or None, its argmax [r], a target id). With a training
    vocabulary (``vocab``: DraftVocab, N of V ids) p is the target's distribution restricted to it and renormalised,
    as EAGLE-3 trains its draft vocabulary (heads/eagle3/objective.py), and N indexes draft ids; without one N = V.
    Any leading shape works in place of [r]."""

    def __init__(self, lm_head, vocab, device):
        self.lm_head, self.vocab = lm_head, vocab
        if vocab is not None:
            self.ids = vocab.ids.to(device)  # [N]: draft id → target id
            self.inside = vocab.t2d.to(device)  # [V] bool
            self.index = torch.cumsum(self.inside, 0) - 1  # [V]: target id → draft id (where inside)

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor):
        return self.split(self.lm_head(hidden).float())

    @torch.no_grad()
    def split(self, logits: torch.Tensor):
        """The same from the target's logits [..., V] already computed."""
        best = logits.argmax(-1)
        if self.vocab is None:
            return torch.log_softmax(logits, dim=-1), None, best
        # the mass inside from log_softmax's fused kernel: torch's logsumexp over [.., V] was half an EAGLE-1 step on
        # SmolLM2 (1.3 of 2.4 s; log-probabilities are <= 0, so their exp needs no max subtracted)
        mass = torch.log_softmax(logits, dim=-1)[..., self.ids].exp().sum(-1)
        return torch.log_softmax(logits[..., self.ids], dim=-1), mass, best

    def target_ids(self, draft: torch.Tensor) -> torch.Tensor:
        return draft if self.vocab is None else self.ids[draft]

    def holds(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Whether each target id is in the vocabulary (all True without one)."""
        return torch.ones_like(target_ids, dtype=torch.bool) if self.vocab is None else self.inside[target_ids]

    def draft_ids(self, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, 0 where outside; whether inside)."""
        if self.vocab is None:
            return target_ids, self.holds(target_ids)
        inside = self.inside[target_ids]
        return torch.where(inside, self.index[target_ids], 0), inside


def check_train_vocab(size) -> None:
    """Refuse a ``drafter.train_vocab`` that is neither null nor a positive integer."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"drafter.train_vocab must be null or an integer >= 1, got {size!r}")


def training_vocab(model, size: int | None, target, train_tokens) -> str:
    """Give ``model`` (a TrainingVocab) the ``size`` most frequent tokens of ``train_tokens`` as its training
    vocabulary (None: none) → the recipe description's words for it."""
    if size is None:
        return ""
    vocab = vocab_size_of(target)
    counts = token_counts(train_tokens if train_tokens is not None else torch.arange(vocab), vocab)
    model.set_vocab(DraftVocab.most_frequent(counts, min(int(size), vocab)))
    kept = len(model.vocab) if model.vocab is not None else vocab
    covered = counts[model.vocab.ids].sum().item() if model.vocab is not None else counts.sum().item()
    share = covered / max(1, counts.sum().item())
    return f", training vocabulary {kept} of {vocab} tokens ({share:.1%} of training tokens)"
