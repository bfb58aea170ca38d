"""Hybrid draft models (treespec.heads.DraftModel over a recurrent cache, treespec.recurrent.DraftRows): checks.

Greedy output equal to transformers' own greedy ``generate`` of the target says nothing about the draft: the target
verifies whatever it proposes. So each check also replays every proposal against the draft model's own cache-free
forward: the rank-r child of a node must be the r-th likeliest draft token after the node's path, which a state
gathered from the wrong row, advanced past its node, or not restored after the walk breaks. A draft that is a
jittered copy of its target (``perturbed``) has its paths accepted to every depth, so both ends of the draft's
accept (keep the deepest accepted row; restore the root's state) run.
"""

from __future__ import annotations

import numpy as np
import torch

from treespec.drafter import Proposal
from treespec.heads import DraftModel
from treespec.sampling import Sampling
from treespec.train.checks.hybrids import (
    S_VOCAB,
    TREES,
    build,
    exact_distribution,
    expect_greedy,
    llama,
    sampled_counts,
    tau,
)
from treespec.train.checks.lossless import chi2_pvalue, perturbed


def recorded(drafter) -> list[tuple[torch.Tensor, Proposal]]:
    """Every (committed tokens [L], proposal) ``drafter`` makes from now on (one prompt)."""
    records, propose = [], drafter.propose

    def recording(committed, *args, **kwargs):
        proposals = propose(committed, *args, **kwargs)
        records.append((committed.row(0).clone(), proposals.row(0)))
        return proposals

    drafter.propose = recording
    return records


@torch.no_grad()
def check_candidates(model, context: torch.Tensor, proposal: Proposal) -> None:
    """Each node's token must be the top-k rank its tree gives it of ``model``'s cache-free next-token logits after
    ``context`` [L] (root last) and the node's ancestors."""
    tree, tokens = proposal.tree, [None, *proposal.tokens.tolist()]
    paths: dict[int, list[int]] = {0: context.tolist()}
    ranked: dict[int, list[int]] = {}  # parent → its draft tokens by rank
    for i in range(1, tree.num_nodes):  # parents first
        parent, rank = tree.parent_list[i], int(tree.ranks[i])
        if parent not in ranked:
            logits = model(input_ids=torch.tensor([paths[parent]], device=model.device)).logits[0, -1]
            ranked[parent] = logits.topk(int(tree.ranks[tree.children[parent]].max()) + 1).indices.tolist()
        if tokens[i] != ranked[parent][rank]:
            raise AssertionError(f"node {i} (rank {rank}) proposed {tokens[i]}, the draft's own forward ranks "
                                 f"{ranked[parent]} after {len(paths[parent])} tokens")
        paths[i] = paths[parent] + [tokens[i]]


def draft_for(target_name: str, draft_name: str):
    """The draft model: a jittered copy of the target's own family (accepted often), else another family's."""
    if draft_name == target_name:
        return perturbed(build(draft_name), scale=0.1)
    return build(draft_name, seed=1)


def check_hybrid_draft(target_name: str, draft_name: str, tree: str = "tree") -> str:
    """A hybrid ``draft_name`` drafts ``tree`` for ``target_name`` (a hybrid family, or "Llama"): equal to transformers'
    greedy, every candidate the draft's own top-k at its node; a jittered own-family draft's paths stop at several
    depths."""
    target = llama() if target_name == "Llama" else build(target_name)
    draft = draft_for(target_name, draft_name)
    drafter = DraftModel(draft)
    proposals = recorded(drafter)
    out = expect_greedy(target, drafter, TREES[tree])
    for context, proposal in proposals:
        check_candidates(draft, context, proposal)
    if draft_name == target_name and len(set(out.accept_lengths[:-1])) < 2:
        raise AssertionError(f"every path stopped at one depth ({out.accept_lengths}): one branch of accept only")
    return tau(out)


def check_self_draft(name: str, tree) -> list[int]:
    """The target drafting for itself: each step's greedy path (rank 0 at every depth) is accepted whole, step after
    step, only if the draft's state after each walk is exactly the accepted path's. Returns the accept lengths."""
    target = build(name)
    drafter = DraftModel(target)
    proposals = recorded(drafter)
    out = expect_greedy(target, drafter, tree)
    whole = [1 + greedy_depth(proposal.tree) for _, proposal in proposals]
    if out.accept_lengths[:-1] != whole[: len(out.accept_lengths) - 1]:
        raise AssertionError(f"a {name} draft of itself stopped early: accept lengths {out.accept_lengths}, "
                             f"{whole} expected")
    return out.accept_lengths


def greedy_depth(tree) -> int:
    """How deep the path of rank-0 children from the root goes."""
    node, depth = 0, 0
    while kids := [k for k in tree.children[node] if int(tree.ranks[k]) == 0]:
        node, depth = kids[0], depth + 1
    return depth


def check_draft_sampling(target_name: str = "Qwen3.5", draft_name: str = "LFM2", runs: int = 300) -> float:
    """Sampled continuations (temperature 1, i.i.d. draft candidates on the uneven tree) against the target's exact
    law: p-value."""
    target = build(target_name, vocab=S_VOCAB, hidden=32, init_std=0.3, seed=11)
    draft = build(draft_name, vocab=S_VOCAB, hidden=32, init_std=0.3, seed=12)
    counts: np.ndarray = sampled_counts(target, DraftModel(draft, candidates="sample"), runs, TREES["uneven tree"])
    return chi2_pvalue(counts, exact_distribution(target, Sampling(1.0)))
