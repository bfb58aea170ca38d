"""The EAGLE-3 drafter and its kind: the Eagle drafter's expansion (heads/eagle/drafter.py) over an Eagle3Model
(heads/eagle3/network.py: what it computes, its aux layers, draft vocabulary and folder).
"""

from __future__ import annotations

import torch

from treespec.heads.eagle.drafter import Eagle
from treespec.heads.eagle3.network import Eagle3Model
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.target_states import target_states
from treespec.heads.training.unroll import unrolled
from treespec.sampling import GREEDY, Sampling


class Eagle3(Eagle):
    """The EAGLE-3 drafter: the Eagle drafter's expansion (autoregressive over its own outputs, static or
    dynamic trees) over an Eagle3Model, whose distribution over the target vocabulary is zero outside the
    draft vocabulary. Default tree DynamicTree(16, 5, 4), as Eagle's."""


@torch.no_grad()
def rank_accuracy(target, model: Eagle3Model, windows: torch.Tensor, *, depth: int = 8, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY, first_root: int = 0) -> list[list[float]]:
    """acc[d][r] (heads/training/accuracy.py): the chance that the drafter's rank-r token at draft depth d + 1 is the
    one the target emits (``walker.rank_acceptance``: greedy, that it is the target's argmax), drafting from
    each root over its own outputs along the window's tokens (what an accepted tree path feeds it), on
    held-out ``windows`` [n, S], from root ``first_root`` on (heads/training/accuracy.py). Ranks are the drafter's, over
    the target vocabulary (as it proposes them)."""
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    for batch in windows.split(batch_size):
        batch = batch.to(model.device)
        features, target_logits = target_states(target, batch, model.aux_layers)
        first = max(0, first_root - 1)  # entry r guesses token r + 2 at depth 1: root r + 1
        for i, out in unrolled(model, batch, model.fuse(features[:, :-1]), depth - 1, by_root=True):
            counter.add(i, model.logits(out[:, first:]).topk(top_k, dim=-1).indices, target_logits[:, 1 + i + first :])
    model.train(was_training)
    return counter.table()
