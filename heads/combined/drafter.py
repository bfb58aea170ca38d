"""Drafters combined: one verified tree from several drafters' proposals (SAM-Decoding's lesson, made general).

Hu et al. 2024 (SAM-Decoding) draft from a suffix automaton where it matches well and fall back on EAGLE-2 where it
does not. ``Combined([a, b, ...])`` offers that, and the union, for any drafters whose candidates are fixed ranks:

* ``mode="union"`` (default): every drafter proposes (each within the step's tree, as it would alone); their trees
  are merged by shared prefixes (two nodes whose paths from the root spell the same tokens are one node) into one
  tree, the first drafter's nodes first, breadth-first, then the next one's new nodes, at most ``nodes`` candidates
  (None, the default: all of them; heads/combined/tree_union.py). Capped at the step tree's size, one drafter's nodes
  only displace another's: on the reference target suffix + EAGLE-3 then accepts what EAGLE-3 alone does, uncapped
  it verifies 2 nodes more a step and accepts 6 % more (docs/usage.md).
* ``mode="fallback"``: each row takes the first drafter whose proposal has at least ``min_nodes`` candidates (a
  strong match: SuffixDecoding grows at most ``alpha`` × match-length nodes), else the largest proposal.

``part_trees`` gives a part its own tree, in place of the step's (None: the step's): SAM-Decoding drafts a chain
from its suffix automaton and an EAGLE-2 tree from its fallback. Prompt lookup fills a chain's spine and nothing
beside it, while a block drafter's likeliest few nodes form a tree (docs/results.md compares the two), so
``Combined([PromptLookup(), dflash], mode="fallback", part_trees=[None, DynamicTree(7, 7, 4)])`` verifies prompt
lookup's chain of 7 on a match and DFlash's best 7-node tree otherwise.
A part's tree is cut to the step tree's depth (the loop shortens that one where rows near their end).

Either way each candidate is a function of the past (each drafter's is), so the walker's sibling rule verifies the
merged tree losslessly, as any top-k tree (treespec/walker.py). Drafters that sample their candidates are refused:
their q_draft describes their own tree, not a merged one.

After a step every drafter is told the whole accepted path in its own node numbering, the tokens another drafter
proposed marked ``NOT_PROPOSED`` (treespec/drafter.py), with the target's hidden states at all of them. A draft model
keeps its cache along its own part and feeds the rest next step from the committed tokens, as it does the bonus
token; a feature drafter (EAGLE, EAGLE-3, Hydra's prefix layer) pairs every committed token with its target feature,
whoever proposed it, since the target's pass computed features at every node it verified. The loop asks for the
union of the members' feature layers; each member is handed its own columns of them.

Every drafter proposes every step, except in fallback mode a member that ``proposes_on_demand`` (DFlash: its block
is a function of the context its ``accept`` keeps) once every row already has a strong proposal from an earlier
member: then it only accepts, and prompt lookup with a DFlash fallback pays for the block on the steps without a
match alone. The outputs are the same (the first strong proposal wins either way). Any other drafter proposes every
step: a feature drafter's cache must be fed each committed token anyway. Merging compares tokens, so in union mode
each drafter's candidates are read back once a step (one host read per network drafter: a model-free drafter's are
on the host already); fallback reads none.

    drafter = Combined([TokenRecycling(), PromptLookup()])                 # union, every node of both
    drafter = Combined([SuffixDecoding(), registry.build("eagle3", target, "reference:eagle3")])  # SAM-Decoding's pair
    drafter = Combined([SuffixDecoding(), DraftModel(draft)], mode="fallback", min_nodes=2)
"""

from __future__ import annotations

import torch

from treespec.drafter import NOT_PROPOSED, Committed, Drafter, Proposal, Proposals
from treespec.dynamic_tree import DynamicTree
from treespec.heads.combined.tree_union import merge
from treespec.sampling import Sampling
from treespec.tree import Tree

MODES = ("union", "fallback")


def check_settings(mode: str, nodes: int | None, min_nodes: int) -> None:
    """Raise ValueError naming a bad ``mode``, ``nodes`` or ``min_nodes``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value, low in (("nodes", nodes, 1), ("min_nodes", min_nodes, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def feature_columns(drafters: list[Drafter]) -> tuple[tuple[int, ...], list[list[int] | None]]:
    """(the target hidden-state layers the loop hands the combination, each drafter's blocks among them: None for a
    drafter without features). EAGLE takes (-1,), EAGLE-3 (2, 3, 4) on the reference target: (2, 3, 4, -1)."""
    layers: list[int] = []
    for d in drafters:
        if d.needs_features:
            layers += [layer for layer in d.feature_layers if layer not in layers]
    return tuple(layers), [[layers.index(layer) for layer in d.feature_layers] if d.needs_features else None
                           for d in drafters]


def columns_of(features: torch.Tensor | None, blocks: list[int] | None, layers: int) -> torch.Tensor | None:
    """``features`` [..., layers·h] → the ``blocks`` of h columns one drafter takes [..., len(blocks)·h]: a view when
    they are consecutive (always, for one feature drafter)."""
    if features is None or blocks is None:
        return None
    h = features.shape[-1] // layers
    if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        return features[..., blocks[0] * h : (blocks[0] + len(blocks)) * h]
    return torch.cat([features[..., i * h : (i + 1) * h] for i in blocks], dim=-1)


def check_part_trees(drafters: list[Drafter], part_trees) -> list[Tree | DynamicTree | None]:
    """One tree or None per drafter (None for all: ``part_trees`` None); ValueError naming a list of the wrong
    length, a value that is not a tree, a dynamic tree for a drafter that grows none, or a tree deeper than its
    drafter fills."""
    if part_trees is None:
        return [None] * len(drafters)
    part_trees = list(part_trees)
    if len(part_trees) != len(drafters):
        raise ValueError(f"part_trees needs one entry per drafter ({len(drafters)}: None for the step's tree), got "
                         f"{len(part_trees)}")
    for d, tree in zip(drafters, part_trees, strict=True):
        name = type(d).__name__
        if tree is not None and not isinstance(tree, (Tree, DynamicTree)):
            raise ValueError(f"part_trees: {name}'s tree must be a Tree, a DynamicTree or None, got {tree!r}")
        if isinstance(tree, DynamicTree) and not d.grows_dynamic_trees:
            raise ValueError(f"part_trees: {name} grows no dynamic tree; give it a static Tree")
        if tree is not None and d.max_tree_depth is not None and tree.depth > d.max_tree_depth:
            raise ValueError(f"part_trees: {name} fills trees of depth <= {d.max_tree_depth}, got depth {tree.depth}")
    return part_trees


def members(drafters: list[Drafter], combined: Drafter, inside: tuple[int, ...] = ()) -> list[Drafter]:
    """Every drafter in ``combined``'s ``drafters``, nested combinations opened; a drafter in it twice (directly or
    inside a nested Combined: torch failed on a reshape later) or a combination inside itself (a RecursionError)
    is refused by name."""
    inside, out = (*inside, id(combined)), []
    for d in drafters:
        if id(d) in inside:
            raise ValueError(f"{d!r} contains itself: a Combined cannot be one of its own drafters")
        out += members(d.drafters, d, inside) if isinstance(d, Combined) else [d]
    twice = next((d for i, d in enumerate(out) if any(d is e for e in out[:i])), None)
    if twice is not None:
        raise ValueError(f"Combined needs distinct drafters, nested combinations included: {type(twice).__name__} "
                         "is in it twice, and one drafter object holds one generation's state")
    return out


class Combined(Drafter):
    per_row = ("_maps",)  # its own; each drafter selects its rows itself

    def __init__(self, drafters: list[Drafter], *, mode: str = "union", nodes: int | None = None, min_nodes: int = 1,
                 part_trees: list[Tree | DynamicTree | None] | None = None):
        drafters = list(drafters)
        if len(drafters) < 2 or not all(isinstance(d, Drafter) for d in drafters):
            raise ValueError(f"Combined needs two or more treespec Drafters, got {drafters!r}")
        for d in drafters:
            if d.candidates != "topk":
                raise ValueError(f"Combined merges fixed-rank candidates; {type(d).__name__} samples them "
                                 f"(candidates={d.candidates!r}): make it with candidates='topk'")
        members(drafters, self)
        check_settings(mode, nodes, min_nodes)
        self.drafters, self.mode, self.nodes, self.min_nodes = drafters, mode, nodes, min_nodes
        self.part_trees = check_part_trees(drafters, part_trees)
        on_step_tree = [d for d, own in zip(drafters, self.part_trees, strict=True) if own is None]  # the step's
        self.needs_features = any(d.needs_features for d in drafters)
        layers, self._blocks = feature_columns(drafters)
        if self.needs_features:
            self.feature_layers = layers
        self.grows_dynamic_trees = all(d.grows_dynamic_trees for d in on_step_tree)
        self.observes_logits = any(d.observes_logits for d in drafters)
        self.remembers_across_calls = any(d.remembers_across_calls for d in drafters)
        limits = [d.max_tree_depth for d in on_step_tree if d.max_tree_depth is not None]
        self.max_tree_depth = min(limits) if limits else None
        # the first drafter's default tree that every drafter can fill (a dynamic one only if all grow them)
        fits = [d.default_tree for d in on_step_tree if (isinstance(d.default_tree, Tree) or self.grows_dynamic_trees)
                and (self.max_tree_depth is None or d.default_tree.depth <= self.max_tree_depth)]
        self.default_tree = fits[0] if fits else drafters[0].default_tree
        positions = [d.max_positions for d in drafters if d.max_positions is not None]
        self.max_positions = min(positions) if positions else None
        self._maps: list[list[dict[int, int]]] = []  # per row, per drafter: merged node → its node

    def __repr__(self) -> str:
        return f"Combined([{', '.join(type(d).__name__ for d in self.drafters)}], mode={self.mode!r})"

    def _features(self, k: int, features: torch.Tensor | None) -> torch.Tensor | None:
        """Drafter ``k``'s columns of the combination's ``features`` [..., L·h] (None: it takes none)."""
        return columns_of(features, self._blocks[k], len(self.feature_layers)) if self.needs_features else None

    # -- what the loop calls, handed on to every drafter -----------------------------------------------------------
    def check_target(self, target) -> None:
        members(self.drafters, self)  # again: its list may have been changed since
        for d in self.drafters:
            d.check_target(target)

    def check_batch(self, batch_size: int) -> None:
        for d in self.drafters:
            d.check_batch(batch_size)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()
        self._maps = []

    def compile_steps(self, options, capacity: int) -> None:
        for d in self.drafters:
            d.compile_steps(options, capacity)

    def prefill(self, input_ids, features, attention_mask=None) -> None:
        for k, d in enumerate(self.drafters):
            d.prefill(input_ids, self._features(k, features), attention_mask)

    def observe_pass(self, tokens, trees, logits) -> None:
        for d in self.drafters:
            if d.observes_logits:
                d.observe_pass(tokens, trees, logits)

    def keep_rows(self, rows: torch.Tensor) -> None:
        for d in self.drafters:
            d.keep_rows(rows)
        super().keep_rows(rows)

    def propose(self, committed: Committed, feature, tree: Tree | DynamicTree, sampling: Sampling,
                generator=None) -> Proposals:
        batch = len(committed.lengths)
        each: list[Proposals | None] = []  # None: not asked this step (module docstring)
        for k, d in enumerate(self.drafters):
            if self.mode == "fallback" and d.proposes_on_demand and each and self._all_strong(each, batch):
                each.append(None)
            else:
                own = self.part_trees[k]  # never deeper than the step's: the loop cuts it where rows end
                own = tree if own is None else own if own.depth <= tree.depth else own.truncate(tree.depth)
                each.append(d.propose(committed, self._features(k, feature), own, sampling, generator))
        # union compares tokens on the host: each drafter's batch read once (a model-free one's are host tensors)
        drafted = [p.tokens.tolist() for p in each] if self.mode == "union" else None
        rows, self._maps = [], []
        for b in range(batch):
            proposals = [p.row(b) if p is not None else None for p in each]
            budget = self.nodes if self.nodes is not None else sum(len(p.tree) for p in proposals if p is not None)
            if drafted is not None:
                merged, maps = merge(proposals, budget, [t[b][: len(p.tree)] for t, p in zip(drafted, proposals,
                                                                                             strict=True)])
            else:  # the first strong proposal, else the largest; the others see none of it accepted
                asked = [i for i, p in enumerate(proposals) if p is not None]
                strong = [i for i in asked if len(proposals[i].tree) >= max(1, self.min_nodes)]
                pick = strong[0] if strong else max(asked, key=lambda i: len(proposals[i].tree))
                merged = within(proposals[pick], budget, committed.tokens.device)
                maps = [{i: i for i in range(merged.tree.num_nodes)} if k == pick else {0: 0}
                        for k in range(len(proposals))]
            rows.append(merged)
            self._maps.append([{m: i for i, m in mapped.items()} for mapped in maps])  # merged node → its node
        return Proposals.stack(rows)

    def _all_strong(self, each: list[Proposals | None], batch: int) -> bool:
        """Whether every row has a strong proposal (``min_nodes`` candidates) among ``each`` (host-side trees)."""
        return all(any(p is not None and len(p.trees[b]) >= max(1, self.min_nodes) for p in each)
                   for b in range(batch))

    def accept(self, paths: list[torch.Tensor], features) -> None:
        for k, d in enumerate(self.drafters):
            own = []
            for b, path in enumerate(paths):
                back, mine = self._maps[b][k], []
                for node in path.tolist():  # its nodes (a prefix of the path), then the tokens it did not propose
                    mine.append(back.get(node, NOT_PROPOSED) if not mine or mine[-1] != NOT_PROPOSED else NOT_PROPOSED)
                own.append(torch.tensor(mine, dtype=torch.long))
            d.accept(own, self._features(k, features))


def within(proposal: Proposal, budget: int, device: torch.device) -> Proposal:
    """``proposal``'s first ``budget`` candidates (breadth-first: parents before children, ranks in order), on
    ``device`` (the target's: rows that different drafters proposed are stacked there without a read back)."""
    tree, tokens = proposal.tree, proposal.tokens.to(device)
    if len(tree) <= budget:
        return Proposal(tree, tokens)
    return Proposal(Tree(tree.paths[:budget]), tokens[:budget])
