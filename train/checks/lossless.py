"""The references losslessness is checked against: transformers' own greedy decoding (greedy output must equal
it token for token), a chi-square goodness of fit (sampled output must follow the target's law), and a
jittered copy of a model (a draft that agrees with it often, not always, so paths are both accepted and
rejected). The architecture matrix (train/checks/architectures.py) and the test suite use the same three.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import torch


def hf_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """transformers' own greedy decoding, the reference for token-for-token equality."""
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)


def perturbed(model, scale: float = 0.5, seed: int = 1):
    """A copy of ``model`` with every weight jittered: agrees with it often, not always."""
    g = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():  # drawn on the CPU, then moved: the same copy on every device
            p.add_(torch.randn(p.shape, generator=g).to(p) * p.std().nan_to_num(0.0) * scale)
    return other


def chi2_pvalue(counts, expected_probs):
    """Chi-square goodness of fit; impossible outcomes that occur give 0; cells with expected count < 5
    are merged into one. Needs an informative case: several outcomes with a fair expected count."""
    from scipy.stats import chisquare  # scipy is a development dependency (setup.cfg's dev extra)

    observed = counts.ravel().astype(np.float64)
    expected = expected_probs.ravel() * observed.sum()
    impossible = expected == 0
    if observed[impossible].sum() > 0:
        return 0.0
    observed, expected = observed[~impossible], expected[~impossible]
    small = expected < 5
    assert (~small).sum() >= 4, "degenerate test case: too few outcomes with a fair expected count"
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def enumerate_law(model, prompt: torch.Tensor, sampling, vocab: int, new: int = 3) -> np.ndarray:
    """P(x1 .. x_new | prompt) under ``sampling``, enumerated with the model's own cache-free forward over every
    prefix: array [vocab] * new (tiny vocabularies only: vocab ** (new − 1) forwards)."""
    from treespec.sampling import probs

    law = np.zeros((vocab,) * new)
    with torch.no_grad():
        for prefix in itertools.product(range(vocab), repeat=new - 1):
            ids = torch.cat([prompt, torch.tensor([prefix], dtype=prompt.dtype)], dim=1).to(model.device)
            p = probs(model(input_ids=ids).logits[0, -new:], sampling).double().cpu().numpy()  # [new, V]
            law[prefix] = np.prod([p[i, prefix[i]] for i in range(new - 1)]) * p[new - 1]
    return law
