"""Lookahead decoding: Jacobi iteration over a 2-D window fills an n-gram pool, verified in the same pass; no model.

Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding". Each step's target
pass holds two branches:

* the *lookahead branch*, a window of W columns and up to N - 1 levels: level l, column c guesses the token at
  position root + c + l. Level 0 is the current guess of the next W - 1 tokens (its column 0 is the root); level
  l >= 1 holds older Jacobi iterates. The target's prediction at the top level, column c, is the next iterate of
  position root + c + l + 1 (one Jacobi step for every column in parallel). Once N - 1 levels are full, each
  column read top to bottom plus that prediction is an n-gram of the trajectory, and it joins the pool, keyed by
  its first token; the oldest level is dropped;
* the *verification branch*: up to G n-grams of the pool whose key is the root token, each N - 1 tokens long.

What a window token attends to in the paper's mask: level 0 up to its own column, then the tokens of levels 1..l
in its own column, at positions root + c + 1 .. root + c + l. Every token sees its predecessor's keys plus its own,
so the mask *is* a tree (a comb: the level-0 chain, and from each of its tokens a vertical chain up the levels),
and a verification n-gram is a chain from the root. The drafter proposes that tree, shared prefixes merged, and
the loop verifies it like any other, with the positions (root + depth) and tree mask it uses for every drafter:
no second mask, no second loop. Every node is a candidate, so a window token the target agrees with is accepted
too (the paper's window is never accepted from; here that only adds accepted tokens, and stays lossless). The
target's logits at every node come back through ``observe_pass``; their argmax at the top level are the next
iterates. A node's children are distinct tokens in a fixed order, a deterministic function of the past (the
window's fillers come from a seeded generator over the prompt), so the tree is verified losslessly like top-k
ranks: greedy output equals vanilla greedy, sampled output follows the target (treespec/walker.py).

After a step that committed s tokens the root moves s positions: every level slides s columns left (a full
window: level l + 1 becomes level l, s - 1 columns), new columns are filled from the prompt's tokens, and level
0's column 0 becomes the new root.

Options (docs/usage.md, "Lookahead"): ``window`` W, ``ngram`` N, ``guesses`` G, ``pool_size`` (n-grams kept per
key, the most recent), ``prompt_ngrams`` (the prompt's own n-grams seed the pool: the reference implementation's
pool-from-prompt option). Left out: the paper's multi-GPU lookahead parallelism and its FlashAttention kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from treespec.drafter import Committed, Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling
from treespec.tree import Tree


class _Row:
    """One row's window ``levels`` (levels[l][c]: the guess at position root + l + c; levels[0][0] the root),
    its n-gram pool (first token → n-grams of the N - 1 next tokens, oldest first), its fillers' source."""

    __slots__ = ("levels", "pool", "fillers", "rng", "top", "top_nodes", "trees", "started")

    def __init__(self, prompt: list[int], seed: int):
        self.fillers = np.array(prompt or [0], dtype=np.int64)
        self.rng = np.random.default_rng(seed)
        self.levels: list[list[int]] = []
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.top, self.top_nodes, self.trees = 0, [], None
        self.started = False  # the window starts at the first root: nothing to slide before the first step

    def fill(self, n: int) -> list[int]:
        return self.fillers[self.rng.integers(0, len(self.fillers), n)].tolist() if n > 0 else []


class Lookahead(Drafter):
    grows_dynamic_trees = True
    observes_logits = True
    per_row = ("_rows", "_lengths", "_pending", "_pending_trees")

    def __init__(self, *, window: int = 4, ngram: int = 3, guesses: int = 4, pool_size: int = 8,
                 prompt_ngrams: bool = True, seed: int = 0):
        for name, value, low in (("window", window, 2), ("ngram", ngram, 2), ("guesses", guesses, 0),
                                 ("pool_size", pool_size, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.window, self.ngram, self.guesses, self.pool_size = window, ngram, guesses, pool_size
        self.prompt_ngrams, self.seed = prompt_ngrams, seed
        # the whole structure: the level-0 chain, W vertical chains of N - 2, G n-grams of N - 1
        nodes = (window - 1) + window * (ngram - 2) + guesses * (ngram - 1)
        depth = max(window - 1 + ngram - 2, ngram - 1)
        width = max(window, guesses + 1)
        self.default_tree = DynamicTree(nodes, depth, width)
        self._rows: list[_Row] = []
        self._lengths: list[int] = []
        self._pending: torch.Tensor | None = None  # [b, N] the target's argmax at every node of the last pass
        self._pending_trees: list | None = None

    # -- the loop's calls -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._rows, self._lengths, self._pending, self._pending_trees = [], [], None, None

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        ids = input_ids.cpu()
        mask = None if attention_mask is None else attention_mask.cpu().bool()
        prompts = [(ids[b] if mask is None else ids[b][mask[b]]).tolist() for b in range(ids.shape[0])]
        self._rows = [_Row(p, self.seed + b) for b, p in enumerate(prompts)]
        self._lengths = [len(p) for p in prompts]
        for row, prompt in zip(self._rows, prompts, strict=True):
            if self.prompt_ngrams:
                for i in range(len(prompt) - self.ngram + 1):
                    self._remember(row, prompt[i], tuple(prompt[i + 1 : i + self.ngram]))
            row.levels = [[0] + row.fill(self.window - 1)]  # level 0; its column 0 is the root, set each step

    def observe_pass(self, tokens: torch.Tensor, trees: list[Tree], logits: torch.Tensor) -> None:
        self._pending, self._pending_trees = logits.argmax(-1), list(trees)  # kept on the device until propose

    def propose(self, committed: Committed, feature, tree: Tree | DynamicTree, sampling: Sampling,
                generator=None) -> Proposals:
        # the tokens committed since the last step, and the last pass's predictions at every node: two reads
        tails, counts = committed.tails(self._lengths)
        predicted = self._pending.tolist() if self._pending is not None else None
        proposals = []
        for b, (row, tail, n) in enumerate(zip(self._rows, tails.tolist(), counts, strict=True)):
            self._lengths[b] += n
            ours = predicted is not None and row.trees is not None and self._pending_trees[b] is row.trees
            self.advance(row, predicted[b] if ours else None, n if row.started else 0)
            row.started = True
            row.levels[0][0] = tail[n - 1]  # the root
            proposals.append(self.build(row, tree))
        self._pending = self._pending_trees = None
        return Proposals.stack(proposals)

    # -- the window ---------------------------------------------------------------------------------------------------
    def _remember(self, row: _Row, key: int, ngram: tuple[int, ...]) -> None:
        kept = row.pool.setdefault(key, [])
        if ngram in kept:
            kept.remove(ngram)  # seen again: the most recent
        kept.append(ngram)
        if len(kept) > self.pool_size:
            del kept[0]

    def advance(self, row: _Row, predicted: list[int] | None, moved: int) -> None:
        """One Jacobi step of ``row``'s window from the last pass's ``predicted`` tokens (None: no pass over its
        window since the last step, so no new level), then the slide by the ``moved`` committed tokens."""
        levels, w = row.levels, self.window
        if predicted is not None:
            top = row.top
            new = [predicted[i] if i is not None else levels[top][c] for c, i in enumerate(row.top_nodes)]
            levels = [*levels, new]  # level top + 1: the next iterate of each column
            if len(levels) == self.ngram:  # full: each column, bottom to top, is an n-gram of the trajectory
                for c in range(w):
                    self._remember(row, levels[0][c], tuple(levels[lv][c] for lv in range(1, self.ngram)))
                levels = [level[moved - 1 :] for level in levels[1:]]  # level l + 1 becomes level l
            else:
                levels = [level[moved:] for level in levels]
        else:
            levels = [level[moved:] for level in levels]
        row.levels = [level + row.fill(w - len(level)) for level in levels]

    def build(self, row: _Row, tree: Tree | DynamicTree) -> Proposal:
        """The tree of ``row``'s window and its guesses, shared prefixes merged, within ``tree``'s node count and
        depth (the window first, then the guesses, the most recent first); remembers which node holds each top
        column."""
        levels, w = row.levels, self.window
        budget, max_depth = len(tree), tree.depth
        kids: list[dict[int, int]] = [{}]  # node → {token: child}; node 0 the root
        paths: list[tuple] = [()]
        tokens: list[int] = [levels[0][0]]

        def walk(sequence: list[int]) -> list[int | None]:
            """Insert ``sequence`` below the root: the node of each of its tokens (None past the budget)."""
            node, out = 0, []
            for token in sequence:
                child = kids[node].get(token)
                if child is None:
                    if len(paths) - 1 >= budget or len(paths[node]) >= max_depth:
                        return out + [None] * (len(sequence) - len(out))
                    child = len(paths)
                    paths.append((*paths[node], len(kids[node])))
                    kids[node][token] = child
                    kids.append({})
                    tokens.append(token)
                node = child
                out.append(node)
            return out

        chain = [0, *walk(levels[0][1:])]  # level 0: node of column c
        top = len(levels) - 1
        top_nodes = chain if top == 0 else [None] * w
        for c in range(w):
            if top and chain[c] is not None:  # column c, up its levels, below level 0's column c
                column = walk(levels[0][1 : c + 1] + [levels[lv][c] for lv in range(1, top + 1)])
                top_nodes[c] = column[-1]
        for ngram in reversed(row.pool.get(levels[0][0], [])[-self.guesses :] if self.guesses else []):
            walk(list(ngram))
        if len(paths) == 1:
            row.trees, row.top, row.top_nodes = None, top, [None] * w
            return Proposal(tree=Tree.chain(0), tokens=torch.empty(0, dtype=torch.long))
        grown = Tree(paths[1:])
        index = {p: i + 1 for i, p in enumerate(grown.paths)}
        index[()] = 0
        row.top, row.top_nodes = top, [None if i is None else index[paths[i]] for i in top_nodes]
        token_of = dict(zip(paths, tokens, strict=True))
        row.trees = grown
        return Proposal(tree=grown, tokens=torch.tensor([token_of[p] for p in grown.paths]))
