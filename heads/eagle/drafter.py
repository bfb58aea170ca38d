"""The EAGLE drafter (Li et al. 2024; EAGLE-2, Li et al. 2024b) and its kind: drafting with an EagleModel
(heads/eagle/network.py: what it computes, its variants and folder), autoregressive over its own features,
expanding a static or a dynamic tree (heads/drafting/expansion.py).

Between steps the drafter's cache holds one entry per committed token from the second (the first has
no feature before it) up to the previous step's root; the target features of the tokens accepted since
arrive in ``accept`` and are fed, with the new root and its feature, at the start of the next
``propose``. Tree nodes it expanded were fed drafter features, so none of them is kept (EAGLE refeeds
the accepted path with the target's).
"""

from __future__ import annotations

import torch

from treespec.cache import TreeCache
from treespec.dynamic_tree import DynamicTree
from treespec.heads.drafting.expansion import ExpandingDrafter
from treespec.heads.drafting.lean import lean_decoder
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.heads.eagle.network import EagleModel
from treespec.heads.training.accuracy import RankHits
from treespec.heads.training.target_states import target_hidden
from treespec.heads.training.unroll import unrolled
from treespec.rows import gather_last, right_aligned
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree


class Eagle(ExpandingDrafter):
    """The drafter: autoregressive over its own features, expanding a static or dynamic tree."""

    needs_features = True
    keeps_expanded_path = False  # expanded nodes were fed the drafter's features, not the target's
    per_row = (*ExpandingDrafter.per_row, "_pending", "_pending_counts")

    def __init__(self, model: EagleModel, *, default_tree: Tree | DynamicTree | None = None,
                 candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True):
        """default_tree: EAGLE-2's dynamic tree, sized for CPUs, where a target pass over 16 tree tokens costs
        little more than over one (the paper's GPU default is DynamicTree(60, 7, 10)). candidates: as for DraftModel.
        draft_vocab: project onto these target ids only (FR-Spec, heads/drafting/vocab.py; still lossless).
        lean: draft without the base model's per-call work (heads/drafting/lean.py); False: the plain forward."""
        super().__init__(model, default_tree if default_tree is not None else DynamicTree(16, 5, 4), candidates)
        self.feature_layers = model.feature_layers
        if draft_vocab is not None and model.draft_vocab is not None:
            raise ValueError("this EAGLE-3 drafter has its own draft vocabulary (d2t/t2d); FR-Spec is for "
                             "full-vocabulary heads")
        # an FR-Spec vocabulary given here replaces one the drafter was trained over (model.head's)
        self._logits = ReducedHead(model.lm_head, draft_vocab, lean=lean) if draft_vocab is not None else \
            model.head(lean)
        self._decoder = lean_decoder(model.decoder, model.layer_config) if lean and model.decoder is not None else None

    def _run(self, tokens, features, attention_mask=None, position_ids=None, cache=None) -> torch.Tensor:
        """The drafter over ``tokens`` [b, n] paired with ``features`` [b, n, h], after its cache → g [b, n, h];
        without a mask (committed tokens, rows alike) causal after the cache, at positions following it.
        ``cache``: the drafter's own, or a static pass's (treespec/static_pass.py), which comes with positions."""
        cache = self.cache if cache is None else cache
        if self._decoder is None:
            return self.model(tokens, features, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
        x = self.model.decoder_input(tokens, features)
        past = self.slots.length if position_ids is None else None  # (read only when the positions follow it)
        return self._decoder(x, cache, past, position_ids, attention_mask)

    def check_target(self, target) -> None:
        self.model.check_fits(target)

    def reset(self) -> None:
        super().reset()
        self._pending: torch.Tensor | None = None  # [b, m, h]: drafter features of committed entries not fed yet
        self._pending_counts: list[int] = []  # row b's are the first _pending_counts[b]
        self._outputs: torch.Tensor | None = None  # [b, nodes, h]: drafter output g at each grown node

    def _new_cache(self):
        return TreeCache(self.model.layer_config)  # preallocated (treespec/cache.py): no copy per depth

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.fuse(features.to(self.model.device, self.model.dtype))

    @torch.no_grad()
    def prefill(self, input_ids, features, attention_mask=None) -> None:
        # prompt token j + 1 pairs with feature j; the first token has none, the last feature pairs with the root
        lengths = [input_ids.shape[1]] * input_ids.shape[0] if attention_mask is None else \
            attention_mask.sum(-1).tolist()
        self._pending = self._fuse(right_aligned(features, lengths)[:, : max(lengths) - 1])  # [b, m, h]
        self._pending_counts = [n - 1 for n in lengths]

    def _start(self, committed, feature):
        slots = self._rows(len(committed.lengths))
        # entry j pairs token j + 1 with the feature at j: a row's entries follow its cached ones, its root last
        tokens, counts = committed.tails([n + 1 for n in slots.counts])  # [b, m]
        if counts != [n + 1 for n in self._pending_counts]:
            raise RuntimeError(f"EAGLE drafter out of sync: {counts} committed tokens to feed but "
                               f"{[n + 1 for n in self._pending_counts]} target features (was accept() called after "
                               "every propose()?)")
        root = self._fuse(feature[:, None])  # [b, 1, h]: pairs with each root
        pending = self._pending[:, : max(self._pending_counts)]  # (the longest row may have left the batch)
        if all(n == pending.shape[1] for n in self._pending_counts):
            features = torch.cat([pending, root], dim=1)  # [b, m, h]
        else:  # each row's root feature right after its own pending ones
            features = torch.cat([pending, torch.zeros_like(root)], dim=1)
            features[torch.arange(len(counts)), torch.tensor(self._pending_counts)] = root[:, 0]
        g = self._run(tokens.to(self.model.device), features, **self._committed_inputs(counts))  # [b, m, h]
        slots.append(tokens.shape[1], counts)
        self._pending, self._pending_counts = None, []
        g_root = gather_last(g, counts)  # [b, h]
        self._keep_outputs(g_root[:, None])  # node 0, the root
        return self._logits(g_root)  # [b, V]

    def _keep_outputs(self, root: torch.Tensor) -> None:
        """A step's node outputs start with the roots' [b, 1, h], in a buffer that grows by doubling."""
        self._outputs = root.new_empty(root.shape[0], 64, root.shape[-1])  # [b, nodes, h]
        self._outputs[:, :1] = root
        self._rows_index = torch.arange(root.shape[0], device=root.device)[:, None]  # [b, 1]

    def _depth(self, cache, attention_mask, position_ids, tokens, features):
        g = self._run(tokens, features, attention_mask, position_ids, cache)  # [b, F, h]
        return g, self._logits(g)  # and [b, F, V]

    def _forward_nodes(self, tokens, nodes, parents, attention_mask, position_ids):
        batch = tokens.shape[0]
        features = self._outputs[self._rows_index, parents]  # [b, F, h]: each parent's output
        g, logits = self._network(attention_mask, position_ids, tokens, features)  # [b, F, h], [b, F, V]
        grown = self._grown_count  # node ids this step stay below it (known on the host: no read of ``nodes``)
        if self._outputs.shape[1] < grown:  # room for this depth's nodes (grown node ids only increase)
            more = self._outputs.new_empty(batch, max(grown, 2 * self._outputs.shape[1]), g.shape[-1])
            more[:, : self._outputs.shape[1]] = self._outputs
            self._outputs = more
        self._outputs[self._rows_index, nodes] = g
        return logits

    def _fill_for_timing(self, tokens) -> None:
        h = self.model.fc.out_features
        features = torch.zeros(*tokens.shape, h, dtype=self.model.dtype, device=self.model.device)
        self._keep_outputs(self._run(tokens, features)[:, -1:])

    @torch.no_grad()
    def accept(self, paths, features) -> None:
        super().accept(paths, features)
        # accepted node i pairs with the feature at its parent: root, then nodes 1..k-1; the feature at the
        # last accepted node pairs with the next root and arrives with it in propose(). A path counts every accepted
        # token, those another drafter of a Combined proposed too (treespec/drafter.py): the next _start feeds them
        self._pending_counts = [len(path) for path in paths]
        self._pending = self._fuse(features[:, : max(self._pending_counts)])
        self._outputs = None


@torch.no_grad()
def rank_accuracy(target, model: EagleModel, windows: torch.Tensor, *, depth: int = 8, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY, first_root: int = 0) -> list[list[float]]:
    """acc[d][r] (heads/training/accuracy.py) drafting from the root over the drafter's own features along the
    window's tokens (what an accepted tree path feeds it), on held-out ``windows`` [n, S], from root
    ``first_root`` on: heads/training/unroll.py."""
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    for batch in windows.split(batch_size):
        features, last = target_hidden(target, batch, model.feature_layers)  # [b, S, L·h], [b, S, h]
        target_logits = model.logits(last[:, 1:]).float()  # [b, n, V]: the target's token after entry j's
        n = target_logits.shape[1]
        for k, g in unrolled(model, batch, model.fuse(features[:, :-1]), depth - 1, by_root=False):
            # entry j at step k: drafted from entry j − k, which guesses token j − k + 2 at depth 1 (root j − k + 1)
            valid = torch.arange(n, device=g.device) >= k + max(0, first_root - 1)
            proposed = model.proposal_logits(g[:, valid])  # as drafting sees them (a training vocabulary's rows)
            counter.add(k, proposed.topk(top_k, dim=-1).indices, target_logits[:, valid])
    model.train(was_training)
    return counter.table()
