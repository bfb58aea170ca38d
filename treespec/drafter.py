"""The one interface every drafter implements, and what it returns. It lives in the core, beside the
loop that calls it (treespec/generate.py); implementations live above it, in treespec.heads.

A decoding step, from the drafter's side:

1. ``propose(committed, feature, tree, sampling, generator)``: the committed sequence ends with the
   root token (committed, not yet seen by the target's cache); ``feature`` is the target's hidden state
   at the position before the root, the one whose logits produced the root (the drafter's
   ``feature_layers`` side by side). The drafter returns a ``Proposal``: one token per candidate node of
   the tree it proposes, and, if it *sampled* them, the distributions it drew each node's children from.
2. The target verifies; the walker picks the accepted path (treespec/verify.py).
3. ``accept(path, features)``: node indices accepted (root excluded) and the target's hidden states at
   the root and at each accepted node, so drafters with their own caches stay in sync.

A drafter holds one sequence's state (its caches, the committed length), so it serves one generate() call at
a time: a second call that starts while the first holds it (another thread) is refused with a RuntimeError
(``in_use``); give each thread its own drafter.

Candidates are either deterministic given the context (top-k ranks: ``q_draft is None``; verified with
EAGLE-2's sibling-by-sibling rule), sampled i.i.d. from ``q_draft`` (verified with multi-candidate
rejection sampling, SpecInfer), or sampled from ``q_draft`` without replacement (siblings distinct, in draw
order; verified with recursive rejection sampling, Jeon et al. 2024). All are lossless; see treespec/verify.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling
from treespec.tree import Tree

CANDIDATE_MODES = ("topk", "sample", "without_replacement")
#: the modes that draw candidates from the draft distribution at temperature > 0 (static trees only)
SAMPLED_CANDIDATES = ("sample", "without_replacement")


@dataclass
class Proposal:
    tree: Tree                           # topology of this step's candidates (static, or grown this step)
    tokens: torch.Tensor                 # LongTensor [n]: candidate token of nodes 1..n
    q_draft: torch.Tensor | None = None  # float [N, V]: distribution node i's children were sampled from
    #: node i's children were drawn from q_draft[i] without replacement, in rank order (else i.i.d.)
    without_replacement: bool = False

    def __post_init__(self):
        if self.tokens.shape != (len(self.tree),):
            raise ValueError(f"proposal has {tuple(self.tokens.shape)} tokens for a tree of {len(self.tree)} nodes")


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
    #: measured per-depth top-k accuracies acc[d][r] (a trained drafter's head_accuracy.json): what tree kinds
    #: "accuracy" and "auto" grow from (treespec.tree_spec); None: not measured
    accuracy: list[list[float]] | None = None
    #: (accuracy, max_nodes) → the Tree kind "auto" verifies: treespec.autotree.auto_chooser on this device's
    #: cost curve (a trained drafter's cost_curve.json, treespec.autotree.saved_chooser); None: no curve
    tree_chooser = None

    def check_target(self, target) -> None:
        """Raise ValueError if this drafter cannot serve ``target`` (vocabulary, hidden size, ...)."""

    def reset(self) -> None:
        """Forget all per-sequence state; called by generate() before each prompt."""

    def prefill(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """See the prompt. input_ids: [1, P]; features: [1, P, L·h] target hidden states or None."""

    def propose(
        self,
        committed: torch.Tensor,
        feature: torch.Tensor | None,
        tree: Tree | DynamicTree,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """committed: LongTensor [1, L] ending with the root; feature: [1, L·h] or None."""
        raise NotImplementedError

    def accept(self, path: torch.Tensor, features: torch.Tensor | None) -> None:
        """path: LongTensor [k] accepted node indices; features: [1, k + 1, L·h] (root first) or None."""

    # -- cost timing (predicted speedups: treespec.autotree; the comparison times it between target passes) --
    #: whether one drafting call fills the whole tree (Medusa's heads) rather than one depth of it
    fills_tree_at_once: bool = False

    def drafting_step(self, past_len: int = 256, n_tokens: int = 4) -> Callable[[], object] | None:
        """A call that runs one of this drafter's drafting calls on placeholder inputs, as it drafts: one depth
        of ``n_tokens`` frontier nodes after ``past_len`` cached entries, or one whole proposal for a drafter
        that ``fills_tree_at_once``. None: it runs no model, so there is nothing to time. It may leave
        per-sequence state behind: call ``reset()`` when done with it."""
        return None


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
    RuntimeError: its per-sequence state would be overwritten mid-decoding."""
    if drafter is None:
        yield
        return
    with _CLAIMS:
        if getattr(drafter, "_serving", False):
            raise RuntimeError(f"this {type(drafter).__name__} is already decoding in another generate() call: a "
                               "drafter holds one sequence's state and serves one generation at a time; give each "
                               "thread its own drafter")
        drafter._serving = True
    try:
        yield
    finally:
        drafter._serving = False
