"""Logits → probabilities, shared by the target (p_target) and every drafter (q_draft).

Losslessness needs the walker to compare the target's *sampling* distribution, i.e. after
temperature and top-p, with the distribution the drafter actually drew its candidates from; both sides
therefore go through ``probs`` with the same ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Sampling distribution over the vocabulary. logits: [..., V] → float32 [..., V].

    Greedy gives the one-hot of the argmax, so greedy decoding is the temperature → 0 limit and the
    walker needs no special case for it in the distributions it sees.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    p = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        # Keep the smallest set of tokens whose mass reaches top_p (the top token always survives).
        sorted_p, order = p.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= sampling.top_p, 0.0)
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of p: [..., V] → LongTensor [...]."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(p.shape[:-1])
