"""Sequence-level verification: traversal verification of trees and its chain case, block verification.

Token-level rejection (treespec/walker.py, ``acceptance="rejection"``) decides each drafted token on its own
ratio p/q and discards a path at its first rejected token. Two lossless rules decide on whole sequences:

* **Block verification** (Sun, Mendlovic, Leviathan et al. 2024, "Block Verification Accelerates Speculative
  Decoding", Algorithm 2), for a chain X_1..X_γ. With p_0 = 1,

      p_i = min(1, p_{i−1} · P_{i−1}(X_i) / Q_{i−1}(X_i))                       (sequence-level ratio)
      h_i = S_i / (S_i + 1 − p_i),  S_i = Σ_x max(p_i P_i(x) − Q_i(x), 0)   (i < γ),   h_γ = p_γ

  where P_i and Q_i are the target's and the drafter's distributions after X_1..X_i. The accepted length
  τ is the largest i whose coin η_i < h_i succeeds (0 if none, h_0 = 1); the next token comes from
  P_γ when τ = γ, else from the residual norm(max(p_τ P_τ − Q_τ, 0)). It is optimal among valid
  verification rules for one draft and never accepts less than token-level rejection.

* **Traversal verification** (Weng et al. 2025, "Traversal Verification for Speculative Tree Decoding",
  Algorithm 1), for any tree: nodes are tried leaf to root in post-order (a node after all of its
  children). Node c (token x, parent β) is accepted with its sequence-level probability w_c, with
  w_root = 1 and

      w_c = min(1, m_β(x) / Q_c(x))              m_β = w_β · P_β: the mass β still holds

  and is deleted on rejection, which updates its parent to the residual the rejection leaves,

      m_β ← max(m_β − Q_c, 0) / (1 − Σ_x min(m_β(x), Q_c(x))),

  i.e. P_β ← norm(max(w_β P_β − Q_c, 0)) and w_β ← S / (S + 1 − w_β). The later siblings, and β itself
  once it is a leaf, are tried against the updated mass. Accepting node α commits the path to α and a
  next token drawn from P_α as its rejected children left it. The first accepted node ends the walk; the
  root is always accepted. On a chain the trials are exactly block verification's, deepest first
  (w_i's update after its child's rejection is h_i), which is how this module serves both modes.

Q_c is the distribution sibling c was drawn from, given its earlier siblings:

* sampled candidates (``q_draft``; siblings i.i.d. from q_draft[β]): Q_c = q_draft[β];
* sampled without replacement (Jeon et al. 2024): q_draft[β] without the earlier siblings' tokens,
  renormalised (``draft_after``);
* deterministic candidates (top-k ranks, dynamic trees): Q_c is the point mass at x, the exact law of a
  token that the context determines. Then m_β(x) ≤ 1 gives w_c = m_β(x) and the update removes x from
  m_β. This is lossless; it accepts as much as EAGLE-2's rule does in expectation, since no rule can
  beat "draw a target sequence, accept its longest prefix in the tree" when the tree is fixed.

Losslessness (the output law is the target's) is proven in the papers and checked here exactly (the law
of ``trials`` summed over every draft of a tiny vocabulary) and by chi-square tests (tests/core/test_walker.py,
tests/test_lossless.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from treespec.tree import Tree

# Mass below which a residual is rounding noise (float32 distributions sum to 1 within ~1e-7); see walker.py.
EMPTY_MASS = 1e-6


class Mass:
    """m = w · P at one node, the target mass this node and its remaining children may still take (total w).

    Kept as ``scale · P`` with some tokens removed while only point-mass drafts were rejected (no
    vocabulary-wide work: deterministic candidates cost scalars), and as a dense row [V] after a
    rejection against a sampled draft distribution."""

    def __init__(self, weight: float, row: Callable[[], torch.Tensor]):
        self.total = weight  # w
        self._row, self._scale, self._removed = row, weight, set()
        self._dense: torch.Tensor | None = None  # [V] host float32, once a dense draft was subtracted
        self._empty = False  # nothing left (no [V] row allocated for it: most rejected nodes end so)
        self._values = None  # P as a numpy view: one element read costs no tensor op

    def at(self, token: int) -> float:
        if self._empty:
            return 0.0
        if self._dense is not None:
            return float(self._dense[token])
        if token in self._removed:
            return 0.0
        if self._values is None:
            self._values = self._row().numpy()
        return self._scale * float(self._values[token])

    def reject(self, token: int, draft: torch.Tensor | None) -> None:
        """A child with ``token``, drafted from ``draft`` ([V]; None: the point mass at ``token``), was
        rejected: m ← max(m − Q, 0) / (1 − Σ min(m, Q))."""
        if draft is None:
            taken = self.at(token)  # min(m, δ_x) sums to m(x)
            left = self.total - taken
            if left <= EMPTY_MASS:
                self._empty_or_keep()
                return
            keep = 1.0 - taken
            if self._dense is not None:
                self._dense[token] = 0.0
                self._dense /= keep
            else:
                self._removed.add(token)
                self._scale /= keep
            self.total = left / keep
            return
        residual = (self.dense() - draft).clamp_(min=0.0)  # [V]
        left = float(residual.sum())
        if left <= EMPTY_MASS:
            self._empty_or_keep()
            return
        keep = 1.0 - (self.total - left)
        self._dense = residual / keep
        self.total = left / keep

    def _empty_or_keep(self) -> None:
        # Nothing left: the node can no longer be accepted. A node accepted with certainty (the root, w = 1)
        # is there only through rounding (its P equals the draft): keep its mass, as token-level rejection
        # keeps p when max(p − q, 0) is empty.
        if self.total < 1.0 - EMPTY_MASS:
            self._empty, self.total = True, 0.0

    def dense(self) -> torch.Tensor:
        """m as a row [V] (not normalised: it sums to w)."""
        if self._empty:
            return torch.zeros_like(self._row())
        if self._dense is None:
            row = self._row() * self._scale
            if self._removed:
                row[list(self._removed)] = 0.0
            return row
        return self._dense.clone()

    def next_distribution(self) -> torch.Tensor:
        """What the next token is drawn from when this node is accepted: m normalised (``sample`` does it).
        A mass that rounding alone emptied (the root, whose children covered all of P) falls back to P."""
        row = self.dense()
        return row if float(row.sum()) > EMPTY_MASS else self._row()


def draft_after(draft: torch.Tensor | None, token: int) -> torch.Tensor | None:
    """The law of the next sibling drawn without replacement once ``token`` was drawn from ``draft`` ([V]):
    draft without it, renormalised (recursive rejection sampling, Jeon et al. 2024, "Recursive Speculative
    Decoding", Algorithm 1). None, a point mass at whatever the next sibling is, once no mass is left: the
    drafter then fills the remaining siblings with zero-mass tokens that the context determines."""
    if draft is None:
        return None
    rest = draft.clone()
    rest[token] = 0.0
    mass = float(rest.sum())
    return rest / mass if mass > EMPTY_MASS else None


@dataclass
class Trial:
    """One node tried by the traversal: the walk stops here with ``probability``."""

    node: int
    probability: float
    mass: Mass


def trials(tree: Tree, tokens: list[int], target_row: Callable[[int], torch.Tensor],
           draft_of: Callable[[int], torch.Tensor | None]) -> Iterator[Trial]:
    """The traversal's trials in order, each assuming every earlier one was rejected (a caller stops at the
    first success; the last trial is the root, with probability 1).

    tokens[c - 1]: node c's token; target_row(i): P_i, the target's distribution after node i ([V] host
    float32, normalised); draft_of(c): Q_c, the distribution node c was drawn from given its earlier
    siblings ([V]) or None for a point mass at its token (deterministic candidates)."""
    parents, children = tree.parent_list, tree.children
    untried = [list(kids) for kids in children]  # children not yet tried, in rank order
    masses = {0: Mass(1.0, _cached(target_row, 0))}

    def deepest_first(node: int) -> int:
        # descend along first untried children, weighing each against its parent's current mass
        while untried[node]:
            child = untried[node][0]
            x = tokens[child - 1]
            draft = draft_of(child)
            q_x = 1.0 if draft is None else float(draft[x])
            parent = masses[node]
            m_x = parent.at(x)
            if m_x >= parent.total - EMPTY_MASS:  # x holds all that is left (up to rounding): all of it
                m_x = parent.total
            # min(1, m(x)/q(x)) without the division: q(x) = 0 < m(x) (rounding in the drafter) accepts
            weight = 1.0 if m_x >= q_x else m_x / q_x
            masses[child] = Mass(weight, _cached(target_row, child))
            node = child
        return node

    node = deepest_first(0)
    while node != 0:
        yield Trial(node, masses[node].total, masses[node])
        parent = parents[node]
        untried[parent].pop(0)
        masses[parent].reject(tokens[node - 1], draft_of(node))
        node = deepest_first(parent)
    yield Trial(0, 1.0, masses[0])


def _cached(target_row: Callable[[int], torch.Tensor], node: int) -> Callable[[], torch.Tensor]:
    """P_node, computed on first use only: leaves that are never accepted never need theirs."""
    row: list[torch.Tensor] = []

    def get() -> torch.Tensor:
        if not row:
            row.append(target_row(node))
        return row[0]

    return get
