"""Drafters combined: one verified tree from several drafters' proposals (SAM-Decoding's lesson, made general).

Hu et al. 2024 (SAM-Decoding) draft from a suffix automaton where it matches well and fall back on another drafter
where it does not. ``Combined([a, b, ...])`` offers both ways, for any drafters whose candidates are fixed ranks:

* ``mode="union"`` (default): every drafter proposes; their trees are merged by shared prefixes (two nodes whose
  paths from the root spell the same tokens are one node) into one tree of at most ``nodes`` candidates (default:
  the step's tree size), the first drafter's nodes first, breadth-first, then the next one's new nodes. Siblings
  stay distinct tokens, the first drafter's in their order, then the others'.
* ``mode="fallback"``: each row takes the first drafter whose proposal has at least ``min_nodes`` candidates (a
  strong match), else the largest proposal.

Either way each candidate is a function of the past (each drafter's is), so the walker's sibling rule verifies the
merged tree losslessly, as any top-k tree (treespec/walker.py). Drafters that sample their candidates are
refused (their q_draft describes their own tree, not a merged one), and so are drafters that need the target's
hidden states (EAGLE, Medusa): after a step they would be owed features of accepted tokens their own tree did not
hold. Each drafter is told the part of the accepted path its tree held; one with a cache (a draft model) feeds the
rest next step from the committed tokens, as it does for the bonus token.

    drafter = Combined([TokenRecycling(), PromptLookup()])                 # union, the step tree's size
    drafter = Combined([SuffixDecoding(), DraftModel(draft)], mode="fallback", min_nodes=2)
"""

from __future__ import annotations

import torch

from treespec.drafter import Committed, Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.sampling import Sampling
from treespec.tree import Tree

MODES = ("union", "fallback")


def merge(proposals: list[Proposal], budget: int) -> tuple[Proposal, list[dict[int, int]]]:
    """The union of ``proposals`` by shared prefixes, at most ``budget`` candidates → (the merged proposal, per
    proposal: its node index → the merged tree's node index, for the nodes kept)."""
    rank_paths: list[tuple[int, ...]] = [()]  # merged id → its path of sibling ranks
    tokens: list[int] = [-1]
    kids: list[dict[int, int]] = [{}]  # merged id → {token: merged id}, in insertion (rank) order
    to_merged = []
    for proposal in proposals:
        parents, drafted = proposal.tree.parent_list, proposal.tokens.tolist()
        mapped = {0: 0}
        for i in range(1, proposal.tree.num_nodes):  # parents before children
            parent = mapped.get(parents[i])
            if parent is None:
                continue
            token = drafted[i - 1]
            if token in kids[parent]:
                mapped[i] = kids[parent][token]
            elif len(tokens) - 1 < budget:
                mapped[i] = kids[parent][token] = len(tokens)
                rank_paths.append((*rank_paths[parent], len(kids[parent]) - 1))
                tokens.append(token)
                kids.append({})
        to_merged.append(mapped)
    tree = Tree(rank_paths[1:])
    node_of = {(): 0} | {path: i + 1 for i, path in enumerate(tree.paths)}  # Tree: by depth, then path
    order = [node_of[p] for p in rank_paths]  # merged id → tree node (the root: 0)
    ordered = [0] * len(tree)
    for merged_id in range(1, len(tokens)):
        ordered[order[merged_id] - 1] = tokens[merged_id]
    maps = [{i: order[m] for i, m in mapped.items()} for mapped in to_merged]
    return Proposal(tree, torch.tensor(ordered, dtype=torch.long)), maps


class Combined(Drafter):
    def __init__(self, drafters: list[Drafter], *, mode: str = "union", nodes: int | None = None, min_nodes: int = 1):
        drafters = list(drafters)
        if len(drafters) < 2 or not all(isinstance(d, Drafter) for d in drafters):
            raise ValueError(f"Combined needs two or more treespec Drafters, got {drafters!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        for d in drafters:
            if d.candidates != "topk":
                raise ValueError(f"Combined merges fixed-rank candidates; {type(d).__name__} samples them "
                                 f"(candidates={d.candidates!r}): make it with candidates='topk'")
            if d.needs_features:
                raise ValueError(f"Combined cannot serve {type(d).__name__}: it needs the target's hidden states at "
                                 "accepted tokens its own tree may not hold (model-free drafters and draft models "
                                 "only)")
        for name, value, low in (("nodes", nodes, 1), ("min_nodes", min_nodes, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.drafters, self.mode, self.nodes, self.min_nodes = drafters, mode, nodes, min_nodes
        self.default_tree = drafters[0].default_tree
        self.grows_dynamic_trees = all(d.grows_dynamic_trees for d in drafters)
        self.observes_logits = any(d.observes_logits for d in drafters)
        self.remembers_across_calls = any(d.remembers_across_calls for d in drafters)
        limits = [d.max_tree_depth for d in drafters if d.max_tree_depth is not None]
        self.max_tree_depth = min(limits) if limits else None
        positions = [d.max_positions for d in drafters if d.max_positions is not None]
        self.max_positions = min(positions) if positions else None
        self._maps: list[list[dict[int, int]]] = []  # per row, per drafter: merged node → its node

    # -- what the loop calls, handed on to every drafter -----------------------------------------------------------
    def check_target(self, target) -> None:
        for d in self.drafters:
            d.check_target(target)

    def check_batch(self, batch_size: int) -> None:
        for d in self.drafters:
            d.check_batch(batch_size)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def compile_steps(self, options, capacity: int) -> None:
        for d in self.drafters:
            d.compile_steps(options, capacity)

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        for d in self.drafters:
            d.prefill(input_ids, None, attention_mask)

    def observe_pass(self, tokens, trees, logits) -> None:
        for d in self.drafters:
            if d.observes_logits:
                d.observe_pass(tokens, trees, logits)

    def keep_rows(self, rows: torch.Tensor) -> None:
        for d in self.drafters:
            d.keep_rows(rows)
        self._maps = [self._maps[b] for b in rows.tolist()] if self._maps else []

    def propose(self, committed: Committed, feature, tree: Tree | DynamicTree, sampling: Sampling,
                generator=None) -> Proposals:
        each = [d.propose(committed, None, tree, sampling, generator) for d in self.drafters]
        budget = self.nodes if self.nodes is not None else len(tree)
        rows, self._maps = [], []
        for b in range(len(committed.lengths)):
            proposals = [p.row(b) for p in each]
            if self.mode == "union":
                merged, maps = merge(proposals, budget)
            else:  # the first strong proposal, else the largest; the others see none of it accepted
                strong = [i for i, p in enumerate(proposals) if len(p.tree) >= max(1, self.min_nodes)]
                pick = strong[0] if strong else max(range(len(proposals)), key=lambda i: len(proposals[i].tree))
                merged, maps = merge([proposals[pick]], budget)
                maps = [maps[0] if i == pick else {0: 0} for i in range(len(proposals))]
            rows.append(merged)
            # merged node → each drafter's node
            self._maps.append([{m: i for i, m in mapped.items()} for mapped in maps])
        return Proposals.stack(rows)

    def accept(self, paths: list[torch.Tensor], features) -> None:
        for k, d in enumerate(self.drafters):
            own = []
            for b, path in enumerate(paths):
                back, mine = self._maps[b][k], []
                for node in path.tolist():  # the accepted path's prefix that was this drafter's
                    if node not in back:
                        break
                    mine.append(back[node])
                own.append(torch.tensor(mine, dtype=torch.long))
            d.accept(own, None)
