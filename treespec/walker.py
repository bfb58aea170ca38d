"""The walker: given the target's logits at every tree node, choose the accepted path and the next token.

This is the project's one verification routine; every acceptance rule is a mode of ``walk``.

Node i's logits (row i of ``logits``) are the target's prediction of the token that *follows* node i,
i.e. a distribution over node i's children. Node 0 is the root (the last committed token). A walk
returns the accepted candidate nodes (root excluded) and one more token, so every decoding step commits
``len(path) + 1`` tokens.

Modes
-----
* **Greedy** (``sampling.greedy``): accept the deepest path whose every token is the target's argmax
  at its parent; the next token is the argmax at its end. Output identical to greedy decoding.
* **Lossless sampling** (``acceptance="rejection"``, the default): speculative sampling (Leviathan et
  al. 2023; Chen et al. 2023) generalised to trees. The committed tokens are distributed exactly as if
  sampled from the target one at a time. Two sibling rules, chosen by how the drafter made its
  candidates:

  - deterministic candidates (``proposal.q_draft is None``, e.g. top-k ranks): EAGLE-2's rule (Li et
    al. 2024), i.e. sampling without replacement. Try siblings in rank order, accept token x with
    probability p(x) / Σp, and on rejection zero p(x) and renormalise; if every sibling fails, sample
    from what is left. It is exactly "draw y ~ p, then look for y among the siblings".
  - sampled candidates (``q_draft`` given; node i's children were drawn i.i.d. from ``q_draft[i]``, or
    without replacement: ``proposal.without_replacement``, then the k-th sibling's law is q_draft[i]
    without the earlier siblings' tokens, renormalised, and the rule is Jeon et al. 2024's recursive
    rejection sampling, "Recursive Speculative Decoding", Algorithm 1):
    SpecInfer's multi-candidate rejection sampling (Miao et al. 2024). Accept x with probability
    min(1, p(x) / q(x)); on rejection p ← norm(max(p − q, 0)), and the next sibling, an independent
    draw from the same q, is tested against that residual; if every sibling fails, sample from the
    final residual. Each round is one Leviathan/Chen step whose target is the previous round's
    residual, so by induction the emitted token is distributed as p.

* **Sequence-level verification** (treespec/walker_traversal.py), lossless and never accepting less than
  token-level rejection in expectation:

  - ``acceptance="block"``: block verification of a chain (Sun, Mendlovic, Leviathan et al. 2024,
    "Block Verification Accelerates Speculative Decoding", Algorithm 2). Chains only: a branching tree
    is a ValueError (use "traversal", which is block verification on a chain).
  - ``acceptance="traversal"``: traversal verification of any tree, static or dynamic (Weng et al. 2025,
    "Traversal Verification for Speculative Tree Decoding", Algorithm 1): leaf to root, each node
    accepted with the sequence-level probability of its whole path.

  Both need the distribution each candidate was drawn from: ``q_draft`` for sampled candidates, and for
  deterministic ones (top-k ranks, dynamic trees) the point mass at the drafted token, which is their
  exact law given the context (so the rules stay lossless; they then accept as much as EAGLE-2's rule).

* **Typical acceptance** (``acceptance="typical"``; Medusa, Cai et al. 2024): NOT LOSSLESS, NEVER THE
  DEFAULT. See ``walk``.

Under greedy decoding every mode is the greedy walk: the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.drafter import Proposal
from treespec.sampling import Sampling, argmax, generator_device, probs, sample
from treespec.tree import Tree
from treespec.walker_traversal import draft_after, trials

ACCEPTANCE_MODES = ("rejection", "block", "traversal", "typical")
#: the lossless rules, side by side in the comparison (typical acceptance is not lossless)
LOSSLESS_MODES = ("rejection", "block", "traversal")

# Probability mass below which a distribution is treated as empty. p and q are float32 and sum to 1 up
# to ~1e-7; a residual that small is rounding noise, and sampling from it would amplify that noise (or
# fail outright when it is exactly zero). Treating it as empty biases the output by at most this much.
_EMPTY_MASS = 1e-6
# Below this many logits ([N, V]) the walk turns all of them into p_target in one call (see _walk_rejection).
_ONE_CALL_NUMEL = 1 << 14
# Up to this many logits, the traversal makes the rows of a tree's internal nodes in one call (sequence_trials).
_INTERNAL_ROWS_NUMEL = 1 << 19


@dataclass
class Walk:
    """One verification's outcome: the step commits the path's tokens, then ``next_token``.

    ``next_token`` is the bonus drawn from p_target at the last accepted node when that node has no
    children left to try, or the resample from the residual when all of its children were rejected.
    """

    path: torch.Tensor  # LongTensor [k]: accepted node indices (root excluded), in depth order
    next_token: int


def walk(
    logits: torch.Tensor,
    proposal: Proposal,
    sampling: Sampling,
    *,
    acceptance: str = "rejection",
    generator: torch.Generator | None = None,
    typical_epsilon: float = 0.09,
    typical_delta: float = 0.3,
) -> Walk:
    """Verify one proposal. logits: [N, V] target logits at nodes 0..n (N = tree.num_nodes).

    ``generator`` (on any device, or None for the global CPU one) is used for every random draw, so a
    seeded walk is reproducible. The sequential walk runs on the CPU; logits and q_draft may live on
    an accelerator, and only the rows the walk visits are brought over.

    ``acceptance="typical"`` is Medusa's typical acceptance (Cai et al. 2024): a child x of node i
    passes if p_target_i(x) > min(ε, δ·exp(−H(p_target_i))), with p_target after this ``sampling``'s
    temperature and top-p; the deepest all-passing path is accepted and the next token is sampled from
    p_target at its end. **It is NOT lossless**: it accepts any sufficiently likely token with
    certainty, so the output distribution is not the target's (e.g. a drafted token of probability 0.5
    is always emitted). It trades fidelity for acceptance length, must be asked for explicitly, and is
    never the default. With greedy sampling it is plain greedy verification.
    """
    tree = proposal.tree
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"unknown acceptance mode {acceptance!r}; expected one of {ACCEPTANCE_MODES}")
    if logits.dim() != 2 or logits.shape[0] != tree.num_nodes:
        raise ValueError(
            f"logits must be [N, V] with N = tree.num_nodes = {tree.num_nodes} (root + {len(tree)} candidates), "
            f"got {tuple(logits.shape)}"
        )
    q_draft = proposal.q_draft
    if q_draft is not None and q_draft.shape != logits.shape:
        raise ValueError(
            f"q_draft must match logits' shape [N, V] = {tuple(logits.shape)}, got {tuple(q_draft.shape)}"
        )

    if acceptance == "block" and not tree.is_chain:
        raise ValueError(f"acceptance='block' verifies chains (Sun et al. 2024) and {tree!r} branches: use "
                         "acceptance='traversal', which is block verification on a chain and handles trees")

    if sampling.greedy:
        return _walk_greedy(logits, proposal)
    if acceptance in ("block", "traversal"):
        return _walk_sequence(logits, proposal, sampling, generator)
    if acceptance == "typical":
        return _walk_typical(logits, proposal, sampling, generator, typical_epsilon, typical_delta)
    return _walk_rejection(logits, proposal, sampling, generator)


def rank_acceptance(candidates: torch.Tensor, target_logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The chance each deterministic candidate is the token the target emits at its parent: candidates
    [..., R] (distinct tokens in rank order), target_logits [..., V] → float [..., R]. Greedy: 1 for the
    target's argmax. Sampling: p_target(x), since EAGLE-2's sibling rule is "draw y ~ p, then look for y
    among the siblings". Mutually exclusive across ranks, so they add up along a tree's siblings; this
    is what accuracy-grown trees and speedup predictions need at the decoding temperature."""
    if sampling.greedy:
        return (candidates == argmax(target_logits)[..., None].to(candidates.device)).float()
    return probs(target_logits, sampling).gather(-1, candidates)


# -- deepest passing path (greedy and typical) ---------------------------------------------------------
def _deepest_passing(tree: Tree, passes: list[bool]) -> int:
    """passes[j - 1]: whether node j's token is acceptable at its parent → the deepest node whose whole path
    passes (the first in node order among equally deep ones; 0 if none).

    A host loop over the nodes: parents precede their children in node order (breadth-first), so one pass
    decides reachability. For trees of up to about a hundred nodes it is cheaper than the ten or so tensor
    ops of the vectorised ancestor-matrix form (each a launch on an accelerator), or that form in numpy."""
    parents, depths = tree.parent_list, tree.depth_list
    reachable = [True] + [False] * len(passes)
    best = 0
    for j, ok in enumerate(passes, start=1):
        if ok and reachable[parents[j]]:
            reachable[j] = True
            if depths[j] > depths[best]:
                best = j
    return best


def _walk_greedy(logits: torch.Tensor, proposal: Proposal) -> Walk:
    tree = proposal.tree
    best_token = argmax(logits, check_finite=True).tolist()  # [N]: the one host sync
    drafted = proposal.tokens.tolist()  # [n]
    best = _deepest_passing(tree, [x == best_token[p] for x, p in zip(drafted, tree.parent_list[1:], strict=True)])
    return Walk(path=tree.path_to(best), next_token=best_token[best])


def _walk_typical(logits, proposal, sampling, generator, epsilon, delta) -> Walk:
    tree = proposal.tree
    p_target = probs(logits, sampling)  # [N, V]
    entropy = torch.special.entr(p_target).sum(-1)  # [N]; entr(0) = 0
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # [N]: min(ε, δ·e^−H)
    parents = tree.parents[1:].to(p_target.device)  # [n]
    tokens = proposal.tokens.to(p_target.device)  # [n]
    passes = p_target[parents, tokens] > threshold[parents]  # [n]
    node = _deepest_passing(tree, passes.tolist())
    next_token = int(sample(p_target[node].cpu(), generator))
    return Walk(path=tree.path_to(node), next_token=next_token)


# -- lossless sampling ------------------------------------------------------------------------------
def _walk_rejection(logits, proposal, sampling, generator) -> Walk:
    # The walk is sequential, so it runs on the host. Distributions are made and moved there only for
    # the nodes it visits (depth + 1 rows, not N): with a real vocabulary, softmax (and top-p's sort)
    # over every node of a 64-node tree, or copying them all off an accelerator, would dominate the walk.
    # A tiny table is cheaper in one call than in depth + 1.
    tree, q_draft = proposal.tree, proposal.q_draft
    tokens = proposal.tokens.cpu()  # [n]; node j's token is tokens[j - 1]
    p_table = probs(logits, sampling).cpu() if logits.numel() <= _ONE_CALL_NUMEL else None  # [N, V] or None
    children = tree.children
    path: list[int] = []
    node = 0
    while True:
        p_target = p_table[node] if p_table is not None else probs(logits[node], sampling).cpu()  # [V]
        kids = children[node]
        if not kids:  # every candidate on the path accepted: a free bonus token from the target
            return Walk(path=torch.tensor(path, dtype=torch.long), next_token=int(sample(p_target, generator)))
        # Tree numbers nodes breadth-first by path, so siblings are consecutive, in rank order
        drafted = tokens[kids[0] - 1 : kids[-1]]  # [k]
        # one draw per sibling, drawn up front, on the generator's own device (a CUDA generator draws there)
        uniform = torch.rand(len(kids), generator=generator, device=generator_device(generator)).tolist()
        if q_draft is None:
            chosen, residual = _siblings_deterministic(p_target, drafted, uniform)
        else:
            chosen, residual = _siblings_sampled(p_target, q_draft[node].float().cpu(), drafted, uniform,
                                                 proposal.without_replacement)
        if chosen is None:  # all siblings rejected: the step ends with a draw from the residual
            return Walk(path=torch.tensor(path, dtype=torch.long), next_token=int(sample(residual, generator)))
        node = kids[chosen]
        path.append(node)


def _siblings_deterministic(p_target, drafted, uniform):
    """EAGLE-2's rule for deterministic candidates. p_target: [V]; drafted: LongTensor [k], sibling
    tokens in rank order; uniform: k draws from U[0, 1). → (accepted sibling's index or None, residual [V]).

    Accepting x with p(x)/remaining and removing it on rejection is sampling y ~ p and asking the
    siblings in turn whether they are y, so it is lossless whatever the tokens (duplicates included:
    a removed token has probability 0 and is rejected).
    """
    mass = p_target[drafted].tolist()  # p(x) of each sibling
    drafted = drafted.tolist()
    remaining = 1.0  # p's mass not yet rejected (p is normalised)
    rejected: set[int] = set()
    for j, x in enumerate(drafted):
        if x in rejected:
            continue
        # u < p(x)/remaining; x holding (up to rounding) all remaining mass is accepted outright
        if uniform[j] * remaining < mass[j] or mass[j] >= remaining - _EMPTY_MASS:
            return j, None
        rejected.add(x)
        remaining -= mass[j]
    residual = p_target.clone()
    residual[list(rejected)] = 0.0  # multinomial renormalises
    return None, residual


def _siblings_sampled(p_target, q, drafted, uniform, without_replacement=False):
    """SpecInfer's multi-candidate rejection sampling. p_target, q: [V] (q = q_draft of the parent,
    which every sibling was drawn from i.i.d.); drafted: LongTensor [k]; uniform: k draws from U[0, 1).
    → (accepted sibling's index or None, residual [V]).

    ``without_replacement``: sibling j was drawn from q without siblings 0..j-1 (``draft_after``; None
    once q is spent: a point mass at its token), the recursive rejection sampling of Jeon et al. 2024."""
    drafted = drafted.tolist()
    residual = p_target
    for j, x in enumerate(drafted):
        q_x = 1.0 if q is None else float(q[x])
        # u < min(1, p(x)/q(x)) written without the division: q(x) = 0 < p(x) accepts, 0 = 0 rejects
        if uniform[j] * q_x < float(residual[x]):
            return j, None
        if q is None:  # max(p − δ_x, 0): p without x
            update = residual.clone()
            update[x] = 0.0
        else:
            update = (residual - q).clamp_(min=0.0)  # [V]
        mass = float(update.sum())
        # max(p − q, 0) is empty only when p == q, where rejection happens only through rounding: keep p
        if mass > _EMPTY_MASS:
            residual = update / mass
        if without_replacement:
            q = draft_after(q, x)
    return None, residual


# -- sequence-level: block and traversal verification ------------------------------------------------
def _walk_sequence(logits, proposal, sampling, generator) -> Walk:
    """Traversal verification (block verification on a chain): try the nodes leaf to root and stop at the
    first accepted one."""
    tree = proposal.tree
    # at most one trial per node: every uniform drawn up front, on the generator's own device
    uniform = torch.rand(tree.num_nodes, generator=generator, device=generator_device(generator)).tolist()
    for u, trial in zip(uniform, sequence_trials(logits, proposal, sampling), strict=False):
        if u < trial.probability or trial.node == 0:
            next_token = int(sample(trial.mass.next_distribution(), generator))
            return Walk(path=tree.path_to(trial.node), next_token=next_token)
    raise AssertionError("the traversal ends at the root, which is always accepted")


def sequence_trials(logits: torch.Tensor, proposal: Proposal, sampling: Sampling):
    """The traversal's trials (treespec/walker_traversal.py) for this proposal at this sampling: what
    ``walk`` draws against, and what tests sum to the walk's exact output law. Rows of p_target and
    q_draft are made and brought to the host only for the nodes the traversal reaches."""
    tree, q_draft = proposal.tree, proposal.q_draft
    # a trial weighs children against their parent's row: every internal node's row may be needed (all of them
    # when drafts are poor), so they are made in one call when they are few; a leaf's only if it is accepted
    internal = [i for i in range(tree.num_nodes) if tree.children[i]]
    table = {}
    if internal and len(internal) * logits.shape[-1] <= _INTERNAL_ROWS_NUMEL:
        index = torch.tensor(internal, dtype=torch.long, device=logits.device)
        rows = probs(logits[index], sampling).cpu()  # [n_internal, V]
        table = dict(zip(internal, rows, strict=True))

    def target_row(node: int) -> torch.Tensor:
        return table[node] if node in table else probs(logits[node], sampling).cpu()

    tokens = proposal.tokens.tolist()
    drafts: dict[int, torch.Tensor | None] = {}  # child → the law it was drawn from

    def draft_of(child: int) -> torch.Tensor | None:
        if q_draft is None:
            return None  # deterministic: the point mass at the child's token
        if child not in drafts:  # the whole sibling group at once
            kids = tree.children[tree.parent_list[child]]
            draft = q_draft[tree.parent_list[child]].float().cpu()  # [V]
            for kid in kids:
                drafts[kid] = draft
                if proposal.without_replacement:
                    draft = draft_after(draft, tokens[kid - 1])
        return drafts[child]

    return trials(tree, tokens, target_row, draft_of)
