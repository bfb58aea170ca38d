"""Tree verification over recurrent state: hybrid targets (gated delta nets, Mamba-2, short convolutions).

An attention layer verifies a whole tree in one pass through the tree mask, and ``cache.keep_tree_path``
compacts it to the accepted path afterwards. A recurrent layer (Qwen3.5 / Qwen3-Next / OLMo-hybrid gated
delta rule, Nemotron-H / Granite-4 / Bamba / Falcon-H1 Mamba-2 scan, LFM2's short convolution) has no mask:
fed a flattened tree it would integrate every sibling into one state. Each node's state must come from its
parent's, and after acceptance each layer must hold the state at the last accepted node. transformers'
mixers return only a sequence's final state, and its cache layers (``LinearAttentionCacheLayerMixin``) keep one
conv state and one recurrent state per layer.

**The design: root-to-leaf paths as batch rows, snapshot, restore, replay** (design (b) of the issue, over the
whole stock model rather than layer by layer, so that it needs nothing of a layer's internals):

1. ``snapshot``: clone every recurrent and convolution state and remember the attention layers' length
   (``past_len``: the committed tokens but the root).
2. ``tree_pass`` (``TargetRows``): each leaf's path (root, ..., leaf) becomes one batch row, shorter paths
   right-padded by repeating their leaf; the cache is repeated to R rows (``index_select`` on the batch axis of
   every layer, the same operation beam search uses) and the stock model runs ONE causal pass over the R × D
   tokens: attention layers see the past and the row's own path, recurrent layers scan the path from the
   snapshot state. Every node's logits (and hidden states) are those of its first row, at its depth: exactly
   what a sequential decode of its path gives. A chain is one row: an ordinary pass.
3. ``keep`` (after the walk): if the accepted path ends at a leaf whose row is not padded, that row's states
   ARE the state after the accepted path: keep row r of every layer, nothing recomputed (a fully accepted
   chain costs nothing more). Otherwise restore the snapshot (recurrent states back, attention layers cut to
   ``past_len``) and **replay** the root and the accepted nodes (1 + k tokens) in one causal pass, whose
   outputs are dropped.

The costs, in passes of the target: one pass over R × D tokens instead of N (a 2-chain pays nothing; a full
2-ary tree of depth 3 feeds 8 × 4 = 32 tokens for its 15 nodes), plus one replay pass of 1 + k tokens when the
walk stops before a leaf; the attention layers' past is copied to R rows per pass (its memory too). Per-node
states from a tree scan (design (c)) would avoid both, but need each layer type's recurrence; this one works
for every family transformers ships with these cache layers. ``scripts/architecture_matrix.py`` measures
each family's verification cost (tree pass ÷ one-token step); docs/hybrids.md has the numbers.

**Mixers that cannot continue a state over several tokens** (``ONE_TOKEN_AT_A_TIME``): Jamba's Mamba-1 mixer
in transformers starts its multi-token scan from a zero SSM state instead of the cached one, so a pass of
more than one token after a prefix is wrong (its own generate() only ever feeds one token at a time). Its
rows are fed one depth at a time: D passes of R tokens each, lossless but with no verification speedup.

**A hybrid drafter** (``DraftRows``) expands its tree the same way, one depth per pass: the cache holds one row per
node of the last depth expanded (after the root's pass: one row), and the pass over depth d's frontier gathers each
frontier node's row from its parent's (``select_rows``) and feeds one token per row, so every node's state and
attention past are its own path's and no mask is needed (a chain is one row, token by token). After the walk the
drafter's cache keeps the row of the deepest accepted node if the last pass fed it, else it is restored to the
root's snapshot and the accepted tokens are fed again with the next step's committed ones (in that pass: no
replay of its own).

A batch of several prompts is refused for these targets (one prompt at a time), and so are sliding-window
attention layers inside hybrid layers (``hybrid_sliding``), KV-shared layers and models without an attention
layer (``layer_types.check_rollback``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from treespec.tree import Tree

# cache layer types (treespec.compat.layer_types_and_kwargs) whose state this module rolls back
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid"})

# model types whose stock multi-token forward ignores the cached recurrent state (transformers 5.24), and why
ONE_TOKEN_AT_A_TIME = {
    "jamba": "JambaMambaMixer's multi-token scan starts from a zero SSM state, not the cached one",
}

_STATES = ("conv_states", "recurrent_states")


def is_recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def one_token_at_a_time(config) -> bool:
    """Whether ``config``'s mixers must be fed one token per pass after a prefix (``ONE_TOKEN_AT_A_TIME``)."""
    return config.get_text_config(decoder=True).model_type in ONE_TOKEN_AT_A_TIME


def steps(input_ids: torch.Tensor, one_token: bool) -> list[torch.Tensor]:
    """``input_ids`` [b, n] as the passes that feed it: one, or n of one token each."""
    return [input_ids[:, d : d + 1] for d in range(input_ids.shape[1])] if one_token else [input_ids]


def _each(value, fn):
    """``fn`` over a layer's per-state entries: a dict {state index: tensor or None} (transformers >= 5.9), or one
    tensor or None (5.8)."""
    if isinstance(value, dict):
        return {i: None if t is None else fn(t) for i, t in value.items()}
    return None if value is None else fn(value)


def _has_keys(layer) -> bool:
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.dim() == 4


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep the batch rows ``rows`` [R'] (repeats allowed) of every layer: attention keys and values, conv and
    recurrent states."""
    for layer in cache.layers:
        if is_recurrent(layer):
            for name in _STATES:
                setattr(layer, name, _each(getattr(layer, name), lambda t: t.index_select(0, rows.to(t.device))))
        if _has_keys(layer):
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))


class Snapshot:
    """The recurrent and convolution states of every layer, cloned, and the attention layers' length."""

    def __init__(self, cache):
        self.states = [{name: _each(getattr(layer, name), torch.clone) for name in _STATES}
                       | {"has_previous_state": _each(layer.has_previous_state, lambda flag: flag)}
                       if is_recurrent(layer) else None for layer in cache.layers]
        self.lengths = [layer.keys.shape[-2] if _has_keys(layer) else None for layer in cache.layers]

    def restore(self, cache) -> None:
        """Put every layer back as it was (one batch row): states from the snapshot, attention layers cut."""
        for layer, states, length in zip(cache.layers, self.states, self.lengths, strict=True):
            if states is not None:
                for name, value in states.items():
                    setattr(layer, name, value)
            if length is not None:
                layer.keys, layer.values = layer.keys[:1, :, :length], layer.values[:1, :, :length]


def path_rows(tree: Tree) -> tuple[torch.Tensor, list[int]]:
    """(LongTensor [R, D]: each leaf's path from the root, node indices, a shorter path right-padded by
    repeating its leaf; each row's real length). A chain is one row."""
    paths = [[0, *path] for path in tree.leaf_paths] or [[0]]
    width = max(len(path) for path in paths)
    rows = torch.tensor([path + path[-1:] * (width - len(path)) for path in paths], dtype=torch.long)
    return rows, [len(path) for path in paths]


class TargetRows:
    """A hybrid target's cache over the tree passes of one decoding run (one batch row): each pass runs the tree's
    root-to-leaf paths as rows, ``keep`` leaves the accepted path's state; see the module docstring.
    ``forward(input_ids [R, n]) → (logits [R, n, V], features [R, n, F] or None)`` runs the target over the
    cache; ``replay(input_ids [1, n])`` runs it without collecting anything."""

    def __init__(self, target, cache):
        self.cache = cache
        self.one_token = one_token_at_a_time(target.config)
        self.snapshot: Snapshot | None = None
        self.tokens: torch.Tensor | None = None  # [1, N]: the last pass's root and candidates
        self.rows: torch.Tensor | None = None
        self.lengths: list[int] = []
        self.tokens_fed = 0  # tokens fed to the target by verification and replay passes (for the cost columns)
        self.replays = 0

    def tree_pass(self, forward: Callable, tokens: torch.Tensor, tree: Tree):
        """tokens [1, N] (root + candidates of ``tree``) → (logits [1, N, V], features [1, N, F] or None)."""
        self.snapshot = Snapshot(self.cache)
        self.tokens = tokens
        self.rows, self.lengths = path_rows(tree)
        rows = self.rows.to(tokens.device)
        if len(rows) > 1:
            select_rows(self.cache, torch.zeros(len(rows), dtype=torch.long))
        inputs = tokens[0][rows]  # [R, D]
        outs = [forward(step) for step in steps(inputs, self.one_token)]  # one depth per pass: ONE_TOKEN_AT_A_TIME
        logits = torch.cat([o[0] for o in outs], dim=1)  # [R, D, V]
        features = None if outs[0][1] is None else torch.cat([o[1] for o in outs], dim=1)  # [R, D, F]
        self.tokens_fed += inputs.numel()
        # node i's outputs: its first row's, at its depth
        first_row = torch.full((tree.num_nodes,), -1, dtype=torch.long)
        for r in range(len(self.rows) - 1, -1, -1):
            first_row[self.rows[r, : self.lengths[r]]] = r
        r, d = first_row.to(logits.device), tree.depths.to(logits.device)
        return logits[r, d][None], None if features is None else features[r, d][None]

    def keep(self, replay: Callable, keep: list[int]) -> None:
        """Leave the cache holding the past, the root and the accepted nodes ``keep`` (tree-node offsets, root
        first) of the last verified tokens: keep a row that ends exactly there, else restore and replay."""
        last = keep[-1]
        for r, length in enumerate(self.lengths):
            if length == self.rows.shape[1] and self.rows[r, -1].item() == last:
                if len(self.lengths) > 1:
                    select_rows(self.cache, torch.tensor([r]))
                return
        self.snapshot.restore(self.cache)
        replayed = self.tokens[:, torch.tensor(keep, device=self.tokens.device)]  # [1, 1 + k]
        for step in steps(replayed, self.one_token):
            replay(step)
        self.tokens_fed += replayed.numel()
        self.replays += 1


class DraftRows:
    """A hybrid drafter's own cache while it expands a tree depth by depth, one prompt (module docstring).
    ``nodes``: the tree node each cache row holds the state after (the last depth fed)."""

    def __init__(self, cache):
        self.cache = cache
        self.snapshot: Snapshot | None = None
        self.nodes: list[int] = []

    def start(self) -> None:
        """After the pass that fed the root: one row, the root's state, remembered for ``keep``."""
        self.snapshot = Snapshot(self.cache)
        self.nodes = [0]

    def gather(self, parents: list[int]) -> None:
        """Before a pass over frontier nodes: each one's row starts from its parent's row (``parents``: nodes
        the last pass fed, or the root)."""
        rows = [self.nodes.index(p) for p in parents]
        if rows != list(range(len(self.nodes))):
            select_rows(self.cache, torch.tensor(rows, dtype=torch.long))

    def fed(self, frontier: list[int]) -> None:
        """After that pass: row j holds the state after ``frontier[j]``."""
        self.nodes = list(frontier)

    def keep(self, path: list[int]) -> int:
        """After the walk: the cache keeps the row of the deepest node of the accepted ``path`` (nodes in depth
        order, root excluded) if the last pass fed it, else it is restored to the root's state. Returns how many
        path nodes it then holds (their depth; 0 when restored), the rest to be fed again."""
        for depth in range(len(path), 0, -1):
            if path[depth - 1] in self.nodes:
                if len(self.nodes) > 1:
                    select_rows(self.cache, torch.tensor([self.nodes.index(path[depth - 1])]))
                self.nodes = [path[depth - 1]]
                return depth
        self.snapshot.restore(self.cache)
        self.nodes = [0]
        return 0
