"""Losslessness through generate() on a tiny vocabulary: the exact law of a 3-token continuation, enumerated
from the target's own forward passes, and the counts that sampled generations give, for a chi-square test."""

import itertools
import os

import numpy as np
import torch

from treespec import generate
from treespec.sampling import Sampling, probs
from treespec.train.checks.lossless import chi2_pvalue  # noqa: F401 - one implementation, shared with the matrix
from treespec.walker import Walk

# 20k generations per case take ~90 s each on one CPU core; the default suite runs 3k per case (as many as
# the negative control of tests/test_lossless.py, which they reject by a wide margin) to stay within its time
# budget. Set TREESPEC_LOSSLESS_RUNS=20000 for the full-strength test.
VOCAB, NEW = 4, 3
RUNS = int(os.environ.get("TREESPEC_LOSSLESS_RUNS", 3000))
ROWS = 50  # prompts per generate() call: a batch of independent samples (sampled_counts)
PROMPT = torch.tensor([[1, 3, 0, 1, 3]])


def exact_distribution(target, sampling: Sampling, new: int = NEW) -> np.ndarray:
    """P(x1, .., x_new | prompt) by enumeration under the same temperature / top-p: array [V] * new (3 tokens by
    default; 4 lets a first step's tree reach depth 2)."""
    dist = np.zeros((VOCAB,) * new)
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=new - 1):
            ids = torch.cat([PROMPT, torch.tensor([prefix])], dim=1).to(target.device)
            p = probs(target(input_ids=ids).logits[0, -new:], sampling).double().cpu().numpy()  # [new, V]
            dist[prefix] = np.prod([p[i, token] for i, token in enumerate(prefix)]) * p[-1]
    return dist


def sampled_counts(target, drafter, tree, sampling: Sampling, runs: int = RUNS, seed: int = 0,
                   acceptance: str = "rejection", rows: int = ROWS, new: int = NEW) -> np.ndarray:
    """How often each ``new``-token continuation came out of generate(): array [V] * new. ``rows`` (> 1) decodes that
    many copies of the prompt per call, a batch whose rows draw in turn from the one generator, so each row is an
    independent sample (rows accept different lengths: the ragged-batch path, docs/batch.md); for a drafter
    that drafts one prompt at a time, pass ``rows=1``. Batches divide the calls, and the suite's time, by ``rows``."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB,) * new)
    for start in range(0, runs, rows):
        batch = PROMPT.repeat(min(rows, runs - start), 1)  # [b, P]
        out = generate(target, batch, drafter=drafter, tree=tree, max_new_tokens=new, acceptance=acceptance,
                       temperature=sampling.temperature, top_p=sampling.top_p, generator=gen)
        for row in out.sequences[:, PROMPT.shape[1]:].tolist():
            counts[tuple(row)] += 1
    return counts


def accept_everything(logits, proposal, sampling, **kwargs):
    """A biased walk for the negative controls: accepts a whole leaf path whatever p_target says, then takes the
    argmax. Monkeypatched in for ``treespec.generate.walk_rows`` (through ``walker.row_by_row``), it must fail
    the chi-square tests."""
    path = torch.tensor(proposal.tree.leaf_paths[0]) if len(proposal.tree) else torch.empty(0, dtype=torch.long)
    last = int(path[-1]) if len(path) else 0
    return Walk(path=path, next_token=int(probs(logits[last], sampling).argmax()))
