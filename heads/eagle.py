"""The EAGLE drafter (Li et al. 2024; EAGLE-2, Li et al. 2024b) and its kind: drafting with an EagleModel
(heads/eagle_model.py: what it computes, its variants and folder), autoregressive over its own features,
expanding a static or a dynamic tree (heads/expansion.py).

Between steps the drafter's cache holds one entry per committed token from the second (the first has
no feature before it) up to the previous step's root; the target features of the tokens accepted since
arrive in ``accept`` and are fed, with the new root and its feature, at the start of the next
``propose``. Tree nodes it expanded were fed drafter features, so none of them is kept (EAGLE refeeds
the accepted path with the target's).
"""

from __future__ import annotations

import torch

from treespec.cache import TreeCache
from treespec.drafter import CANDIDATE_MODES
from treespec.dynamic_tree import DynamicTree
from treespec.reference import resolve
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree

from .accuracy import RankHits
from .eagle_model import EagleModel
from .expansion import ExpandingDrafter
from .kind import DrafterKind
from .lean import lean_decoder
from .target_states import target_hidden
from .unroll import unrolled
from .vocab import DraftVocab, ReducedHead


class Eagle(ExpandingDrafter):
    """The drafter: autoregressive over its own features, expanding a static or dynamic tree."""

    needs_features = True
    keeps_expanded_path = False  # expanded nodes were fed the drafter's features, not the target's

    def __init__(self, model: EagleModel, *, default_tree: Tree | DynamicTree | None = None,
                 candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True):
        """default_tree: EAGLE-2's dynamic tree, sized for CPUs, where a target pass over 16 tree tokens costs
        little more than over one (the paper's GPU default is DynamicTree(60, 7, 10)). candidates: as for DraftModel.
        draft_vocab: project onto these target ids only (FR-Spec, heads/vocab.py; still lossless).
        lean: draft without the base model's per-call work (heads/lean.py); False: the plain forward."""
        super().__init__(model, default_tree if default_tree is not None else DynamicTree(16, 5, 4), candidates)
        self.feature_layers = model.feature_layers
        if draft_vocab is not None and model.draft_vocab is not None:
            raise ValueError("this EAGLE-3 drafter has its own draft vocabulary (d2t/t2d); FR-Spec is for "
                             "full-vocabulary heads")
        self._logits = ReducedHead(model.lm_head, draft_vocab, lean=lean) if draft_vocab is not None else \
            model.head(lean)
        self._decoder = lean_decoder(model.decoder, model.layer_config) if lean and model.decoder is not None else None

    def _run(self, tokens, features, attention_mask=None, position_ids=None) -> torch.Tensor:
        """The drafter over ``tokens`` [1, n] paired with ``features`` [1, n, h], after its cache → g [1, n, h];
        without a mask (committed tokens) causal after the cache, at positions following it."""
        if self._decoder is None:
            return self.model(tokens, features, attention_mask=attention_mask, position_ids=position_ids,
                              cache=self.cache)
        x = self.model.decoder_input(tokens, features)
        return self._decoder(x, self.cache, self.n_cached, position_ids, attention_mask)

    def check_target(self, target) -> None:
        self.model.check_fits(target)

    def reset(self) -> None:
        super().reset()
        self._pending: list[torch.Tensor] = []  # [1, m_i, h]: drafter features of committed tokens not fed yet
        self._outputs: dict[int, torch.Tensor] = {}  # grown node → drafter output g [h] at it

    def _new_cache(self):
        return TreeCache(self.model.layer_config)  # preallocated (treespec/cache.py): no copy per depth

    @torch.no_grad()
    def prefill(self, input_ids, features) -> None:
        # prompt token j + 1 pairs with feature j; the first token has none, the last feature pairs with the root
        self._pending = [self.model.fuse(features[:, :-1].to(self.model.device, self.model.dtype))]

    def _start(self, committed, feature):
        tokens = committed[:, self.n_cached + 1 :].to(self.model.device)  # [1, m]: entries n_cached.., root last
        model = self.model
        features = torch.cat([*self._pending, model.fuse(feature[:, None].to(model.device, model.dtype))], dim=1)
        if features.shape[1] != tokens.shape[1]:
            raise RuntimeError(f"EAGLE drafter out of sync: {tokens.shape[1]} committed tokens to feed but "
                               f"{features.shape[1]} target features (was accept() called after every propose()?)")
        g = self._run(tokens, features)  # [1, m, h]
        self.n_cached += tokens.shape[1]
        self._pending = []
        self._outputs = {0: g[0, -1]}
        return self._logits(g[:, -1])  # [1, V]

    def _forward_nodes(self, tokens, nodes, parents, attention_mask, position_ids):
        features = torch.stack([self._outputs[p] for p in parents])[None]  # [1, F, h]: each parent's output
        g = self._run(tokens[None], features, attention_mask, position_ids)[0]  # [F, h]
        self._outputs.update(zip(nodes, g, strict=True))
        return self._logits(g)  # [F, V]

    def _fill_for_timing(self, tokens) -> None:
        h = self.model.fc.out_features
        features = torch.zeros(*tokens.shape, h, dtype=self.model.dtype, device=self.model.device)
        self._outputs = {0: self._run(tokens, features)[0, -1]}

    @torch.no_grad()
    def accept(self, path, features) -> None:
        super().accept(path, features)
        # accepted node i pairs with the feature at its parent: root, then nodes 1..k-1; the feature at the
        # last accepted node pairs with the next root and arrives with it in propose()
        self._pending = [self.model.fuse(features[:, : len(path)].to(self.model.device, self.model.dtype))]
        self._outputs = {}


@torch.no_grad()
def rank_accuracy(target, model: EagleModel, windows: torch.Tensor, *, depth: int = 8, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY) -> list[list[float]]:
    """acc[d][r] (heads/accuracy.py) drafting from the root over the drafter's own features along the
    window's tokens (what an accepted tree path feeds it), on held-out ``windows`` [n, S]: heads/unroll.py."""
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    for batch in windows.split(batch_size):
        features, last = target_hidden(target, batch, model.feature_layers)  # [b, S, L·h], [b, S, h]
        target_logits = model.logits(last[:, 1:]).float()  # [b, n, V]: the target's token after entry j's
        n = target_logits.shape[1]
        for k, g in unrolled(model, batch, model.fuse(features[:, :-1]), depth - 1, by_root=False):
            valid = torch.arange(n, device=g.device) >= k  # entries drafted from a root inside the window
            counter.add(k, model.logits(g[:, valid]).topk(top_k, dim=-1).indices, target_logits[:, valid])
    model.train(was_training)
    return counter.table()


class EagleKind(DrafterKind):
    """EAGLE-1/2 drafters trained by treespec (conf/drafter/eagle.yaml); upstream checkpoints load through
    heads/load.py's "auto"."""

    name = "eagle"
    candidate_modes = CANDIDATE_MODES
    reduces_vocab = True

    def load(self, source, target) -> EagleModel:
        return EagleModel.from_pretrained(resolve(source), target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Eagle:
        return Eagle(module, candidates=candidates, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)


KIND = EagleKind()
