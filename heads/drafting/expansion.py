"""Depth-by-depth tree expansion, shared by the drafters that run a causal model over their own KV cache
(``DraftModel``, ``Eagle``).

One ``propose`` is one forward over the committed tokens the drafter has not seen yet (ending with the
root), whose last output gives the root's children, then one forward per depth over the nodes chosen
to have children. Each expanded node attends to the cached context, its expanded ancestors and itself
(inside its window on a sliding-window layer: ``treespec.visibility.attention_masks``) at position root + depth,
so its output equals a sequential decode of its path (SpecInfer, Miao et al. 2024). Children are chosen in
one of two ways:

* a static ``Tree``: node i's children are the top-k ranks its tree paths name (deterministic), or
  i.i.d. samples from the draft distribution (``candidates="sample"`` at temperature > 0; ``q_draft``
  is returned for the walker's multi-candidate rejection rule), or distinct samples drawn without
  replacement (``candidates="without_replacement"``: Gumbel-top-k, verified by recursive rejection
  sampling, Jeon et al. 2024);
* a ``DynamicTree`` (EAGLE-2, Li et al. 2024b): at each depth the ``top_k`` newest nodes with the highest
  cumulative draft log-probability are expanded, each proposing its ``top_k`` likeliest children; the best
  ``total_tokens`` nodes are then kept as a connected Tree whose ranks follow draft probability, so the walker
  tries siblings in that order (deterministic candidates). Grown on the device (heads/drafting/grow_dynamic.py).

Nothing is read back to the host while a static tree grows: candidates stay on the device, and what the masks
and positions need (which node sees which) is the tree's shape, known beforehand (docs/design.md, "Host reads
per step"). A dynamic tree's shape depends on the draft's scores: it is read back once, after the last depth.

``accept`` compacts the drafter's cache to the committed sequence: expanded nodes on the accepted path
stay cached when their keys/values are what a sequential decode would hold (``keeps_expanded_path``),
everything else is dropped (treespec/cache.py).

**Recurrent drafts** (a hybrid draft model: gated delta nets, Mamba-2, short convolutions beside attention) cannot
take a flattened depth: each frontier node is then one batch row of the drafter's cache, gathered from its
parent's row, fed one token per row with no mask (``treespec.recurrent.DraftRows``); ``accept`` keeps the deepest
accepted node's row when the last pass fed it, else restores the root's state, and the accepted tokens are fed
again with the next ``_start``. One prompt at a time.

**Batches.** Every forward runs over all rows at once: the committed tokens each row has not seen yet,
right-padded to the longest, then one [b, F] forward per depth (F frontier nodes per row: the static tree's,
or ``top_k`` per row for a dynamic tree, each row growing its own with the same node budget). The drafter's
cache lays its rows out as the target's does (a ``RowSlots``: treespec/rows.py), so padding and the holes
of rows that kept fewer entries are masked, and each row's positions are its own.
"""

from __future__ import annotations

import torch

from treespec.cache import PreallocatedLayer, SlidingWindowLayer
from treespec.drafter import CANDIDATE_MODES, SAMPLED_CANDIDATES, Drafter, Proposals, own_nodes
from treespec.dynamic_tree import DynamicTree
from treespec.heads.drafting.grow_dynamic import grow_dynamic
from treespec.recurrent import DraftRows, is_recurrent
from treespec.rows import RowSlots
from treespec.sampling import Sampling, probs, sample, sample_without_replacement, top_k
from treespec.static_pass import StaticPass
from treespec.tree import Tree
from treespec.visibility import attention_masks, causal_rows, slots_mask


class GrownNodes:
    """The nodes of one step's tree as the drafter grows it: 0 is the root, every parent precedes its
    children. ``lineage[i]`` is the set of node i and its ancestors (what node i may attend to)."""

    def __init__(self):
        self.parents, self.depths, self.tokens = [-1], [0], [0]
        self.lineage: list[frozenset[int]] = [frozenset({0})]

    @classmethod
    def of_tree(cls, tree: Tree) -> GrownNodes:
        """All nodes of a static tree, tokens still unknown (filled depth by depth)."""
        nodes = cls()
        for i in range(1, tree.num_nodes):
            nodes.add(tree.parent_list[i], 0)
        return nodes

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.tokens.append(token)
        self.lineage.append(self.lineage[parent] | {len(self.tokens) - 1})
        return len(self.tokens) - 1


class ExpandingDrafter(Drafter):
    """Base class. A subclass sets ``self.model`` (with ``.device`` and ``.dtype``) and implements
    ``_new_cache``, ``_start`` and ``_forward_nodes``; this class grows the tree and keeps its cache."""

    grows_dynamic_trees = True
    per_row = ("slots", "_grown_of")  # (slots None: nothing cached yet, a row finished at its first token)

    #: keep the accepted path's expanded entries in the cache; False when they were computed from inputs
    #: the committed sequence must not keep (EAGLE refeeds accepted tokens with the target's features)
    keeps_expanded_path: bool = True

    def __init__(self, model, default_tree, candidates: str = "topk"):
        """candidates: "topk" (deterministic ranks), "sample" (i.i.d. from q_draft when temperature > 0) or
        "without_replacement" (distinct siblings drawn one after another from q_draft)."""
        if candidates not in CANDIDATE_MODES:
            raise ValueError(f"candidates must be one of {CANDIDATE_MODES}, got {candidates!r}")
        self.model = model.eval()
        self.default_tree = default_tree
        self.candidates = candidates
        self.reset()

    _static: StaticPass | None = None  # each depth's network as a compiled static pass (compile_steps), or None

    def reset(self) -> None:
        self.cache = self._new_cache()
        # a recurrent draft's cache: one row per frontier node (treespec/recurrent.py); None: tree masks
        self._path_rows = DraftRows(self.cache) if any(is_recurrent(layer) for layer in self.cache.layers) else None
        self.slots: RowSlots | None = None  # the cache's rows (committed entries); made for the first batch
        self._expanded: list[list[int]] = []  # grown nodes whose keys/values follow them, in cache order: one
        #                                       list shared by every row (static tree) or one per row
        self._grown_of: list[list[int]] = []  # per row: grown node of each node of the last proposal's tree
        self._grown_count = 0  # grown node ids this step are below it (a host bound for buffers sized by them)
        self._shapes: dict[Tree, GrownNodes] = {}  # each static tree's topology, made once per tree
        self._plans: dict = {}  # (tree, depth) → its expansion's masks' parts and node ids, on the device

    def check_batch(self, batch_size: int) -> None:
        if batch_size > 1 and self._path_rows is not None:
            raise ValueError(f"{type(self).__name__}'s model has recurrent layers, whose tree expansion takes one "
                             "batch row per tree node (treespec/recurrent.py): it drafts for one prompt at a time")
        if batch_size > 1 and any(isinstance(layer, SlidingWindowLayer) for layer in self.cache.layers):
            raise ValueError(f"{type(self).__name__}'s model has sliding-window layers, whose windows count slots: "
                             "it drafts for one prompt at a time")

    def compile_steps(self, options: dict | None, capacity: int) -> None:
        # a cache of preallocated full-attention layers only (not a recurrent or sliding-window draft's)
        static = options is not None and all(type(layer) is PreallocatedLayer for layer in self.cache.layers)
        self._static = StaticPass(type(self)._depth, options, self, capacity=capacity) if static else None

    def _network(self, attention_mask, position_ids, *inputs):
        """``_depth`` over the drafter's cache: as a static pass when compiled (not a recurrent draft's rows, which
        come without a mask), else eagerly."""
        if self._static is None or attention_mask is None:
            return self._depth(self.cache, attention_mask, position_ids, *inputs)
        return self._static(self.cache, attention_mask, position_ids, *inputs)

    # -- what a subclass provides ------------------------------------------------------------------
    def _new_cache(self):
        raise NotImplementedError

    def _start(self, committed, feature: torch.Tensor | None) -> torch.Tensor:
        """Feed each row's committed tokens not cached yet (its root last; ``_committed_inputs``), append them
        to ``slots`` and return the draft logits at each root [b, V]."""
        raise NotImplementedError

    def _fill_for_timing(self, tokens: torch.Tensor) -> None:
        """Feed ``tokens`` [1, m] (placeholders) as committed entries, and make node 0 expandable
        (``drafting_step``)."""
        raise NotImplementedError

    def _depth(self, cache, attention_mask, position_ids, *inputs):
        """The network over one depth's nodes after ``cache`` (the drafter's own, or a static pass's
        ``treespec.static_pass.StaticKV``) → its outputs (tensors); ``_forward_nodes`` calls it through
        ``_network``, which compiles it with ``compile_steps``. It reads nothing of the host's bookkeeping (a
        compiled graph would be guarded on it)."""
        raise NotImplementedError

    def _forward_nodes(self, tokens: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor,
                       attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One cached forward over grown ``nodes`` (tokens [b, F]; node ids and their ``parents`` [b or 1, F])
        with the mask of ``treespec.visibility.attention_masks`` or ``slots_mask`` (float [b or 1, 1, F,
        slots + K]; a dict of them keyed by layer type when sliding and full layers differ) and positions
        [b or 1, F] → draft logits at those nodes [b, F, V]. A recurrent draft's rows (``_expand_rows``): tokens,
        nodes and parents [F, 1], no mask and no positions (causal after the cache) → [F, 1, V]."""
        raise NotImplementedError

    # -- the batch's rows on the cache -------------------------------------------------------------
    def _rows(self, batch: int) -> RowSlots:
        """The cache's RowSlots, made for a batch of ``batch`` rows on the first call after ``reset``."""
        if self.slots is None:
            self.slots = RowSlots(batch, self.model.device, self.cache)
        return self.slots

    def _committed_inputs(self, counts: list[int]) -> dict:
        """The mask and positions of a forward feeding ``counts[b]`` committed tokens per row, right-padded to
        the longest, after the cache: none while the rows are alike (causal after the cache, at the positions
        that follow it), else each row's causal mask over its valid slots and its own positions. The caller
        appends the fed slots (``slots.append``) after the forward."""
        width = max(counts)
        if not self.slots.ragged and all(c == width for c in counts):
            return {}
        allowed = causal_rows(counts, width, self.model.device)  # [b, m, m]
        return {"attention_mask": slots_mask(self.slots, allowed, dtype=self.model.dtype),
                "position_ids": self.slots.positions(torch.arange(width))}

    # -- the expansion ---------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, committed, feature, tree, sampling: Sampling, generator=None) -> Proposals:
        logits = self._start(committed, feature)[:, None]  # [b, 1, V]: the root is the only frontier node
        if self._path_rows is not None:
            self._path_rows.start()
        if isinstance(tree, DynamicTree):
            if self.candidates in SAMPLED_CANDIDATES and not sampling.greedy:
                raise ValueError(f"{tree!r} grows deterministic top-k candidates; candidates={self.candidates!r} "
                                 "needs a static Tree")
            return grow_dynamic(self, logits, tree)
        return self._grow_static(logits, tree, sampling, generator)

    def _expand(self, shape: GrownNodes, frontier: list[int], tokens: torch.Tensor, key) -> torch.Tensor:
        """Draft logits [b, F, V] at the ``frontier`` nodes of a static tree's ``shape``, whose keys/values join the
        cache after the nodes expanded before them; each sees the row's committed entries, its expanded ancestors
        and itself. ``tokens`` [b, N]: every node's token in each row, on the device. What depends on the
        shape alone (who sees whom, depths, node ids) is made once per ``key`` (tree, depth) and kept on the
        device."""
        if self._path_rows is not None:
            return self._expand_rows(frontier, [shape.parents[f] for f in frontier], tokens[:, frontier])
        device = self.model.device
        kv_nodes = self._expanded[0] + frontier
        if key not in self._plans:
            # [F, K]: which expanded node (key) each frontier node (query) may see: itself and its ancestors
            allowed = torch.tensor([[k in shape.lineage[f] for k in kv_nodes] for f in frontier], device=device)
            offsets = torch.tensor([shape.depths[k] - 1 for k in kv_nodes], device=device)  # [K]: depth − 1
            self._plans[key] = (allowed, offsets, torch.tensor([frontier], device=device),
                                torch.tensor([[shape.parents[f] for f in frontier]], device=device))
        allowed, offsets, nodes, parents = self._plans[key]
        positions = self.slots.positions(offsets)  # [b or 1, K]: each row's root position + depth
        if not self.slots.ragged:  # rows alike: one mask (windows honoured)
            mask = attention_masks(self.cache, allowed, self.slots.length, positions[0], dtype=self.model.dtype,
                                   device=device)
        else:
            mask = slots_mask(self.slots, allowed[None], dtype=self.model.dtype)
        logits = self._forward_nodes(tokens.index_select(1, nodes[0]), nodes, parents, mask,
                                     positions[:, -len(frontier) :])
        self._expanded = [kv_nodes]
        return logits

    def _expand_rows(self, frontier: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """``_expand`` for a recurrent draft (one prompt): frontier node j (its parent ``parents[j]``) is cache row j,
        gathered from its parent's row, fed its one token (``tokens`` [1, F]) → draft logits [1, F, V]. Every row
        holds the same number of entries (the past and its path), so the model's own causal positions and masks
        are right."""
        device = self.model.device
        self._path_rows.gather(parents)
        self._grown_count = max(self._grown_count, 1 + max(frontier))
        logits = self._forward_nodes(tokens[0].to(device)[:, None], torch.tensor(frontier, device=device)[:, None],
                                     torch.tensor(parents, device=device)[:, None], None, None)  # [F, 1, V]
        self._path_rows.fed(frontier)
        return logits.transpose(0, 1)

    def _grow_static(self, logits, tree: Tree, sampling: Sampling, generator) -> Proposals:
        """Every row grows ``tree``'s shape, with its own tokens (one forward per depth for all rows), on the
        device: the tokens of depth d are a slice of [b, N] (nodes are numbered depth by depth)."""
        draw = self.candidates in SAMPLED_CANDIDATES and not sampling.greedy
        distinct = draw and self.candidates == "without_replacement"  # siblings drawn without replacement
        batch, vocab = logits.shape[0], logits.shape[-1]
        if tree not in self._shapes:
            self._shapes[tree] = GrownNodes.of_tree(tree)
        shape = self._shapes[tree]  # every row's topology
        tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.long, device=logits.device)  # [b, N]
        q_draft = torch.zeros(batch, tree.num_nodes, vocab, device=logits.device) if draw else None  # [b, N, V]
        frontier = [0]
        self._expanded = [[]]
        self._grown_count = tree.num_nodes  # (``_forward_nodes`` sizes buffers by it)
        for depth in range(1, tree.depth + 1):
            q = probs(logits, sampling) if draw else None  # [b, F, V]: draft distribution at each frontier node
            picks = []
            for j, node in enumerate(frontier):
                kids = tree.children[node]
                if not kids:
                    continue
                if draw:
                    q_draft[:, node] = q[:, j]
                    picks.append(sample_without_replacement(q[:, j], len(kids), generator) if distinct else
                                 sample(q[:, j, None].expand(batch, len(kids), vocab), generator, check=False))
                else:  # the rank-r child is the r-th most likely draft token
                    ranks = [tree.rank_list[kid] for kid in kids]
                    top = top_k(logits[:, j], max(ranks) + 1)  # [b, k]
                    picks.append(top if ranks == list(range(len(ranks))) else top[:, ranks])
            # the children of the frontier, in its order, are depth `depth`'s nodes in node order
            level = tree.levels[depth]
            tokens[:, level[0] : level[-1] + 1] = torch.cat(picks, dim=1)
            if depth == tree.depth:
                break
            frontier = [i for i in level if tree.children[i]]  # cached per tree: no tensor ops
            if not frontier:
                break
            logits = self._expand(shape, frontier, tokens, (tree, depth))
        self._grown_of = [list(range(tree.num_nodes))] * batch
        return Proposals.shared(tree, tokens[:, 1:], q_draft, without_replacement=distinct)

    @torch.no_grad()
    def drafting_step(self, past_len: int = 256, n_tokens: int = 4, batch: int = 1):
        """One expansion depth as the drafter drafts (lean or not): ``n_tokens`` frontier nodes per row, children
        of the root, through its model and head after ``past_len`` cached placeholder entries, attending to all
        of them, for ``batch`` rows. Each call leaves the cache as it found it; ``reset()`` when done with it."""
        device = self.model.device
        self.reset()
        self._rows(batch)
        self._fill_for_timing(torch.zeros(batch, past_len, dtype=torch.long, device=device))
        self.slots.append(past_len)
        if self._path_rows is not None:  # a recurrent draft: n_tokens rows of the root, its state restored after
            self.check_batch(batch)
            self._path_rows.start()
            frontier, placeholders = list(range(1, n_tokens + 1)), torch.zeros(1, n_tokens, dtype=torch.long)

            @torch.no_grad()
            def rows_depth():
                self._expand_rows(frontier, [0] * n_tokens, placeholders)
                self._path_rows.keep([])

            return rows_depth
        tokens = torch.zeros(batch, n_tokens, dtype=torch.long, device=device)  # [b, F]
        mask = torch.zeros(1, 1, n_tokens, past_len + n_tokens, dtype=self.model.dtype, device=device)  # sees all
        positions = torch.arange(past_len, past_len + n_tokens, device=device)[None]  # [1, F]
        nodes = torch.arange(1, n_tokens + 1, device=device)[None]
        parents = torch.zeros(1, n_tokens, dtype=torch.long, device=device)
        self._grown_count = n_tokens + 1

        @torch.no_grad()
        def depth():
            self._forward_nodes(tokens, nodes, parents, mask, positions)
            self.cache.crop(-n_tokens)  # transformers 5: a negative count removes the newest entries

        return depth

    def accept(self, paths: list[torch.Tensor], features) -> None:
        # Expanded nodes on a row's accepted path form a prefix of it (nodes are expanded depth by depth), in
        # cache order; path tokens not kept here (another drafter's, in a Combined, too) are fed again by the next
        # _start.
        if self._path_rows is not None:  # one row: its accepted path's deepest fed node, or the root's state
            path = [self._grown_of[0][i] for i in own_nodes(paths[0].tolist())] if self.keeps_expanded_path else []
            self.slots.append(self._path_rows.keep(path))
            return
        keeps = [[] for _ in paths]
        if self.keeps_expanded_path:
            for b, path in enumerate(paths):
                on_path = {self._grown_of[b][i] for i in own_nodes(path.tolist())}
                expanded = self._expanded[b if len(self._expanded) > 1 else 0]
                keeps[b] = [j for j, node in enumerate(expanded) if node in on_path]
        self.slots.keep(keeps)
        self._expanded = []
