"""Prompt lookup: draft by n-gram match in the context, no model and no training.

(Saxena 2023, "prompt lookup decoding"; transformers' ``prompt_lookup_num_tokens``.) For each tree node,
the last ``n`` tokens of its context (committed sequence + the node's path) are searched for in the
committed sequence, longest n first; the tokens that followed earlier occurrences, most recent first and
without repeats, are the node's ranked children. Ranks with no candidate are pruned, so the proposal's
tree is a subtree of the requested one (possibly empty: then the step is a plain decoding step).
Candidates are a deterministic function of the context, hence verified losslessly (walker.py). A batch's
rows are looked up one by one on the host, each in its own context; a row's pruned tree is its own.
"""

from __future__ import annotations

import torch

from treespec.drafter import Committed, Drafter, Proposal, Proposals
from treespec.sampling import Sampling
from treespec.tree import Tree


class PromptLookup(Drafter):
    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, default_tree: Tree | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.default_tree = default_tree if default_tree is not None else Tree.chain(4)

    def _continuations(self, seq: torch.Tensor, windows: dict, context: list[int], k: int) -> list[int]:
        """Up to k distinct tokens that followed earlier occurrences of the context's suffix."""
        found: list[int] = []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > len(context) or n not in windows:
                continue
            suffix = torch.tensor(context[-n:])
            hits = torch.nonzero((windows[n] == suffix).all(-1)).flatten()  # starts j with seq[j:j+n] == suffix
            for j in reversed(hits.tolist()):  # most recent first
                token = int(seq[j + n])
                if token not in found:
                    found.append(token)
                    if len(found) == k:
                        return found
        return found

    def propose(self, committed: Committed, feature, tree: Tree, sampling: Sampling, generator=None) -> Proposals:
        tokens = committed.tokens.cpu()
        return Proposals.stack([self.propose_row(tokens[b, :n], tree) for b, n in enumerate(committed.lengths)])

    def propose_row(self, seq: torch.Tensor, tree: Tree) -> Proposal:
        """One row's proposal from its committed tokens ``seq`` [L] (on the host), the root last."""
        # windows[n]: [L - n, n], every n-gram of seq that has a following token
        windows = {n: seq[:-1].unfold(0, n, 1) for n in range(self.min_ngram, self.max_ngram + 1) if len(seq) > n}
        kids_needed = [0] * tree.num_nodes  # how many ranked children each node asks for
        for i in range(1, tree.num_nodes):
            p = int(tree.parents[i])
            kids_needed[p] = max(kids_needed[p], int(tree.ranks[i]) + 1)
        token_of: dict[int, int] = {}
        context_of: dict[int, list[int]] = {0: seq[-self.max_ngram :].tolist()}  # last n-gram only
        candidates_of: dict[int, list[int]] = {}
        for i in range(1, tree.num_nodes):  # parents come before children
            p = int(tree.parents[i])
            if p not in context_of:
                continue  # parent was pruned
            if p not in candidates_of:
                candidates_of[p] = self._continuations(seq, windows, context_of[p], kids_needed[p])
            rank = int(tree.ranks[i])
            if rank < len(candidates_of[p]):
                token_of[i] = candidates_of[p][rank]
                context_of[i] = (context_of[p] + [token_of[i]])[-self.max_ngram :]
        kept = sorted(token_of)
        # the whole tree filled: hand back the same Tree, so its mask parts are reused (generate's per-run masks)
        subtree = tree if len(kept) == len(tree) else Tree([tree.paths[i - 1] for i in kept])
        return Proposal(tree=subtree, tokens=torch.tensor([token_of[i] for i in kept], dtype=torch.long))
