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

from treespec.drafter import Proposal, Proposals
from treespec.sampling import Sampling, argmax, generator_device, probs, sample
from treespec.walker_batch import Verdicts, Walked, accepted, read_back, walk_batch
from treespec.walker_traversal import draft_after, trials

ACCEPTANCE_MODES = ("rejection", "block", "traversal", "typical")
#: the lossless rules, side by side in the comparison (typical acceptance is not lossless)
LOSSLESS_MODES = ("rejection", "block", "traversal")

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
    seeded walk is reproducible. Greedy, rejection and typical walks run on the logits' device
    (treespec/walker_batch.py, one read of the outcome); block and traversal verification are sequential and
    run on the host, bringing over only the rows they visit.

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

    if acceptance in ("block", "traversal") and not sampling.greedy:
        return _walk_sequence(logits, proposal, sampling, generator)
    # one row of the batched walk (treespec/walker_batch.py: the same rules in tensor ops), read back here
    one = Proposals([tree], proposal.tokens[None], None if q_draft is None else q_draft[None],
                    proposal.without_replacement)
    verdict = walk_batch(logits[None], one, sampling, acceptance=acceptance, generator=generator,
                         typical_epsilon=typical_epsilon, typical_delta=typical_delta)
    row = accepted(verdict.packed().tolist(), sampling)[0]
    return Walk(path=torch.tensor(row.path, dtype=torch.long), next_token=row.tokens[-1])


def walk_rows(logits: torch.Tensor, proposals: Proposals, sampling: Sampling, *, acceptance: str = "rejection",
              generator: torch.Generator | None = None) -> Walked:
    """Every row of a batch: logits [b, ≥ N, V] → what the loop commits, read back once (``read_back``: the step's
    one host read). Greedy, rejection and typical walks run on the device (``walk_batch``); block and traversal
    verification, row by row on the host (``walk``)."""
    if acceptance in ("block", "traversal") and not sampling.greedy:
        return row_by_row(walk)(logits, proposals, sampling, acceptance=acceptance, generator=generator)
    return read_back(walk_batch(logits, proposals, sampling, acceptance=acceptance, generator=generator), proposals,
                     sampling)


def row_by_row(walker):
    """``walker`` (``walk``'s signature: one row's logits [N, V] and Proposal → Walk) as ``walk_rows``: each row
    walked on its own, one after another, the outcomes gathered as Verdicts on the host and read back as
    ``walk_rows`` reads them."""

    def walk_each(logits, proposals, sampling, **options) -> Walked:
        walks = [walker(logits[b, : proposals.trees[b].num_nodes], proposals.row(b), sampling, **options)
                 for b in range(len(proposals.trees))]
        depth = max(1, *(tree.depth for tree in proposals.trees))
        drafted = proposals.tokens.cpu()
        nodes = torch.zeros(len(walks), depth, dtype=torch.long)
        tokens = torch.full((len(walks), depth + 1), -1, dtype=torch.long)
        for b, w in enumerate(walks):
            k = len(w.path)
            nodes[b, :k] = w.path
            tokens[b, :k] = drafted[b, w.path - 1]
            tokens[b, k] = w.next_token
        lengths = torch.tensor([len(w.path) for w in walks], dtype=torch.long)
        return read_back(Verdicts(lengths, nodes, tokens, torch.zeros(len(walks), dtype=torch.bool)), proposals,
                         sampling)

    return walk_each


def rank_acceptance(candidates: torch.Tensor, target_logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The chance each deterministic candidate is the token the target emits at its parent: candidates
    [..., R] (distinct tokens in rank order), target_logits [..., V] → float [..., R]. Greedy: 1 for the
    target's argmax. Sampling: p_target(x), since EAGLE-2's sibling rule is "draw y ~ p, then look for y
    among the siblings". Mutually exclusive across ranks, so they add up along a tree's siblings; this
    is what accuracy-grown trees and speedup predictions need at the decoding temperature."""
    if sampling.greedy:
        return (candidates == argmax(target_logits)[..., None].to(candidates.device)).float()
    return probs(target_logits, sampling).gather(-1, candidates)


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
