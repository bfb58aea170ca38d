"""A separate small causal LM as the drafter (the seed's setup; Leviathan et al. 2023, Chen et al. 2023).

The draft expands the tree one depth at a time (heads/drafting/expansion.py): one forward over every node of
depth d that has children gives the draft distribution at those nodes, from which their children are
chosen — the top-k ranks (deterministic candidates), i.i.d. samples (``candidates="sample"`` at
temperature > 0, the classic speculative-sampling chain), or, with a ``DynamicTree``, EAGLE-2's
confidence-grown tree. A chain is the width-1 case, i.e. ordinary autoregressive drafting. The draft
keeps its own KV cache: committed tokens it has already seen stay cached, the tree nodes it expanded
are compacted to the accepted path after each step (treespec/cache.py).

A hybrid draft model (gated delta nets, Mamba-2, short convolutions beside attention: every family
treespec/recurrent.py verifies as a target) drafts the same trees, chains and branching, greedy and sampled,
static and dynamic, one prompt at a time: each depth's frontier nodes are rows of its cache, each gathered from
its parent's row (``treespec.recurrent.DraftRows``), and after the walk the cache holds the deepest accepted
node's row, or the root's restored state with the accepted tokens fed again by the next step's first pass.
A model whose mixers take one token per pass (Jamba) is fed its committed tokens one at a time; one without
any attention layer (Mamba, Mamba-2) drafts too (its row slots count its tokens).
"""

from __future__ import annotations

import torch

from treespec.cache import decoding_cache
from treespec.compat import cache_arg
from treespec.heads.checkpoints.drafter_folder import check_same_vocab
from treespec.heads.drafting.expansion import ExpandingDrafter
from treespec.heads.drafting.lean import LeanProjection, lean_decoder
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.heads.training.accuracy import RankHits
from treespec.inputs import max_positions
from treespec.layer_types import check_rollback
from treespec.recurrent import one_token_at_a_time, steps
from treespec.rows import gather_last, gather_positions
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree


class DraftModel(ExpandingDrafter):
    def __init__(self, model, *, default_tree: Tree | None = None, candidates: str = "topk",
                 draft_vocab: DraftVocab | None = None, lean: bool = True):
        """candidates: "topk" (deterministic ranks) or "sample" (i.i.d. from q_draft when temperature > 0);
        draft_vocab: project onto these target ids only (FR-Spec, heads/drafting/vocab.py; still lossless);
        lean: draft without the base model's per-call work (heads/drafting/lean.py); False: the plain forward."""
        try:  # the draft's cache is rolled back as a target's is
            check_rollback(model, drafting=True)
        except ValueError as err:
            raise ValueError(f"this draft model cannot draft trees: {err}") from None
        self._one_token = one_token_at_a_time(model.config)  # committed tokens fed one per pass (Jamba)
        super().__init__(model, default_tree if default_tree is not None else Tree.chain(4), candidates)
        self.max_positions = max_positions(model.config)
        if draft_vocab is not None and getattr(model.config, "final_logit_softcapping", None):
            raise ValueError("a reduced draft vocabulary skips the model's logit soft-capping: not for this draft")
        # with a draft vocabulary: the base model's hidden states through the kept rows of its lm_head
        self._decoder = lean_decoder(model.base_model, model.config) if lean else None
        head = model.get_output_embeddings()
        self._head = ReducedHead(head, draft_vocab, lean=lean) if draft_vocab is not None else \
            LeanProjection.of(head) if self._decoder is not None else None

    def _logits(self, input_ids, attention_mask=None, position_ids=None, cache=None, keep=None) -> torch.Tensor:
        """One cached forward over ``input_ids`` [b, n] → draft logits over the target vocabulary [b, n, V];
        without a mask the tokens are committed ones (causal after the cache). ``cache``: the drafter's own, or a
        static pass's (treespec/static_pass.py), which always comes with positions. ``keep`` [b, k]: only each
        row's outputs at those indices → [b, k, V] (projected alone where the head is the drafter's own)."""
        cache = self.cache if cache is None else cache
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if self._decoder is not None:
            past = self.slots.length if position_ids is None else None  # (read only when the positions follow it)
            hidden = self._decoder(self.model.get_input_embeddings()(input_ids), cache, past, position_ids,
                                   attention_mask)
        elif self._head is None:
            logits = self.model(**inputs, **cache_arg(cache), use_cache=True).logits
            return logits if keep is None else gather_positions(logits, keep)
        else:
            hidden = self.model.base_model(**inputs, **cache_arg(cache), use_cache=True).last_hidden_state
        return self._head(hidden if keep is None else gather_positions(hidden, keep))

    def check_target(self, target) -> None:
        check_same_vocab(self.model, target, "draft model")

    def _new_cache(self):
        return decoding_cache(self.model.config)  # sliding-window and hybrid drafts too (treespec/cache.py)

    def _start(self, committed, feature):
        slots = self._rows(len(committed.lengths))
        pending, counts = committed.tails(slots.counts)  # [b, m]: each row's tokens not yet seen, root last
        inputs = self._committed_inputs(counts)  # {} for one prompt (the only batch a recurrent draft takes)
        feeds = steps(pending.to(self.model.device), self._one_token and slots.length > 0)
        logits = torch.cat([self._logits(ids, **inputs) for ids in feeds], dim=1)  # [b, m, V]
        slots.append(pending.shape[1], counts)
        return gather_last(logits, counts)  # [b, V]

    def _fill_for_timing(self, tokens) -> None:
        self._logits(tokens)

    def _depth(self, cache, attention_mask, position_ids, tokens):
        return self._logits(tokens, attention_mask, position_ids, cache)  # [b, F, V]

    def _forward_nodes(self, tokens, nodes, parents, attention_mask, position_ids):
        return self._network(attention_mask, position_ids, tokens)  # [b, F, V]


@torch.no_grad()
def rank_accuracy(target, draft, windows: torch.Tensor, *, depth: int = 8, top_k: int = 8, batch_size: int = 4,
                  sampling: Sampling = GREEDY, first_root: int = 0) -> list[list[float]]:
    """acc[d][r] for a draft LM (heads/training/accuracy.py), teacher forced on held-out ``windows`` [n, S], from root
    ``first_root`` on; the same at every depth (the seed's i.i.d. acceptance assumption)."""
    counter = RankHits(1, top_k, sampling)
    for w in windows.split(batch_size):
        counter.add(0, draft(input_ids=w).logits[:, first_root:].topk(top_k, dim=-1).indices,
                    target(input_ids=w).logits[:, first_root:])
    row = counter.table()[0]
    return [row for _ in range(depth)]
