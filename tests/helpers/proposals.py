"""What a drafter proposed, step after step, and what it should have proposed: the same tree grown from
logits recomputed with no cache at all (so a test can show the drafter's cache stays in sync with what the
target accepts)."""

import importlib
import itertools
import random

import torch

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel
from treespec.inputs import left_padded
from treespec.walker import Walk, row_by_row


def record_proposals(drafter) -> list:
    """Wrap ``drafter.propose`` so every step's (committed [1, L], tree, proposal) of every row is kept (row after
    row within a step); returns that list."""
    seen = []
    propose = drafter.propose

    def recording(committed, feature, step_tree, sampling, generator=None):
        proposals = propose(committed, feature, step_tree, sampling, generator)
        rows = range(len(committed.lengths))
        seen.extend((committed.row(b)[None].clone(), step_tree, proposals.row(b)) for b in rows)
        return proposals

    drafter.propose = recording
    return seen


def accept_deepest(logits, proposal, sampling, **kwargs):
    """A stand-in walker that accepts the deepest path whatever the target says, so that the drafter's cache must
    absorb long accepted paths (a random drafter is rarely right): patch it in with ``walker.row_by_row``."""
    tree = proposal.tree
    path = torch.tensor(max(tree.leaf_paths, key=len)) if len(tree) else torch.empty(0, dtype=torch.long)
    return Walk(path=path, next_token=int(logits[int(path[-1]) if len(path) else 0].argmax()))


def accept_random_prefix(seed=0):
    """A stand-in walker that accepts a random prefix of the deepest path, whatever the target says: rows of a batch
    keep different numbers of tokens every step (patch it in with ``walker.row_by_row``)."""
    rng = random.Random(seed)

    def walk(logits, proposal, sampling, **kwargs):
        deepest = max(proposal.tree.leaf_paths, key=len) if len(proposal.tree) else []
        path = torch.tensor(deepest[: rng.randint(0, len(deepest))], dtype=torch.long)
        return Walk(path=path, next_token=int(logits[int(path[-1]) if len(path) else 0].argmax()))

    return walk


def proposed_while_accepting(target, prompt, drafter, tree, rows: str, monkeypatch) -> list:
    """Decode with ``drafter`` while a stand-in walker accepts whatever it proposes: ``rows="one"``, ``prompt``'s row
    accepting the deepest path (long accepted paths: τ > 2.5), else a ragged batch of four prompts accepting random
    prefixes (rows accept different lengths). → every step's ``record_proposals`` entries, each to be compared with
    the proposal recomputed with no cache (the drafter's cache stays in sync with what the target accepts)."""
    seen = record_proposals(drafter)
    walker = accept_deepest if rows == "one" else accept_random_prefix()
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(walker))
    if rows == "one":
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=16)
        assert out.mean_accept_length > 2.5
    else:
        ids, mask = left_padded([torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
                                 for n in (3, 11, 1, 7)], 0)
        out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=tree, max_new_tokens=16)
        assert len({tuple(row.accept_lengths) for row in out.rows}) > 1
    assert len(seen) > 3
    return seen


def expect_batched_greedy(target, drafter, tree, new: int = 24):
    """A ragged batch (prompts of 3, 17, 9 and 1 tokens, left-padded) decoded with ``drafter`` equals transformers'
    batched greedy generate token for token, its rows accepting different lengths; returns the result."""
    ids, mask = left_padded([torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
                             for n in (3, 17, 9, 1)], 0)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0)
    out = generate(target, ids, attention_mask=mask, drafter=drafter, tree=tree, max_new_tokens=new)
    assert torch.equal(out.sequences, expected)
    assert len({tuple(row.accept_lengths) for row in out.rows}) > 1
    return out


def eagle_features(target, model, committed):
    """Recomputed from scratch: entry j pairs committed token j + 1 with the target's feature at j."""
    with torch.no_grad():
        hidden = target(input_ids=committed[:, :-1], output_hidden_states=True).hidden_states
        features = model.fuse(torch.cat([hidden[i] for i in model.feature_layers], dim=-1))  # [1, L-1, h]
    return committed[:, 1:], features


def scratch_logits(drafter, target, committed):
    """path (tokens after the root) → draft logits [V] at its end, with no cache at all."""
    if isinstance(drafter, DraftModel):
        def logits(path):
            ids = torch.cat([committed, torch.tensor([path], dtype=torch.long)], dim=1)
            return drafter.model(input_ids=ids).logits[0, -1]

        return logits
    model = drafter.model
    tokens, features = eagle_features(target, model, committed)

    def logits(path):
        ids, feats = tokens, features
        for token in path:  # a tree node pairs its token with its parent's output
            g = model(ids, feats)
            ids, feats = torch.cat([ids, torch.tensor([[token]])], 1), torch.cat([feats, g[:, -1:]], 1)
        return model.logits(model(ids, feats)[0, -1])

    return logits


def scratch_proposal(logits_at, tree) -> dict:
    """{tree path: token}, growing the tree as the drafter should: static ranks or EAGLE-2's beam."""
    if isinstance(tree, Tree):
        tokens = {(): []}  # rank path → token path
        for path in tree.paths:
            parent = tokens[path[:-1]]
            tokens[path] = [*parent, int(logits_at(parent).topk(path[-1] + 1).indices[-1])]
        return {p: t[-1] for p, t in tokens.items() if p}
    grown = [((), (), 0.0)]  # (rank path, token path, cumulative log q)
    frontier = [grown[0]]
    for _ in range(tree.depth):
        children = []
        for ranks, toks, score in frontier:
            top = torch.log_softmax(logits_at(list(toks)), -1).topk(tree.top_k)
            children += [(ranks + (r,), toks + (int(t),), min(score + float(v), score))
                         for r, (v, t) in enumerate(zip(top.values, top.indices, strict=True))]
        grown += children
        frontier = sorted(children, key=lambda c: -c[2])[: tree.top_k]  # stable: ties keep growth order
    kept = sorted(grown[1:], key=lambda c: -c[2])[: tree.total_tokens]
    return {ranks: toks[-1] for ranks, toks, _ in kept}


def block_proposal(log_q: torch.Tensor, tree) -> dict:
    """{rank path: token} of ``tree`` over a block drafter's per-depth log-probabilities ``log_q`` [D, V] (depth
    d + 1's at d), by brute force: a static tree's ranks, or a DynamicTree's best nodes (every path of top-k ranks,
    scored by the sum of its log-probabilities; ties to the smaller path)."""
    if isinstance(tree, Tree):
        return {p: int(log_q[len(p) - 1].topk(p[-1] + 1).indices[-1]) for p in tree.paths}
    depth, k = min(tree.depth, log_q.shape[0]), tree.top_k
    top = log_q[:depth].topk(k)
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    score = {p: sum(float(top.values[i, r]) for i, r in enumerate(p)) for p in paths}
    kept = sorted(paths, key=lambda p: (-score[p], p))[: len(DynamicTree(tree.total_tokens, depth, k))]
    return {p: int(top.indices[len(p) - 1, p[-1]]) for p in kept}
