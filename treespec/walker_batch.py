"""The walk of a batch on the device: every row's accepted path and next token in tensor ops, with no host read.

generate() verifies every row's tree in one target pass and walks them all here, on the logits' device; the outcome
is read back once (``read_back``: each row's accepted nodes and committed tokens, packed in one table), the step's
one host read (docs/design.md, "Host reads per step"), and ``treespec.walker.walk_rows`` hands the loop what it
commits (``Walked``). ``treespec.walker.walk`` is the one-row form and describes the rules;
these are their batched, read-free forms:

* greedy: node c passes when its token is the target's argmax at its parent;
* typical (NOT lossless): when p_target(x) at its parent exceeds min(ε, δ·e^−H);
* token-level rejection, deterministic candidates (EAGLE-2's rule): it is "draw y ~ p_target, look for y among
  the siblings", so every node draws its y at once and node c passes when its token is its parent's y and no
  earlier sibling holds that token (a duplicate is never tried twice); the y of the node where the walk stops is
  the next token, distributed as p_target without the rejected siblings' tokens (or all of it, at a leaf);
* token-level rejection, sampled candidates: every node tries its children in rank order, each against the
  residual its earlier siblings left, R ← norm(max(R − Q, 0)), where Q is the law the sibling was drawn from:
  q_draft at the parent (i.i.d., SpecInfer) or q_draft without the earlier siblings' tokens (without replacement,
  Jeon et al. 2024; a point mass once spent). A node's decision takes only its own draws, so every node decides
  at once, one sibling rank per round (W rounds for a tree whose widest node has W children); node c passes
  when its parent chose it, and the next token is a draw from the residual where the walk stops.

For every rule the accepted node is then the deepest whose whole path passes (the first in node order among
equally deep ones; under rejection the passing nodes form a single path), and the next token is the argmax there
(greedy), a draw from what its rejected children left (rejection: p_target at a leaf) or from p_target (typical).

Every node's distribution is made (N × V, where a host walk makes the depth + 1 rows it visits): next to an
accelerator's target pass that is nothing; on a CPU at V = 8k it is a few hundred µs for a 16-node tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch

from treespec.drafter import Proposals
from treespec.sampling import (
    CANNOT_SAMPLE,
    NOT_FINITE,
    Sampling,
    argmax,
    generator_device,
    probs,
    sample,
    sample_flagged,
)
from treespec.tree import Tree
from treespec.walker_traversal import EMPTY_MASS


@dataclass
class Verdicts:
    """Every row's walk, on the device: row b accepted ``nodes[b, : lengths[b]]`` (depth order, root excluded)
    and commits ``tokens[b, : lengths[b] + 1]``, their tokens and then the next token."""

    lengths: torch.Tensor  # LongTensor [b]
    nodes: torch.Tensor    # LongTensor [b, D]: D = the deepest row tree's depth (at least 1)
    tokens: torch.Tensor   # LongTensor [b, D + 1]
    invalid: torch.Tensor  # BoolTensor [b]: a distribution of the row was empty or not finite (a broken model)

    def packed(self, *flags: torch.Tensor) -> torch.Tensor:
        """One LongTensor [b, 2 + F + 2D + 1] to read back: lengths, invalid, the F ``flags`` ([b] each), nodes,
        tokens (``accepted`` reads its rows)."""
        # (a host walk's verdicts are on the host already: a flag from the device joins them there)
        flags = tuple(flag.to(self.lengths.device).long() for flag in flags)
        columns = torch.stack([self.lengths, self.invalid.long(), *flags], dim=1)
        return torch.cat([columns, self.nodes, self.tokens], dim=1)


@dataclass
class Accepted:
    """One row's walk on the host."""

    path: list[int]       # accepted nodes, depth order, root excluded
    tokens: list[int]     # the committed tokens: the path's, then the next token
    flags: list[int]      # the extra columns packed with it


@dataclass
class Walked:
    """A step's walk as the loop commits it (``read_back``)."""

    rows: list[Accepted]   # each row's, on the host
    tokens: torch.Tensor   # LongTensor [b, D + 1]: the same committed tokens where the walk ran (copied from there)

    @property
    def draft_not_finite(self) -> bool:
        """Whether a sampled q_draft held NaN or inf (flagged in the same read; greedy walks read no q)."""
        return any(row.flags and row.flags[0] for row in self.rows)


def read_back(verdicts: Verdicts, proposals: Proposals, sampling: Sampling) -> Walked:
    """Every row's walk brought to the host in one read, with a flag per row for a sampled q_draft holding NaN or
    inf (rejection sampling against it would not give the target's distribution)."""
    flags = () if proposals.q_draft is None or sampling.greedy else (
        (~torch.isfinite(proposals.q_draft)).flatten(1).any(-1),)
    return Walked(accepted(verdicts.packed(*flags).tolist(), sampling, len(flags)), verdicts.tokens)


def accepted(rows: list[list[int]], sampling: Sampling, flags: int = 0) -> list[Accepted]:
    """``Verdicts.packed(...)`` read back (``tolist``) → each row's Accepted; a row whose walk met an empty or
    non-finite distribution is a ValueError (a model producing NaN/inf)."""
    out = []
    for row in rows:
        length, invalid, rest = row[0], row[1], row[2:]
        if invalid:
            raise ValueError(NOT_FINITE if sampling.greedy else CANNOT_SAMPLE)
        depth = (len(rest) - flags - 1) // 2
        nodes, tokens = rest[flags : flags + depth], rest[flags + depth :]
        out.append(Accepted(nodes[:length], tokens[: length + 1], rest[:flags]))
    return out


def walk_batch(logits: torch.Tensor, proposals: Proposals, sampling: Sampling, *, acceptance: str = "rejection",
               generator: torch.Generator | None = None, typical_epsilon: float = 0.09,
               typical_delta: float = 0.3) -> Verdicts:
    """Walk every row: logits [b, ≥ N, V] (row b's node i at [b, i]; N = proposals.num_nodes, later entries
    ignored) → Verdicts on the logits' device. ``acceptance``: "rejection" or "typical" (greedy sampling is the
    greedy walk whatever it says); random draws come from ``generator``, made on its own device."""
    device = logits.device
    batch, n = len(proposals.trees), proposals.num_nodes
    logits = logits[:, :n]
    if n == 1:  # no candidates (plain decoding): the root's next token
        return _root_only(logits[:, 0], sampling, generator)
    if sampling.greedy:
        best_token, invalid = _greedy_argmax(logits)  # [b, N], [b]
        if proposals.tree is not None and proposals.tree.is_chain:
            return _greedy_chain(best_token, proposals.tokens.to(device), invalid)
    tables = _tables(proposals, device)
    drafted = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), proposals.tokens.to(device)], 1)
    parents = tables.parents.expand(batch, n)  # [b, N]: node i's parent (the root's: itself)
    if sampling.greedy:
        passes = drafted == best_token.gather(1, parents)
    else:
        p = probs(logits, sampling)  # [b, N, V]
        if acceptance == "typical":
            threshold = torch.clamp(typical_delta * torch.exp(-torch.special.entr(p).sum(-1)), max=typical_epsilon)
            # p at each node's parent, of the node's token: [b, N]
            at_parent = p.flatten(1).gather(1, parents * p.shape[-1] + drafted)
            passes = at_parent > threshold.gather(1, parents)
            invalid = ~torch.isfinite(p.sum(-1)).all(-1)
        elif proposals.q_draft is None:  # deterministic candidates: one draw from the target per node
            ends, invalid = sample_flagged(p, generator)  # [b, N] each
            repeated = (tables.earlier & (drafted[:, :, None] == drafted[:, None, :])).any(-1)  # [b, N]
            passes = (drafted == ends.gather(1, parents)) & ~repeated
        else:
            chosen, residual = choose_children(p, proposals, tables, drafted, generator)
            passes = chosen.gather(1, parents) == torch.arange(n, device=device)
            ends, invalid = sample_flagged(residual, generator)  # [b, N]: the next token if the walk stops there
    if invalid.dim() > 1:
        invalid = invalid.any(-1)
    # the deepest node whose path passes (the root's always does; padding never wins: its score is 0)
    reached = ~(tables.above & ~passes[:, None, :]).any(-1)  # [b, N]
    best = (reached * tables.score).argmax(-1, keepdim=True)  # [b, 1]
    if sampling.greedy:
        next_token = best_token.gather(1, best)
    elif acceptance == "typical":
        next_token = sample(p.gather(1, best[..., None].expand(batch, 1, p.shape[-1]))[:, 0], generator,
                            check=False)[:, None]
    else:
        next_token = ends.gather(1, best)
    # node i's path then the next token then −1: the columns [b, D + 1] of [drafted, next, −1]
    columns = tables.columns.expand(batch, n, tables.columns.shape[-1]).gather(
        1, best[..., None].expand(batch, 1, tables.columns.shape[-1]))[:, 0]
    tokens = torch.cat([drafted, next_token, torch.full_like(next_token, -1)], 1).gather(1, columns)
    lengths = tables.depths.expand(batch, n).gather(1, best)[:, 0]
    return Verdicts(lengths, columns[:, :-1], tokens, invalid)


def _root_only(logits: torch.Tensor, sampling: Sampling, generator) -> Verdicts:
    """No candidates: the next token at each root, logits [b, V] (argmax, or a draw from p_target)."""
    if sampling.greedy:
        next_token, invalid = _greedy_argmax(logits[:, None])
        next_token = next_token[:, 0]
    else:
        next_token, invalid = sample_flagged(probs(logits, sampling), generator)
    lengths = torch.zeros_like(next_token)
    return Verdicts(lengths, lengths[:, None], torch.stack([next_token, lengths - 1], dim=1), invalid)


def _greedy_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, N, V] → (the argmax at every node [b, N]; whether a row's chosen logits are not all finite [b]).
    On a CPU the check costs nothing and raises at once (``argmax``'s host path); elsewhere it is a flag read back
    with the step's tokens."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return argmax(logits, check_finite=True), torch.zeros(logits.shape[0], dtype=torch.bool)
    best_token = argmax(logits)
    return best_token, ~torch.isfinite(logits.gather(-1, best_token[..., None])).flatten(1).all(-1)


def _greedy_chain(best_token: torch.Tensor, drafted: torch.Tensor, invalid: torch.Tensor) -> Verdicts:
    """The greedy walk of a chain in a few ops: best_token [b, γ + 1] (the argmax at each node), drafted [b, γ]
    (γ ≥ 1) → the run of drafted tokens that are the argmax at their parent."""
    batch, gamma = drafted.shape
    lengths = (drafted == best_token[:, :-1]).cumprod(1).sum(1, keepdim=True)  # [b, 1]
    nodes = torch.arange(1, gamma + 1, device=drafted.device).expand(batch, gamma)  # the chain (the first k kept)
    kept = torch.arange(gamma + 1, device=drafted.device) < lengths  # [b, γ + 1]
    tokens = torch.where(kept, torch.cat([drafted, drafted[:, :1]], 1), -1)
    return Verdicts(lengths[:, 0], nodes, tokens.scatter_(1, lengths, best_token.gather(1, lengths)), invalid)


def choose_children(p: torch.Tensor, proposals: Proposals, tables: Tables, drafted: torch.Tensor, generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level rejection of sampled candidates at every node at once: p [b, N, V] (p_target), drafted [b, N]
    (node i's token), ``proposals.q_draft`` [b, N, V] → (the child each node accepted, or −1 [b, N]; what each
    node's next token is drawn from [b, N, V]: the residual its rejected children left, p itself at a leaf)."""
    batch, n, _ = p.shape
    device = p.device
    q = proposals.q_draft[:, :n].to(device).float()  # [b, N, V]
    spent = torch.zeros(batch, n, dtype=torch.bool, device=device)  # q used up (without replacement): a point mass
    # one uniform per node, for its trial among its siblings, drawn up front on the generator's own device
    uniform = torch.rand(batch, n, generator=generator, device=generator_device(generator)).to(device)
    chosen = torch.full((batch, n), -1, dtype=torch.long, device=device)
    residual = p
    kids = tables.kids.expand(batch, n, tables.kids.shape[-1])  # [b, N, W]
    for rank in range(kids.shape[-1]):  # the siblings of every node, one rank at a time
        kid = kids[..., rank]  # [b, N]
        trying = (kid >= 0) & (chosen < 0)
        kid = kid.clamp(min=0)
        x = drafted.gather(1, kid)[..., None]  # [b, N, 1]
        # u < min(1, R(x)/Q(x)) without the division: Q(x) = 0 < R(x) accepts, 0 = 0 rejects
        q_x = q.gather(-1, x)[..., 0].masked_fill(spent, 1.0)
        passed = trying & (uniform.gather(1, kid) * q_x < residual.gather(-1, x)[..., 0])
        chosen = torch.where(passed, kid, chosen)
        residual = residual_after(residual, q, spent, x, trying & ~passed)
        if proposals.without_replacement:
            q, spent = draft_without(q, spent, x)
    return chosen, residual


def residual_after(residual: torch.Tensor, q: torch.Tensor, spent: torch.Tensor, x: torch.Tensor,
                   rejected: torch.Tensor) -> torch.Tensor:
    """R ← norm(max(R − Q, 0)) at the nodes whose child with token x [b, N, 1] was ``rejected`` [b, N]; Q is q
    [b, N, V], or where ``spent`` the point mass at x. A residual that would be empty (R == Q up to rounding)
    keeps R, as token-level rejection keeps p when max(p − q, 0) is empty."""
    update = torch.where(spent[..., None], residual.scatter(-1, x, 0.0), (residual - q).clamp_(min=0.0))
    mass = update.sum(-1, keepdim=True)
    take = rejected[..., None] & (mass > EMPTY_MASS)
    return torch.where(take, update / mass.clamp_(min=EMPTY_MASS), residual)


def draft_without(q: torch.Tensor, spent: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The law of each node's next sibling drawn without replacement once x [b, N, 1] was drawn from q [b, N, V]:
    q without x, renormalised (``walker_traversal.draft_after``); spent [b, N] once no mass is left."""
    rest = q.scatter(-1, x, 0.0)
    mass = rest.sum(-1, keepdim=True)
    empty = mass[..., 0] <= EMPTY_MASS
    return torch.where(empty[..., None], q, rest / mass.clamp_(min=EMPTY_MASS)), spent | empty


# -- the trees as tensors -----------------------------------------------------------------------------------------
@dataclass
class Tables:
    """The walk's view of the rows' trees, on the device: [1, ...] for one tree every row shares, else [b, ...]
    padded to the largest (a padding node is its own parent at depth 0, and scores 0)."""

    parents: torch.Tensor  # LongTensor [b or 1, N]: the root's parent is itself
    depths: torch.Tensor   # LongTensor [b or 1, N]
    above: torch.Tensor    # BoolTensor [b or 1, N, N]: node i's path (its ancestors but the root, and itself)
    earlier: torch.Tensor  # BoolTensor [b or 1, N, N]: [c, c'] for c' a sibling of c tried before it
    kids: torch.Tensor     # LongTensor [b or 1, N, W]: children in rank order, then −1
    score: torch.Tensor    # LongTensor [b or 1, N]: deeper first, then the first in node order; padding 0
    columns: torch.Tensor  # LongTensor [b or 1, N, D + 1]: node i's path, then N (the next token), then N + 1


_KEPT: WeakKeyDictionary = WeakKeyDictionary()  # Tree → {device: Tables}: a run's trees are uploaded once


def _tables(proposals: Proposals, device) -> Tables:
    tree = proposals.tree
    if tree is not None:
        kept = _KEPT.setdefault(tree, {})
        if device not in kept:
            kept[device] = Tables(*(t.to(device)[None] for t in _host_tables([tree], tree.num_nodes)))
        return kept[device]
    return Tables(*(t.to(device) for t in _host_tables(proposals.trees, proposals.num_nodes)))


def _host_tables(trees: list[Tree], n: int) -> tuple[torch.Tensor, ...]:
    """The trees' tables [len(trees), ...] padded to n nodes, built from their host lists (a dynamic tree is new
    every step: one tensor per table, nothing per node)."""
    width = max(1, *(len(kids) for tree in trees for kids in tree.children))
    deepest = max(1, *(tree.depth for tree in trees))
    parents, depths, earlier, kids, score, columns = [], [], [], [], [], []
    for tree in trees:
        m, pad = tree.num_nodes, range(tree.num_nodes, n)
        parents.append([0, *tree.parent_list[1:], *pad])
        depths.append(tree.depth_list + [0] * (n - m))
        tried = [[False] * n for _ in range(n)]
        for siblings in tree.children:
            for i, c in enumerate(siblings):
                for before in siblings[:i]:
                    tried[c][before] = True
        earlier.append(tried)
        kids.append([k + [-1] * (width - len(k)) for k in tree.children] + [[-1] * width] * (n - m))
        score.append([d * (n + 1) + n - i for i, d in enumerate(tree.depth_list)] + [0] * (n - m))
        paths = [tree.path_list(i) for i in range(m)] + [[]] * (n - m)
        columns.append([path + [n] + [n + 1] * (deepest - len(path)) for path in paths])
    above = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, tree in enumerate(trees):
        above[b, : tree.num_nodes, : tree.num_nodes] = tree.ancestors
    above[:, :, 0] = False  # the root passes by definition
    tables = (torch.tensor(parents), torch.tensor(depths), above, torch.tensor(earlier), torch.tensor(kids),
              torch.tensor(score), torch.tensor(columns))
    return tables if len(trees) > 1 else tuple(t[0] for t in tables)
