"""DFlash drafters that the tests under tests/heads/dflash/ (their conftest.py)
share: the tiny target they draft for, the test prompt, a random drafter and one overfit on the target's own greedy
continuations."""

import torch

from treespec.heads import DFlashModel
from treespec.heads.dflash.objective import dflash_loss

from .models import hf_greedy, tiny_llama


def dflash_target():
    return tiny_llama(layers=4, seed=0).requires_grad_(False)


def dflash_prompt() -> torch.Tensor:
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


def random_dflash(target, seed=0, **options):
    torch.manual_seed(seed)
    return DFlashModel(target, **{"block_size": 4, **options}).eval()


def trained_dflash(target, prompt, model=None):
    """A block-4 drafter (``model``, else a random one) overfit on the target's own greedy continuations (the test
    prompt's among them): it is often right, so rows accept different lengths."""
    g = torch.Generator().manual_seed(0)
    data = hf_greedy(target, torch.cat([prompt, torch.randint(0, 64, (15, 9), generator=g)]), 24)
    model = (random_dflash(target) if model is None else model).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss, _ = dflash_loss(target, model, data, anchors=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()
