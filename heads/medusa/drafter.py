"""The Medusa drafter (heads/medusa/network.py: the heads): one call of the heads on the feature that produced the
root fills the whole tree, and the heads' per-depth rank accuracy.
"""

from __future__ import annotations

import torch
from einops import rearrange

from treespec.drafter import Drafter, Proposals
from treespec.heads.drafting.lean import LeanProjection
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.heads.medusa.network import MedusaHeads
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.target_states import target_hidden
from treespec.sampling import GREEDY, Sampling, top_k
from treespec.tree import Tree


class Medusa(Drafter):
    """The drafter: one call of the heads on the feature that produced the root fills the whole tree."""

    needs_features = True
    fills_tree_at_once = True

    def __init__(self, heads: MedusaHeads, *, default_tree: Tree | None = None, draft_vocab: DraftVocab | None = None,
                 lean: bool = True):
        """draft_vocab: project onto these target ids only (FR-Spec, heads/drafting/vocab.py; still lossless).
        lean: heads sharing the target's lm_head project all depths in one product through a lean projection of
        it (heads/drafting/lean.py) instead of one matrix-vector product per head."""
        self.heads = heads.eval()
        self.max_tree_depth = heads.num_heads  # head k fills depth k + 1
        self.max_tree_depth_note = (f"its {heads.num_heads} heads fill one depth each; give a tree of depth <= "
                                    f"{heads.num_heads}, or train more heads (drafter.num_heads in "
                                    f"conf/drafter/medusa.yaml: scripts/train_heads.py drafter=medusa)")
        self.default_tree = default_tree if default_tree is not None else Tree.chain(min(3, heads.num_heads))
        self._projections = heads.reduced(draft_vocab) if draft_vocab is not None else None
        shared = heads.shared_lm_head
        self._shared = None
        if lean and shared is not None:
            self._shared = ReducedHead(shared, draft_vocab, lean=True) if draft_vocab is not None else \
                LeanProjection.of(shared)

    def check_target(self, target) -> None:
        self.heads.check_fits(target)
        self.heads.to(device=target.device, dtype=target.dtype)  # heads built or loaded for another dtype
        for projection in [*(self._projections or ()), *([self._shared] if self._shared is not None else [])]:
            projection.to(device=target.device, dtype=target.dtype)

    def logits(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        """The first ``depth`` heads on features [..., h] → their logits [depth, ..., V]."""
        if self._shared is not None:  # one [D, h] × [h, V] product for every depth
            return self._shared(self.heads.blocks_out(feature, depth))
        return self.heads(feature, heads=depth, projections=self._projections)

    @torch.no_grad()
    def propose(self, committed, feature, tree: Tree, sampling: Sampling, generator=None) -> Proposals:
        if tree.depth > self.heads.num_heads:
            raise ValueError(f"{tree!r} is deeper than Medusa can fill: {self.max_tree_depth_note}")
        logits = self.logits(feature, tree.depth)  # [D, b, V]: depth d + 1 of each row
        top = rearrange(top_k(logits, max(tree.top_k_per_depth())), "d b k -> b d k")  # [b, D, K]
        depths, ranks = tree.depths[1:].to(top.device), tree.ranks[1:].to(top.device)
        return Proposals.shared(tree, top[:, depths - 1, ranks])  # [b, n]

    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One proposal's heads as the drafter runs them (lean or not): every head on each row's feature (it fills
        the whole tree in one call; it keeps no cache, so the sizes do not apply)."""
        weight = self.heads.blocks[0][0].linear.weight
        feature = torch.randn(batch, self.heads.config["hidden_size"], device=weight.device, dtype=weight.dtype)
        return torch.no_grad()(lambda: self.logits(feature, self.heads.num_heads))


@torch.no_grad()
def rank_accuracy(target, heads: MedusaHeads, windows: torch.Tensor, *, top_k: int = 10, batch_size: int = 8,
                  sampling: Sampling = GREEDY, first_root: int = 0) -> list[list[float]]:
    """acc[k][r]: the chance that head k's rank-r token at t is the token t + k + 2 the target emits
    (heads/training/accuracy.py), teacher forced on ``windows`` [n, s + 1], from root ``first_root`` on. The walker
    accepts
    the target's own choices, not the corpus's, so that is what the heads are scored against."""
    counter = RankHits(heads.num_heads, top_k, sampling)
    for batch in windows.split(batch_size):
        _, hidden = target_hidden(target, batch[:, :-1])  # [b, s, h]
        target_logits = target.get_output_embeddings()(hidden)  # [b, s, V]: the target's token t + 1
        logits = heads(hidden)  # [K, b, s, V]
        s = hidden.shape[1]
        first = max(0, first_root - 1)  # head 0 at t guesses t + 2, the target's t + 1 the root
        for k in range(heads.num_heads):
            top = logits[k, :, first : s - k - 1].topk(top_k, dim=-1).indices  # [b, s-k-1-first, R]
            counter.add(k, top, target_logits[:, k + 1 + first :])
    return counter.table()
