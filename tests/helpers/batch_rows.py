"""Batches of rows for the batch tests (tests/core/test_batch.py, tests/core/test_batch_trees.py): ragged
left-padded prompts and transformers' batched greedy reference, a drafter of each kind on a tiny target, and the
per-row sampling law (three prompts of different lengths, their exact three-token distributions, counts of sampled
continuations drawn as batches)."""

import numpy as np
import torch

from treespec import generate
from treespec.heads import DraftModel, PromptLookup
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.eagle import Eagle
from treespec.heads.eagle3 import Eagle3
from treespec.heads.medusa import Medusa
from treespec.inputs import left_padded
from treespec.sampling import Sampling, probs

from .models import perturbed, random_eagle, random_eagle3, random_heads

BATCH_LENGTHS = (3, 17, 9, 1)  # very different prompt lengths, one of a single token


def batch(lengths=BATCH_LENGTHS, seed=3, vocab=64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return left_padded([torch.randint(0, vocab, (n,), generator=g) for n in lengths], 0)


def hf_batch_greedy(model, ids, mask, new, eos=None) -> torch.Tensor:
    """transformers' batched greedy decoding of the same left-padded batch: the reference."""
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0,
                          eos_token_id=eos)


BATCH_DRAFTERS = {
    "draft": lambda t: DraftModel(perturbed(t, 0.1)),  # agrees often, not always: rows accept different lengths
    "draft-fr": lambda t: DraftModel(perturbed(t, 0.1), draft_vocab=DraftVocab.most_frequent(
        torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(0)), 24)),
    "prompt-lookup": lambda t: PromptLookup(max_ngram=2),
    "medusa": lambda t: Medusa(random_heads(t)),
    "eagle": lambda t: Eagle(random_eagle(t)),
    "eagle-fused": lambda t: Eagle(random_eagle(t, (1, 2, -1))),
    "eagle3-fr": lambda t: Eagle3(random_eagle3(t, draft_vocab=24)),
}
STATIC_ONLY = {"prompt-lookup", "medusa"}


ROW_VOCAB, ROW_NEW = 4, 3
ROW_PROMPTS = [[1, 3, 0, 1, 3], [2], [0, 0, 1, 2, 3, 1, 0]]
ROW_RUNS = 1500  # as FR-Spec's cases: the negative control still fails by a wide margin
ROW_COPIES = 10  # copies of ROW_PROMPTS per generate() call: 30 ragged rows, 150 calls


def exact_row_distribution(model, prompt: list[int], sampling: Sampling) -> np.ndarray:
    """P(x1, x2, x3 | prompt) by enumeration: array [V, V, V]."""
    dist = np.zeros((ROW_VOCAB,) * ROW_NEW)
    with torch.no_grad():
        for prefix in np.ndindex(*(ROW_VOCAB,) * (ROW_NEW - 1)):
            ids = torch.tensor([prompt + list(prefix)])
            p = probs(model(input_ids=ids).logits[0, -ROW_NEW:], sampling).double().numpy()
            dist[prefix] = p[0, prefix[0]] * p[1, prefix[1]] * p[2]
    return dist


def sampled_rows(model, drafter, tree, sampling, runs=ROW_RUNS, copies=ROW_COPIES) -> list[np.ndarray]:
    """Counts of each prompt of ROW_PROMPTS's continuations over ``runs`` samples, drawn as batches of ``copies``
    copies of ROW_PROMPTS: every row of a batch is an independent sample (the rows draw in turn from one generator)."""
    gen = torch.Generator().manual_seed(0)
    counts = [np.zeros((ROW_VOCAB,) * ROW_NEW) for _ in ROW_PROMPTS]
    for _ in range(runs // copies):
        out = generate(model, ROW_PROMPTS * copies, drafter=drafter, tree=tree, max_new_tokens=ROW_NEW,
                       temperature=sampling.temperature, generator=gen)
        for r, row in enumerate(out.sequences[:, -ROW_NEW:].tolist()):
            counts[r % len(ROW_PROMPTS)][tuple(row)] += 1
    return counts
