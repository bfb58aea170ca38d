"""Token Recycling: draft from the target's own discarded candidates, no model and no training.

Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large Language Models with Token
Recycling". Every target pass computes logits at every node of the verified tree, rejected candidates included,
and decoding keeps one token of each. Token Recycling keeps the top-k of each instead, in an adjacency matrix
``M`` [V, k]: row t holds the k tokens the target most recently ranked highest right after token t. Each step
reads a draft tree out of ``M`` breadth-first along a static tree template, starting from the root: the child of
rank r of a node holding token t is ``M[t, r]``. After the pass the rows of every verified node's token are
overwritten with the top-k of its logits (the loop's ``observe_pass`` hook).

Everything runs on the target's device, in a handful of tensor ops per step and none per node: a depth of the
template is one gather, the update one top-k and one scatter. Nothing is read back to the host. Candidates are
fixed ranks given the matrix, which the past alone determines, so they are verified losslessly like any top-k
drafter's: greedy output equals vanilla greedy, sampled output follows the target (treespec/walker.py).

Options (docs/usage.md, "Token Recycling"):

* ``k``: the matrix's width, the most children a node can have (the paper's 8). Memory: (V + 1) × k int32 ids,
  e.g. 1 MiB for V = 32,000 and k = 8 (the extra row takes discarded writes).
* ``persistent``: the matrix outlives a generate() call (the paper's "hot start", inherited from the previous
  query); False starts every call from ``init``. ``clear()`` starts over by hand.
* ``init``: the matrix before anything was seen: "zeros" (every row drafts token 0 until the target has predicted
  after it), or a LongTensor [V, k], e.g. ``drafter.matrix`` saved from an earlier run.
* ``prompt_bigrams``: rows the target has not yet predicted after get, as their rank-0 candidate, the token that
  followed that token most recently in the prompt (not in the paper: a cold start's first steps are otherwise
  blind). Rows the target filled are never overwritten by the prompt.
"""

from __future__ import annotations

import torch

from treespec.drafter import Committed, Drafter, Proposals
from treespec.planning.analysis import grow_tree
from treespec.sampling import Sampling
from treespec.tree import Tree

# The templates: Medusa's sparse-tree rule (treespec.planning.analysis.grow_tree: the paths most likely to be
# accepted) on one rank profile, the matrix's rank 0 accepted 70 % of the time at every depth (what a chain of its
# rank-0 candidates reaches on the reference target: τ ≈ 3.4 at γ = 8) and most of the rest shared by the other ranks,
# each a quarter less likely than the one before. That gives the paper's shape: wide near the root, a rank-0 spine
# deep down.
RANK_PROFILE = [[0.7] + [0.3 * 0.9 * 0.25 * 0.75 ** (r - 1) for r in range(1, 8)] for _ in range(10)]
#: The default, sized for CPUs: 12 nodes (an 8-deep rank-0 spine and 4 alternatives near the root). On a GPU a pass
#: over 80 tokens costs about one over a single token; on a CPU a pass's cost grows with its tokens (the reference
#: target's 13-token pass costs about twice its 1-token one), so the few likeliest nodes win: on held-out code the
#: 80-node template accepts no more than this one (docs/usage.md, "Token Recycling").
RECYCLING_TREE = grow_tree(RANK_PROFILE, 12)
#: 80 nodes, 10 deep: the paper's size (its exact template is not reproduced), for GPUs.
RECYCLING_TREE_80 = grow_tree(RANK_PROFILE, 80)


def template(nodes: int = 12, k: int = 8) -> Tree:
    """The ``nodes`` likeliest paths of the rank profile using ranks below ``k`` (RECYCLING_TREE: 12, any k >= 3)."""
    profile = [row[:k] for row in RANK_PROFILE]
    return grow_tree(profile, min(nodes, sum(k**d for d in range(1, len(profile) + 1))))


class TokenRecycling(Drafter):
    observes_logits = True

    def __init__(self, *, k: int = 8, persistent: bool = True, init: str | torch.Tensor = "zeros",
                 prompt_bigrams: bool = True, default_tree: Tree | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k (the matrix's width: candidates kept per token) must be an integer >= 1, got {k!r}")
        if isinstance(init, str) and init != "zeros":
            raise ValueError(f"init must be 'zeros' or a LongTensor [V, k] (a saved matrix), got {init!r}")
        if isinstance(init, torch.Tensor) and (init.dim() != 2 or init.shape[1] != k or init.dtype.is_floating_point):
            raise ValueError(f"init must be an integer tensor [V, k={k}], got {init.dtype} {tuple(init.shape)}")
        self.k, self.persistent, self.init, self.prompt_bigrams = k, persistent, init, prompt_bigrams
        self.remembers_across_calls = persistent
        self.default_tree = default_tree if default_tree is not None else template(12, k)
        self._check_ranks(self.default_tree)
        self._matrix: torch.Tensor | None = None  # int32 [V + 1, k]: row V takes writes that must not land
        self._filled: torch.Tensor | None = None  # bool [V + 1]: rows the target has predicted after
        self._levels: tuple[Tree, list] | None = None  # the last template's per-depth index tensors

    # -- the matrix --------------------------------------------------------------------------------------------
    @property
    def matrix(self) -> torch.Tensor | None:
        """The adjacency matrix [V, k] (token ids), None before the first generate(); save it to warm-start
        another drafter (``init=``)."""
        return None if self._matrix is None else self._matrix[:-1]

    @property
    def vocab_size(self) -> int | None:
        return None if self._matrix is None else self._matrix.shape[0] - 1

    def clear(self) -> None:
        """Forget everything seen: the matrix goes back to ``init`` at the next generate()."""
        self._matrix = self._filled = None

    def _allocate(self, vocab: int, device) -> None:
        matrix = torch.zeros(vocab + 1, self.k, dtype=torch.int32, device=device)
        filled = torch.zeros(vocab + 1, dtype=torch.bool, device=device)
        if isinstance(self.init, torch.Tensor):
            if self.init.shape[0] != vocab or int(self.init.max()) >= vocab or int(self.init.min()) < 0:
                raise ValueError(f"init holds a matrix for {self.init.shape[0]} tokens (ids up to "
                                 f"{int(self.init.max())}); the target has {vocab}")
            matrix[:-1] = self.init.to(device=device, dtype=torch.int32)
            filled[:-1] = True
        self._matrix, self._filled = matrix, filled

    def check_target(self, target) -> None:
        head = target.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else target.config.vocab_size
        if self._matrix is not None and self.vocab_size != vocab:
            raise ValueError(f"this TokenRecycling's matrix was built for a vocabulary of {self.vocab_size}, the "
                             f"target has {vocab}: clear() it or use another drafter")
        if self._matrix is None:
            self._allocate(vocab, next(target.parameters()).device)

    def _check_ranks(self, tree) -> None:
        if not isinstance(tree, Tree):
            raise ValueError(f"TokenRecycling reads a static tree template, got {tree!r}")
        if len(tree) and int(tree.ranks.max()) >= self.k:
            raise ValueError(f"{tree!r} asks for rank {int(tree.ranks.max())}; the matrix keeps k={self.k} candidates "
                             f"per token: give TokenRecycling(k={int(tree.ranks.max()) + 1}) or a narrower tree")

    # -- the loop's calls ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        if not self.persistent and self._matrix is not None:  # back to init, same vocabulary and device
            self._allocate(self.vocab_size, self._matrix.device)

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        if self._matrix is None:
            raise RuntimeError("TokenRecycling has no matrix yet: generate() makes it (check_target) before prefill")
        if not self.prompt_bigrams or input_ids.shape[1] < 2:
            return
        ids = input_ids.to(self._matrix.device)
        prev, nxt = ids[:, :-1].reshape(-1), ids[:, 1:].reshape(-1)  # [b·(P-1)] bigrams, in order
        keep = ~self._filled[prev]  # the target's own predictions win over the prompt's bigrams
        if attention_mask is not None:  # left padding: a bigram that starts on a pad is none
            keep &= attention_mask[:, :-1].reshape(-1).to(keep.device).bool()
        self._write(prev, nxt[:, None], keep, columns=1)  # rank 0 only, the prompt's last occurrence winning

    def propose(self, committed: Committed, feature, tree: Tree, sampling: Sampling, generator=None) -> Proposals:
        levels = self._template(tree)
        device = self._matrix.device
        batch = len(committed.lengths)
        roots = committed.tokens[torch.arange(batch), torch.tensor(committed.lengths) - 1].to(device)  # [b]
        tokens = torch.empty(batch, tree.num_nodes, dtype=torch.long, device=device)  # [b, N], node 0 the root
        tokens[:, 0] = roots
        for nodes, parents, ranks in levels:  # breadth-first: one gather per depth
            tokens[:, nodes] = self._matrix[tokens[:, parents], ranks].long()
        return Proposals.shared(tree, tokens[:, 1:])

    def _template(self, tree: Tree) -> list:
        if self._levels is None or self._levels[0] is not tree:
            self._check_ranks(tree)
            device = self._matrix.device
            per_depth = [torch.tensor(level, device=device) for level in tree.levels[1:]]
            self._levels = (tree, [(nodes, tree.parents.to(device)[nodes], tree.ranks.to(device)[nodes])
                                   for nodes in per_depth])
        return self._levels[1]

    def observe_pass(self, tokens: torch.Tensor, trees: list[Tree], logits: torch.Tensor) -> None:
        """Each verified node's token gets the top-k of the target's logits there (Luo et al. 2024, the update)."""
        batch, n = tokens.shape
        top = logits.topk(self.k, dim=-1).indices  # [b, N, k]
        real = None
        if any(tree.num_nodes != n for tree in trees):  # rows' own trees: padding is no node
            real = torch.arange(n, device=tokens.device)[None] < torch.tensor(
                [tree.num_nodes for tree in trees], device=tokens.device)[:, None]
            real = real.reshape(-1)
        self._write(tokens.reshape(-1), top.reshape(batch * n, self.k), real)
        self._filled[tokens.reshape(-1) if real is None else torch.where(real, tokens.reshape(-1),
                                                                        self.vocab_size)] = True

    def _write(self, rows: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None, columns: int | None = None
               ) -> None:
        """M[rows[i], :columns] = values[i] where ``keep[i]``; where a row appears several times the last i wins,
        on every device (index_put's order among duplicates is unspecified on GPUs)."""
        vocab = self.vocab_size
        order = torch.arange(len(rows), device=rows.device)
        if keep is not None:
            rows = torch.where(keep, rows, vocab)
        last = torch.full((vocab + 1,), -1, dtype=torch.long, device=rows.device)
        last.scatter_reduce_(0, rows, order, "amax")
        rows = torch.where(last[rows] == order, rows, vocab)  # earlier duplicates write into the spare row
        self._matrix[rows, : columns or self.k] = values.to(torch.int32)
