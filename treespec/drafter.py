"""The one interface every drafter implements, and what it returns. It lives in the core, beside the
loop that calls it (treespec/generate.py); implementations live above it, in treespec.heads.

Every call is batched over the rows being decoded (b = 1 for one prompt). A decoding step, from the
drafter's side:

1. ``propose(committed, feature, tree, sampling, generator)``: ``committed`` holds each row's committed
   tokens, ending with its root (committed, not yet seen by the target's cache); ``feature`` [b, L·h] is
   the target's hidden state at the position before each root, the one whose logits produced it (the
   drafter's ``feature_layers`` side by side). The drafter returns ``Proposals``: one token per candidate
   node of each row's tree (one tree shape for every row, or each row's own: EAGLE-2's dynamic trees, a
   prompt lookup that found fewer candidates), and, if it *sampled* them, the distributions it drew each
   node's children from. Its model runs once per depth for the whole batch, never once per row.
2. The target verifies; the walker picks each row's accepted path (treespec/walker.py).
3. ``accept(paths, features)``: each row's accepted node indices (root excluded) and the target's hidden
   states at the root and at each accepted node, so drafters with their own caches stay in sync. A drafter
   serving in a Combined (heads/combined/) is told the whole accepted path too, in its own node numbering:
   the tokens another drafter proposed are ``NOT_PROPOSED`` there (``own_nodes`` keeps the rest). A drafter
   that ``observes_logits`` is first shown the pass itself, ``observe_pass(tokens, trees, logits)``: the
   target's logits at every node it verified, rejected candidates' included (Token Recycling's matrix).
4. ``keep_rows(rows)``: rows that finished leave the batch; the drafter keeps the state of ``rows`` only. A
   drafter names the attributes holding its per-row state in ``per_row`` (tensors with a row axis first, lists
   with an entry per row, its cache's ``RowSlots``, which select their cache too) and the base class's
   ``keep_rows`` selects them all (``select_rows_of``); one with more to do (a Combined forwards it to its
   drafters) extends it.

A drafter holds one generation's state (its rows' caches, their committed lengths), so it serves one
generate() call at a time: a second call that starts while the first holds it (another thread) is refused
with a RuntimeError (``in_use``); give each thread its own drafter.

Candidates are either deterministic given the context (top-k ranks: ``q_draft is None``; verified with
EAGLE-2's sibling-by-sibling rule), sampled i.i.d. from ``q_draft`` (verified with multi-candidate
rejection sampling, SpecInfer), or sampled from ``q_draft`` without replacement (siblings distinct, in draw
order; verified with recursive rejection sampling, Jeon et al. 2024). All are lossless; see treespec/walker.py.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling
from treespec.tree import Tree

CANDIDATE_MODES = ("topk", "sample", "without_replacement")
#: an accepted node that was not in this drafter's own tree (in a Combined, another drafter proposed that token);
#: such entries of a path follow the ones it proposed
NOT_PROPOSED = -1
#: the modes that draw candidates from the draft distribution at temperature > 0 (static trees only)
SAMPLED_CANDIDATES = ("sample", "without_replacement")


@dataclass
class Proposal:
    """One row's candidates: what the walker verifies."""

    tree: Tree                           # topology of this step's candidates (static, or grown this step)
    tokens: torch.Tensor                 # LongTensor [n]: candidate token of nodes 1..n
    q_draft: torch.Tensor | None = None  # float [N, V]: distribution node i's children were sampled from
    #: node i's children were drawn from q_draft[i] without replacement, in rank order (else i.i.d.)
    without_replacement: bool = False

    def __post_init__(self):
        if self.tokens.shape != (len(self.tree),):
            raise ValueError(f"proposal has {tuple(self.tokens.shape)} tokens for a tree of {len(self.tree)} nodes")


@dataclass
class Proposals:
    """A batch's candidates: row b's tree ``trees[b]`` (the same object for rows sharing one shape) with its
    candidates in the first len(trees[b]) entries of ``tokens[b]``; a smaller tree's remaining entries are
    padding that no real node attends to."""

    trees: list[Tree]
    tokens: torch.Tensor                 # LongTensor [b, n]: n = the largest tree's candidates
    q_draft: torch.Tensor | None = None  # float [b, N, V]
    without_replacement: bool = False    # siblings were drawn without replacement (Proposal's field, every row)

    def __post_init__(self):
        n = max(len(tree) for tree in self.trees)
        if self.tokens.shape != (len(self.trees), n):
            raise ValueError(f"proposals have {tuple(self.tokens.shape)} tokens for {len(self.trees)} trees of at "
                             f"most {n} nodes")

    @classmethod
    def shared(cls, tree: Tree, tokens: torch.Tensor, q_draft: torch.Tensor | None = None, *,
               without_replacement: bool = False) -> Proposals:
        """One tree for every row of ``tokens`` [b, n]."""
        return cls([tree] * tokens.shape[0], tokens, q_draft, without_replacement)

    @classmethod
    def stack(cls, proposals: list[Proposal]) -> Proposals:
        """Rows' own proposals, padded to the largest (one shared tree when every row proposes the same one)."""
        n = max(len(p.tree) for p in proposals)
        tokens = proposals[0].tokens.new_zeros(len(proposals), n)  # where the candidates are: no read back
        for b, p in enumerate(proposals):
            tokens[b, : len(p.tree)] = p.tokens
        q_draft = None
        if any(p.q_draft is not None for p in proposals):
            first = next(p.q_draft for p in proposals if p.q_draft is not None)
            q_draft = first.new_zeros(len(proposals), n + 1, first.shape[-1])
            for b, p in enumerate(proposals):
                if p.q_draft is not None:
                    q_draft[b, : p.tree.num_nodes] = p.q_draft
        return cls([p.tree for p in proposals], tokens, q_draft, any(p.without_replacement for p in proposals))

    @property
    def tree(self) -> Tree | None:
        """The tree every row shares, or None when rows have their own."""
        first = self.trees[0]
        return first if all(tree is first for tree in self.trees[1:]) else None

    @property
    def num_nodes(self) -> int:
        """Nodes per row of a verification pass: root + the largest tree's candidates."""
        return self.tokens.shape[1] + 1

    def row(self, b: int) -> Proposal:
        tree = self.trees[b]
        q_draft = None if self.q_draft is None else self.q_draft[b, : tree.num_nodes]
        return Proposal(tree, self.tokens[b, : len(tree)], q_draft, self.without_replacement)


@dataclass
class Committed:
    """Each row's committed tokens, its root last: row b's are ``tokens[b, : lengths[b]]`` (its prompt without
    padding, then what was generated); what follows them is unspecified."""

    tokens: torch.Tensor                 # LongTensor [b, L]
    lengths: list[int]

    def row(self, b: int) -> torch.Tensor:
        """LongTensor [lengths[b]]."""
        return self.tokens[b, : self.lengths[b]]

    def tails(self, starts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Each row's tokens from ``starts[b]`` on, right-padded (with zeros) → (LongTensor [b, m], counts [b])."""
        counts = [n - s for n, s in zip(self.lengths, starts, strict=True)]
        first, width = min(starts), max(counts)
        if all(s == first for s in starts) and all(c == width for c in counts):  # one row, or rows alike: a view
            return self.tokens[:, first : first + width], counts
        index = (torch.tensor(starts)[:, None] + torch.arange(width)[None]).clamp(max=self.tokens.shape[1] - 1)
        tails = self.tokens.gather(1, index.to(self.tokens.device))
        return tails.masked_fill(torch.arange(width, device=tails.device)[None] >=
                                 torch.tensor(counts, device=tails.device)[:, None], 0), counts


class Drafter:
    """Base class: proposes a token tree each step. Subclasses override ``propose``; every attribute the
    loop reads is declared here."""

    #: the tree generate() verifies when none is given
    default_tree: Tree | DynamicTree = Tree.chain(4)
    #: whether ``propose``/``accept`` need the target's hidden states (costs output_hidden_states=True)
    needs_features: bool = False
    #: which target hidden states to pass as features, side by side (transformers' ``hidden_states``
    #: indices: 0 = embeddings, i = output of decoder layer i, -1 = last, after the final norm)
    feature_layers: tuple[int, ...] = (-1,)
    #: whether ``propose`` accepts a DynamicTree (a budget grown from draft confidence, EAGLE-2)
    grows_dynamic_trees: bool = False
    #: "topk" (deterministic ranks), "sample" (i.i.d. from q_draft at temperature > 0; static trees only) or
    #: "without_replacement" (distinct siblings drawn one after another from q_draft; static trees only)
    candidates: str = "topk"
    #: the longest sequence (prompt + new tokens) the drafter's own model can position; None: no limit
    max_positions: int | None = None
    #: the deepest tree it can fill (Medusa: its number of heads), checked at generate's door; None: no limit
    max_tree_depth: int | None = None
    #: what sets that depth and how to go deeper, said when a deeper tree is refused (Medusa: its heads)
    max_tree_depth_note: str = ""
    #: whether the loop shows it every verification pass (``observe_pass``); off: the loop never calls it
    observes_logits: bool = False
    #: whether what it learns in one generate() call drafts in the next (Token Recycling's matrix, SuffixDecoding's
    #: earlier outputs): a comparison gives each configuration its own copy, so none drafts from another's output
    #: of the same prompt
    remembers_across_calls: bool = False
    #: whether a step may go without ``propose`` (``accept`` still called, every accepted token NOT_PROPOSED): its
    #: proposal is a function of what ``prefill``/``accept`` gave it (DFlash's block over its context), so a Combined
    #: in fallback mode asks it only when the earlier members' proposals are weak
    proposes_on_demand: bool = False
    #: the attributes holding per-row state, which ``keep_rows`` selects (``select_rows_of``)
    per_row: tuple[str, ...] = ()

    def check_target(self, target) -> None:
        """Raise ValueError if this drafter cannot serve ``target`` (vocabulary, hidden size, ...)."""

    def check_batch(self, batch_size: int) -> None:
        """Raise ValueError if this drafter cannot draft for ``batch_size`` rows at once."""

    def reset(self) -> None:
        """Forget all per-sequence state; called by generate() before each batch."""

    def prefill(self, input_ids: torch.Tensor, features: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None) -> None:
        """See the prompts as the target saw them: input_ids [b, P], left-padded where ``attention_mask``
        [b, P] says so (None: no padding); features: [b, P, L·h] target hidden states or None."""

    def propose(
        self,
        committed: Committed,
        feature: torch.Tensor | None,
        tree: Tree | DynamicTree,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> Proposals:
        """committed: each row's tokens, the root last; feature: [b, L·h] or None. Every row is proposed a
        ``tree`` (static: its shape; dynamic: its budget)."""
        raise NotImplementedError

    def accept(self, paths: list[torch.Tensor], features: torch.Tensor | None) -> None:
        """paths: per row, LongTensor [k_b] accepted node indices (``NOT_PROPOSED`` where another drafter of a
        Combined proposed the token: ``own_nodes``); features: [b, 1 + max k_b, L·h] (row b's root, then its
        accepted nodes, in its first k_b + 1 entries) or None. k_b counts every accepted token, proposed here or not."""

    def observe_pass(self, tokens: torch.Tensor, trees: list[Tree], logits: torch.Tensor) -> None:
        """Called after every target pass when ``observes_logits``, before the walk: tokens [b, N] (each row's root,
        then its candidates; row b's first ``trees[b].num_nodes`` entries are real, the rest padding), logits
        [b, N, V] the target's at each of them, on the target's device. Reading them must not change them."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the per-row state of batch rows ``rows`` (LongTensor [b'] on the host, in that order) only: the
        others finished. Selects every attribute ``per_row`` names."""
        for name in self.per_row:
            setattr(self, name, select_rows_of(getattr(self, name), rows))

    def compile_steps(self, options: dict | None, capacity: int) -> None:
        """Called by generate() before each batch: with ``options`` (torch.compile's arguments), run each drafting
        depth's network as a static compiled graph whose cache holds ``capacity`` slots (treespec/static_pass.py);
        None: run it eagerly. A drafter without a network over its own cache ignores it."""


def select_rows_of(state, rows: torch.Tensor):
    """``state`` of the batch rows ``rows`` (LongTensor [b'] on the host) only: a tensor's rows (axis 0), a list's
    entries, an object's own ``select(rows)`` (a RowSlots: its cache too; selected in place); None, or an empty
    list, is nothing held yet."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.index_select(0, rows.to(state.device))
    if isinstance(state, list):
        return [state[b] for b in rows.tolist()] if state else state
    if hasattr(state, "select"):
        state.select(rows)
        return state
    raise TypeError(f"per-row state of type {type(state).__name__} cannot be selected by row: give it a "
                    "select(rows) method, or override keep_rows")


def own_nodes(path: list[int]) -> list[int]:
    """The nodes of an accepted ``path`` that this drafter's own tree held: all of them, except in a Combined,
    where the tokens another drafter proposed (``NOT_PROPOSED``) end its part."""
    return path[: path.index(NOT_PROPOSED)] if NOT_PROPOSED in path else path


def stack_features(hidden_states, layers) -> torch.Tensor:
    """A drafter's input features: the target's ``hidden_states`` at ``layers``, side by side [..., L·h]
    (EAGLE-3 fuses low, mid and high ones; every other feature drafter takes the last one)."""
    layers = tuple(layers)
    if len(layers) == 1:
        return hidden_states[layers[0]]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)



_CLAIMS = threading.Lock()  # makes "is it free? take it" one step when two threads start at once


@contextlib.contextmanager
def in_use(drafter: Drafter | None):
    """Hold ``drafter`` for one generate() call; one already held (by a call in another thread) is a
    RuntimeError: its per-generation state would be overwritten mid-decoding."""
    if drafter is None:
        yield
        return
    with _CLAIMS:
        if getattr(drafter, "_serving", False):
            raise RuntimeError(f"this {type(drafter).__name__} is already decoding in another generate() call: a "
                               "drafter holds one generation's state and serves one generation at a time; give each "
                               "thread its own drafter")
        drafter._serving = True
    try:
        yield
    finally:
        drafter._serving = False
