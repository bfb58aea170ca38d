"""Logits → probabilities, shared by the target (p_target) and every drafter (q_draft).

Losslessness needs the walker to compare the target's *sampling* distribution, i.e. after
temperature and top-p, with the distribution the drafter actually drew its candidates from; both sides
therefore go through ``probs`` with the same ``Sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


GREEDY = Sampling()


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Sampling distribution over the vocabulary. logits: [..., V] → float32 [..., V].

    Greedy gives the one-hot of the argmax, so greedy decoding is the temperature → 0 limit and the
    walker needs no special case for it in the distributions it sees.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(argmax(logits, check_finite=True), logits.shape[-1]).float()
    # Subtract the max before dividing: logits / T overflows to inf (then NaN) for tiny T, while the shifted
    # logits only go to -inf, which is the exact T → 0 limit (the argmax, ties shared). T below float32's
    # smallest normal number would round to 0 in the division (0 / 0 = NaN): it divides as that number, which
    # already sends every logit difference a float32 can hold to -inf.
    temperature = max(sampling.temperature, torch.finfo(torch.float32).tiny)
    p = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    if sampling.top_p < 1.0:
        p = nucleus(p, sampling.top_p)
    return p


def nucleus(p: torch.Tensor, top_p: float, first_k: int = 64) -> torch.Tensor:
    """Top-p (Holtzman et al. 2020): keep the smallest set of most likely tokens whose mass reaches
    ``top_p`` (the top token always survives), renormalised. p: [..., V].

    The nucleus is found among the top k tokens, k doubling from ``first_k`` until every row's cut falls
    inside them: a full sort of the vocabulary per row costs far more than a small top-k."""
    k = min(first_k, p.shape[-1])
    while True:
        top_p_values, order = p.topk(k, dim=-1)  # [..., k], descending
        mass_before = top_p_values.cumsum(-1) - top_p_values
        if k == p.shape[-1] or bool((mass_before[..., -1] >= top_p).all()):
            break
        k = min(2 * k, p.shape[-1])
    kept = top_p_values.masked_fill(mass_before >= top_p, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(p).scatter_(-1, order, kept)


def argmax(logits: torch.Tensor, check_finite: bool = False) -> torch.Tensor:
    """``logits.argmax(-1)``: [..., V] → LongTensor [...], the first maximal index of each row.

    A float32/float64 CPU tensor goes through numpy: torch's CPU argmax is a scalar loop, numpy's is
    vectorised, an order of magnitude faster on a vocabulary-wide row. Greedy decoding takes one per step
    and a tree pass one per node, so this is engine time. Both return the first maximum on ties and the
    first NaN when there is one.

    ``check_finite``: raise ValueError when a row's chosen logit is NaN or infinite (a row holding a NaN
    chooses it, a row holding +inf or only -inf chooses a non-finite one), as sampling does: greedy decoding
    of a broken model is an error, never token 0. Only the chosen values are checked, one per row."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        array = logits.numpy()
        index = np.asarray(array.argmax(-1))  # a 1-D row gives a numpy scalar
        if check_finite and not np.isfinite(np.take_along_axis(array, index[..., None], -1)).all():
            raise ValueError(NOT_FINITE)
        return torch.from_numpy(index).to(logits.device)  # (a no-op: where the logits live, as on an accelerator)
    index = logits.argmax(-1)
    if check_finite and not bool(torch.isfinite(logits.gather(-1, index[..., None])).all()):
        raise ValueError(NOT_FINITE)
    return index


NOT_FINITE = ("cannot decode greedily: the target's logits hold NaN or infinite values (a model producing NaN/inf: "
              "check its weights and dtype)")


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, descending: [..., V] → LongTensor [..., k]. k = 1 (a
    chain's one candidate) is ``argmax``, several times cheaper than torch.topk on a CPU."""
    return argmax(logits)[..., None] if k == 1 else logits.topk(k, dim=-1).indices


def generator_device(generator: torch.Generator | None) -> torch.device:
    """Where ``generator`` draws (None: the global CPU generator); a draw must be made on its device."""
    return generator.device if generator is not None else torch.device("cpu")


def sample_without_replacement(p: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k distinct draws from p ([V], normalised or not), in draw order: LongTensor [k].

    Gumbel-top-k (Kool, van Hoof and Welling 2019, "Stochastic Beams and Where to Find Them"): the k largest
    log p(x) + Gumbel noise, in descending order, are distributed as k draws one after another, each from p
    with the earlier draws removed and renormalised. When p has fewer than k tokens with mass, the rest are
    zero-mass tokens chosen by p alone (deterministic given the context; the walker treats them so)."""
    u = torch.rand(p.shape, generator=generator, device=generator_device(generator)).to(p.device)
    keys = p.float().log() - torch.log(-torch.log(u))  # log p + Gumbel(0, 1); log 0 = -inf never wins
    return keys.topk(k).indices


def sample(p: torch.Tensor, generator: torch.Generator | None = None, *, check: bool = True) -> torch.Tensor:
    """One draw per row of p (non-negative, normalised or not): [..., V] → LongTensor [...].

    Inverse-CDF sampling: one uniform u per row from ``generator`` (on the generator's device), and the first
    token whose float64 cumulative mass reaches (1 − u)·total, a point in (0, total]: the token always has mass,
    and rounding never runs past the last one. About ten times cheaper than torch.multinomial for one draw on a
    CPU. ``check``: raise ValueError on a row that is empty or not finite, a host read (generate's walk takes
    ``sample_flagged`` and reads the flags with the step's tokens); unchecked, such a row gives some index."""
    index, invalid = sample_flagged(p, generator)
    if check and bool(invalid.any()):
        raise ValueError(CANNOT_SAMPLE)
    return index


def sample_flagged(p: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` without the check: (the draws [...], BoolTensor [...]: the row was empty or not finite)."""
    flat = p.reshape(-1, p.shape[-1])
    cdf = flat.double().cumsum(-1)  # [R, V]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64,
                   device=generator_device(generator)).to(p.device)
    total = cdf[:, -1:]  # [R, 1]
    index = torch.searchsorted(cdf, (1.0 - u) * total).clamp_(max=p.shape[-1] - 1)  # [R, 1]
    invalid = ~(torch.isfinite(total) & (total > 0))
    return index.reshape(p.shape[:-1]), invalid.reshape(p.shape[:-1])


CANNOT_SAMPLE = "cannot sample: the distribution is empty or not finite (NaN or inf logits from the model?)"
