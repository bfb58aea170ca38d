"""Reduced draft vocabularies: a drafter whose lm_head covers only the most frequent target tokens
(EAGLE-3's draft vocabulary, Li et al. 2025; FR-Spec's frequency-ranked LM head, Zhao et al. 2025).

On a small target the vocabulary projection costs more per drafted token than the drafter's decoder
layer; projecting onto N ≪ V rows cuts that. Losslessness is untouched: the drafter's distribution over
the full target vocabulary is its softmax over the N rows, zero elsewhere (logits -inf outside), and the
walker verifies whatever it proposes against the target (treespec/walker.py).

A vocabulary is stored as EAGLE-3 stores it: ``d2t`` (int64 [N], target id = draft id + d2t[draft id])
and ``t2d`` (bool [V], whether a target id is in the draft vocabulary); draft ids follow target order.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from treespec.heads.drafting.lean import LeanProjection
from treespec.io import atomic_write, load_safetensors

VOCAB_FILE = "draft_vocab.safetensors"  # a training vocabulary's ids, beside a drafter's weights (DraftVocab.save)


def token_counts(tokens: torch.Tensor, vocab: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """How often each token id occurs in ``tokens`` (any shape) where ``mask`` (same shape, loss mask) is
    True → LongTensor [vocab]."""
    tokens = torch.as_tensor(tokens).long()
    if mask is not None:
        tokens = tokens[torch.as_tensor(mask, dtype=torch.bool)]
    return torch.bincount(tokens.flatten(), minlength=vocab)[:vocab]


class DraftVocab:
    """The target ids a drafter's lm_head covers. ids: sorted LongTensor [N]; vocab_size: V."""

    def __init__(self, ids: torch.Tensor, vocab_size: int):
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(f"a draft vocabulary is 1..{vocab_size} distinct sorted ids below {vocab_size}, got "
                             f"{ids.numel()} ids")
        self.ids, self.vocab_size = ids, int(vocab_size)

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def is_full(self) -> bool:
        return len(self) == self.vocab_size

    @classmethod
    def most_frequent(cls, token_counts: torch.Tensor, size: int) -> DraftVocab:
        """The ``size`` most frequent target ids in ``token_counts`` [V] (ties go to the smaller id)."""
        counts = torch.as_tensor(token_counts).flatten()
        if not 1 <= size <= counts.numel():
            raise ValueError(f"draft vocabulary size must be in 1..{counts.numel()} (the target's), got {size}")
        order = torch.sort(counts.to(torch.float64), descending=True, stable=True).indices  # stable: ties by id
        return cls(order[:size].sort().values, counts.numel())

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> DraftVocab:
        """From EAGLE-3's buffers; they must describe the same ids."""
        ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
        if not torch.equal(torch.nonzero(t2d).flatten().cpu(), ids.cpu()):
            raise ValueError(f"d2t [{d2t.numel()}] and t2d [{t2d.numel()}] do not describe one draft vocabulary")
        return cls(ids.cpu(), t2d.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(len(self))

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask

    def scatter(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., N] → [..., V] with -inf outside the draft vocabulary (probability exactly zero there)."""
        if self.is_full:
            return draft_logits
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.ids.to(draft_logits.device), draft_logits)

    def projection(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a full lm_head weight [V, h] this vocabulary keeps: [N, h] (slice once, reuse)."""
        return weight[self.ids.to(weight.device)]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden [..., h] through the kept rows [N, h] of a bias-free lm_head → full logits [..., V]."""
        return self.scatter(F.linear(hidden, rows))

    def save(self, path) -> None:
        """One safetensors file (ids, vocab_size), written atomically; ``load`` reads it back."""
        tensors = {"ids": self.ids.contiguous(), "vocab_size": torch.tensor(self.vocab_size)}
        atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp)))

    @classmethod
    def load(cls, path) -> DraftVocab:
        tensors = load_safetensors(path, "draft vocabulary")
        return cls(tensors["ids"], int(tensors["vocab_size"]))



class ReducedHead(nn.Module):
    """FR-Spec (Zhao et al. 2025): a drafter's bias-free lm_head restricted to a draft vocabulary, with no
    retraining. hidden [..., h] → logits over the full target vocabulary [..., V], -inf outside the
    vocabulary; costs N/V of the full projection. The kept rows are sliced once, at construction."""

    def __init__(self, lm_head: nn.Module, vocab: DraftVocab, *, lean: bool = False):
        super().__init__()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("a reduced draft vocabulary needs a bias-free lm_head")
        if lm_head.weight.shape[0] != vocab.vocab_size:
            raise ValueError(f"the lm_head has {lm_head.weight.shape[0]} rows but the draft vocabulary indexes a "
                             f"{vocab.vocab_size}-token vocabulary")
        self.vocab = vocab
        self.register_buffer("rows", vocab.projection(lm_head.weight.detach()), persistent=False)  # [N, h]
        # lean: the kept rows through a few-row projection on CPUs (heads/drafting/lean.py)
        self.lean = LeanProjection(self.rows) if lean else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.vocab.scatter(self.lean(hidden))
        return self.vocab.logits(hidden, self.rows)


class TrainingVocab:
    """A mixin for drafter models that project through the target's frozen, bias-free lm_head (``self.lm_head``):
    a *training vocabulary* of N most frequent tokens, learnt through those N rows only (the head is most of a
    training step on a small target), that travels with the weights (``VOCAB_FILE``) and is the drafter's FR-Spec
    vocabulary when it decodes. ``vocab`` None: the whole head."""

    vocab: DraftVocab | None = None  # until set_vocab
    _rows: list[torch.Tensor]  # the vocabulary's lm_head rows [N, H], sliced once (set_vocab empties it)

    def set_vocab(self, vocab: DraftVocab | None) -> None:
        """Train (and draft) over ``vocab``'s tokens only; None or a full one: the whole head."""
        if vocab is not None and vocab.vocab_size != self.lm_head.weight.shape[0]:
            raise ValueError(f"a training vocabulary over {vocab.vocab_size} tokens does not fit the target's "
                             f"{self.lm_head.weight.shape[0]}-token head")
        self.vocab, self._rows = (None if vocab is None or vocab.is_full else vocab), []

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [..., H] → logits over the training vocabulary [..., N] (draft ids, in target-id order; without
        one, all V). Its rows are sliced once (the head is frozen)."""
        if self.vocab is None:
            return self.lm_head(out)
        weight = self.lm_head.weight
        if not self._rows or self._rows[0].device != weight.device or self._rows[0].dtype != weight.dtype:
            self._rows = [self.vocab.projection(weight.detach())]
        return F.linear(out, self._rows[0])

    def save_vocab(self, folder) -> None:
        """Write the training vocabulary beside the weights; remove an earlier export's from the same folder."""
        path = Path(folder) / VOCAB_FILE
        if self.vocab is not None:
            self.vocab.save(path)
        elif path.exists():
            path.unlink()

    def load_vocab(self, folder) -> None:
        """Take the training vocabulary saved in ``folder``, if there is one (a ValueError names a bad file)."""
        path = Path(folder) / VOCAB_FILE
        if path.exists():
            try:
                self.set_vocab(DraftVocab.load(path))
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
