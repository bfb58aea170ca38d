"""The sampling primitives every drafter and the walker share: draws follow p exactly, top-p keeps the
nucleus as defined by a full sort."""

import pytest
import torch

from treespec.sampling import Sampling, argmax, nucleus, probs, sample, top_k

from tests.helpers import chi2_pvalue


def test_draws_follow_p_and_never_pick_zero_mass():
    p = torch.tensor([0.0, 0.4, 0.0, 0.05, 0.3, 0.25, 0.0])
    draws = sample(p.expand(40_000, -1), torch.Generator().manual_seed(0))  # [40000]
    counts = torch.bincount(draws, minlength=len(p))
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts.numpy(), p.numpy()) > 1e-3


def test_unnormalised_rows_and_batch_shape():
    # the walker's residuals are not renormalised; rows are independent; shape [..., V] → [...]
    p = torch.tensor([[[0.0, 0.0, 3.0, 0.0]], [[1.0, 0.0, 0.0, 0.0]]])  # [2, 1, 4]
    out = sample(p, torch.Generator().manual_seed(0))
    assert out.shape == (2, 1) and out.tolist() == [[2], [0]]
    # the last token with mass is a valid draw even when u · total rounds up to the total
    tail = torch.zeros(1, 8).index_fill_(1, torch.tensor([1, 5]), 1e-30)
    assert set(sample(tail.expand(500, -1), torch.Generator().manual_seed(1)).tolist()) <= {1, 5}


def test_seeded_draws_are_reproducible():
    p = torch.softmax(torch.randn(5, 100), -1)
    a = sample(p, torch.Generator().manual_seed(7))
    b = sample(p, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def sorted_nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook definition: sort, keep while the mass before a token is below top_p, renormalise."""
    values, order = p.sort(dim=-1, descending=True)
    values = values.masked_fill(values.cumsum(-1) - values >= top_p, 0.0)
    out = torch.zeros_like(p).scatter_(-1, order, values)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat (a nucleus of thousands of tokens) and peaked
def test_nucleus_equals_the_sorted_definition(top_p, scale):
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * scale
    p = torch.softmax(logits, -1)
    assert torch.allclose(nucleus(p, top_p), sorted_nucleus(p, top_p), atol=1e-7)
    assert torch.allclose(probs(logits, Sampling(1.0, top_p)), sorted_nucleus(p, top_p), atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_and_top_k_equal_torch(dtype):
    # sampling.argmax takes numpy's vectorised argmax on a CPU: same indices as torch's, ties to the first
    logits = torch.randn(5, 7, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 0, [3, 200]] = 50.0  # a tie: the first maximum wins
    assert argmax(logits).equal(logits.argmax(-1)) and argmax(logits)[0, 0] == 3
    assert argmax(logits[1, 2]).equal(logits[1, 2].argmax())  # one row: a 0-d result
    assert argmax(logits[:, :, ::2]).equal(logits[:, :, ::2].argmax(-1))  # not contiguous
    assert top_k(logits, 1).equal(logits.argmax(-1, keepdim=True))
    assert top_k(logits, 4).equal(logits.topk(4, dim=-1).indices)
