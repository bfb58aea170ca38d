"""What a drafter proposed, step after step, and what it should have proposed: the same tree grown from
logits recomputed with no cache at all (so a test can show the drafter's cache stays in sync with what the
target accepts)."""

import torch

from treespec import Tree
from treespec.heads import DraftModel
from treespec.walker import Walk


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
