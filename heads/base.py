"""The one interface every drafter implements, and what it returns.

A decoding step, from the drafter's side (see treespec/generate.py):

1. ``propose(committed, feature, tree, sampling, generator)``: the committed sequence ends with the
   root token (committed, not yet seen by the target's cache); ``feature`` is the target's last hidden
   state at the position before the root, the one whose logits produced the root. The drafter returns a
   ``Proposal``: one token per candidate node of the tree it proposes, and, if it *sampled* them, the
   distributions it drew each node's children from.
2. The target verifies; the walker picks the accepted path.
3. ``accept(path, features)``: node indices accepted (root excluded) and the target's hidden states at
   the root and at each accepted node, so drafters with their own caches stay in sync.

Candidates are either deterministic given the context (top-k ranks: ``q_draft is None``; verified with
EAGLE's sibling-by-sibling rule) or sampled i.i.d. from ``q_draft`` (verified with multi-candidate
rejection sampling, SpecInfer). Both are lossless; see treespec/verify.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec.sampling import Sampling
from treespec.tree import Tree

# acc[d][r], saved beside a trained drafter's weights: how often its rank-r token at depth d + 1 is the
# target's; drives accuracy-grown trees (treespec.policy) and predicted speedups (treespec.autotree).
ACCURACY_FILE = "head_accuracy.json"


@dataclass
class Proposal:
    tree: Tree                         # topology of this step's candidates (static, or grown this step)
    tokens: torch.Tensor               # LongTensor [n]: candidate token of nodes 1..n
    q_draft: torch.Tensor | None = None  # float [N, V]: distribution node i's children were sampled from

    def __post_init__(self):
        if self.tokens.shape != (len(self.tree),):
            raise ValueError(f"proposal has {tuple(self.tokens.shape)} tokens for a tree of {len(self.tree)} nodes")


class Drafter:
    """Base class: proposes a token tree each step. Subclasses override ``propose``."""

    #: whether ``propose``/``accept`` need the target's hidden states (costs output_hidden_states=True)
    needs_features: bool = False
    #: whether ``propose`` accepts a DynamicTree (a budget grown from draft confidence, EAGLE-2)
    grows_dynamic_trees: bool = False
    #: which target hidden-state layers to pass as features (-1 = last, after the final norm)
    feature_layers: tuple[int, ...] = (-1,)

    def check_target(self, target) -> None:
        """Raise ValueError if this drafter cannot serve ``target`` (vocabulary, hidden size, ...)."""

    def reset(self) -> None:
        """Forget all per-sequence state; called by generate() before each prompt."""

    def prefill(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """See the prompt. input_ids: [1, P]; features: [1, P, h] target hidden states or None."""

    def propose(
        self,
        committed: torch.Tensor,
        feature: torch.Tensor | None,
        tree: Tree,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """committed: LongTensor [1, L] ending with the root; feature: [1, h] or None."""
        raise NotImplementedError

    def accept(self, path: torch.Tensor, features: torch.Tensor | None) -> None:
        """path: LongTensor [k] accepted node indices; features: [1, k + 1, h] (root first) or None."""


def vocab_size_of(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_same_vocab(draft, target, what: str = "drafter") -> None:
    v_draft, v_target = vocab_size_of(draft), vocab_size_of(target)
    if v_draft != v_target:
        raise ValueError(
            f"{what} vocabulary ({v_draft} tokens) differs from the target's ({v_target} tokens): "
            "draft and target must share one tokenizer"
        )


# -- trained drafter folders: {kind}_config.json (with "drafter": kind) beside {kind}.safetensors ------------
def save_drafter(module: torch.nn.Module, folder, kind: str, config: dict) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{kind}_config.json").write_text(json.dumps({"drafter": kind, **config}, indent=2))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, folder / f"{kind}.safetensors")


def load_drafter(folder, kind: str) -> tuple[dict, dict]:
    """(config without "drafter", state_dict) of a saved ``kind`` drafter; another kind is refused (ValueError)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / f"{kind}_config.json").read_text())
    if config.pop("drafter", kind) != kind:
        raise ValueError(f"{folder} does not hold a {kind} drafter")
    return config, load_file(folder / f"{kind}.safetensors")
