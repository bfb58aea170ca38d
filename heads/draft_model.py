"""A separate small causal LM as the drafter (the seed's setup; Leviathan et al. 2023, Chen et al. 2023).

The draft expands the tree one depth at a time: one forward over every node of depth d that has
children gives the draft distribution at those nodes, from which their children are chosen — the
top-k ranks (deterministic candidates) or i.i.d. samples (``candidates="sample"`` at temperature > 0,
the classic speculative-sampling chain). A chain is the width-1 case, i.e. ordinary autoregressive
drafting. The draft keeps its own KV cache: committed tokens it has already seen stay cached, the
tree nodes it expanded are compacted to the accepted path after each step (treespec/cache.py).
"""

from __future__ import annotations

import torch

from treespec.cache import keep_tree_path
from treespec.masks import ancestor_mask
from treespec.sampling import Sampling, probs, sample
from treespec.tree import Tree

from .base import Drafter, Proposal, check_same_vocab


class DraftModel(Drafter):
    def __init__(self, model, *, default_tree: Tree | None = None, candidates: str = "topk"):
        """candidates: "topk" (deterministic ranks) or "sample" (i.i.d. from q_draft when temperature > 0)."""
        if candidates not in ("topk", "sample"):
            raise ValueError(f"candidates must be 'topk' or 'sample', got {candidates!r}")
        self.model = model.eval()
        self.default_tree = default_tree if default_tree is not None else Tree.chain(4)
        self.candidates = candidates
        self.reset()

    def check_target(self, target) -> None:
        check_same_vocab(self.model, target, "draft model")

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.n_cached = 0          # committed tokens held in self.cache
        self._expanded = None      # node indices whose keys/values follow the committed prefix

    @torch.no_grad()
    def propose(self, committed, feature, tree: Tree, sampling: Sampling, generator=None) -> Proposal:
        device, dtype = self.model.device, self.model.dtype
        pending = committed[:, self.n_cached :].to(device)  # [1, m]: committed tokens not yet seen, root last
        vocab = self.model.get_output_embeddings().weight.shape[0]
        draw = self.candidates == "sample" and not sampling.greedy
        tokens = torch.zeros(tree.num_nodes, dtype=torch.long, device=device)  # [N], root slot unused
        q_draft = torch.zeros(tree.num_nodes, vocab, device=device) if draw else None  # [N, V]

        # depth 0: the pending committed tokens (plain causal attention), whose last logits are the root's
        logits = self.model(input_ids=pending, cache=self.cache, use_cache=True).logits[0, -1:]  # [1, V]
        self.n_cached += pending.shape[1]
        frontier = [0]
        expanded: list[int] = []
        for depth in range(1, tree.depth + 1):
            q = probs(logits, sampling)  # [F, V]: draft distribution at each frontier node
            for row, node in enumerate(frontier):
                kids = tree.children[node]
                if not kids:
                    continue
                if draw:
                    q_draft[node] = q[row]
                    picks = sample(q[row].expand(len(kids), -1), generator)
                else:  # rank r child = the r-th most likely draft token
                    ranks = tree.ranks[kids]
                    picks = logits[row].topk(int(ranks.max()) + 1).indices[ranks.to(device)]
                tokens[kids] = picks
            if depth == tree.depth:
                break
            # expand every node of this depth that has children: one forward over all of them
            frontier = [i for i in range(1, tree.num_nodes) if tree.depths[i] == depth and tree.children[i]]
            if not frontier:
                break
            kv_nodes = expanded + frontier
            allowed = tree.ancestors[frontier][:, kv_nodes]  # [F, K]: each node sees its expanded ancestors
            logits = self.model(
                input_ids=tokens[frontier][None],
                attention_mask=ancestor_mask(allowed, self.n_cached, dtype=dtype, device=device),
                position_ids=(self.n_cached - 1 + tree.depths[frontier])[None].to(device),
                cache=self.cache,
                use_cache=True,
            ).logits[0]  # [F, V]
            expanded = kv_nodes
        self._expanded = expanded
        return Proposal(tree=tree, tokens=tokens[1:], q_draft=q_draft)

    def accept(self, path: torch.Tensor, features) -> None:
        # Keep the cache entries of expanded nodes that lie on the accepted path; they form a prefix of
        # the path, since nodes were expanded depth by depth. Unkept path tokens stay "pending".
        on_path = set(path.tolist())
        keep = [j for j, node in enumerate(self._expanded) if node in on_path]
        keep_tree_path(self.cache, self.n_cached, torch.tensor(keep, dtype=torch.long, device=self.model.device))
        self.n_cached += len(keep)
        self._expanded = None
