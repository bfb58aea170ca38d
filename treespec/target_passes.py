"""The target's passes over one run's cache, in the one way this run verifies: chosen once per run
(``target_passes``), because it depends only on the target and on ``compile``, never on a step.

* ``TargetPasses`` (eager): the model's own forward over the cache, with the tree's mask and positions as keyword
  arguments (treespec/visibility.py: ``TreeAttention`` keeps their parts across steps);
* ``StaticPasses`` (``compile=True``): the same mask and positions staged into a compiled static graph
  (treespec/static_pass.py);
* ``PathRowPasses`` (a hybrid target): the tree's root-to-leaf paths as batch rows over a snapshot of the recurrent
  state, then the accepted path kept or replayed (treespec/recurrent.py).

Each one ``verify``s a step's tokens (every row's root and candidates) and, once the walk chose each row's path,
``keep``s it: the cache then holds every row's committed tokens but its root, as the slots say.
"""

from __future__ import annotations

import torch

from treespec.compat import cache_arg, prefill_kwargs
from treespec.drafter import Proposals, stack_features
from treespec.layer_types import is_hybrid
from treespec.recurrent import TargetRows
from treespec.rows import RowSlots
from treespec.static_pass import StaticPass
from treespec.timing import TARGET, StepTimer, timed
from treespec.visibility import TreeAttention


class TargetPasses:
    """The target over ``cache`` (its features at ``feature_layers``, side by side, for a drafter that takes them),
    timed as TARGET by ``observer``; eager tree passes."""

    explicit_masks = False  # every pass takes its mask and positions, chains too (a static graph's inputs)

    def __init__(self, target, cache, feature_layers: tuple[int, ...], observer: StepTimer | None):
        self.target, self.cache, self.feature_layers, self.observer = target, cache, feature_layers, observer
        self.attention = TreeAttention(target, cache, explicit=self.explicit_masks)

    def forward(self, input_ids: torch.Tensor, **mask_inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over ``input_ids`` [b, n] after what the cache holds → (logits [b, n or 1, V], the drafter's
        features [b, n, L·h] or None)."""
        with timed(self.observer, TARGET):
            out = self.target(input_ids=input_ids, **cache_arg(self.cache), use_cache=True,
                              output_hidden_states=bool(self.feature_layers), **mask_inputs)
        return out.logits, stack_features(out.hidden_states, self.feature_layers) if self.feature_layers else None

    def verify(self, slots: RowSlots, tokens: torch.Tensor, proposals: Proposals):
        """tokens [b, N]: each row's root, then its candidates (``proposals``), after the slots ``slots`` describes
        → (logits [b, N, V], features [b, N, L·h] or None)."""
        return self.forward(tokens, **self.attention(proposals, slots))

    def keep(self, slots: RowSlots, keeps: list[list[int]]) -> None:
        """After the walk: row b's cache keeps its root and accepted nodes, the tree-node offsets ``keeps[b]``."""
        slots.keep(keeps)


class StaticPasses(TargetPasses):
    """Tree passes as ``static``, one compiled graph per shape (treespec/static_pass.py)."""

    explicit_masks = True

    def __init__(self, target, cache, feature_layers, observer, static: StaticPass):
        super().__init__(target, cache, feature_layers, observer)
        self.static = static

    def verify(self, slots, tokens, proposals):
        masked = self.attention(proposals, slots)
        with timed(self.observer, TARGET):
            return self.static(self.cache, masked["attention_mask"], masked["position_ids"], tokens)


class PathRowPasses(TargetPasses):
    """A hybrid target's tree passes, one prompt: root-to-leaf paths as rows (treespec/recurrent.py)."""

    def __init__(self, target, cache, feature_layers, observer):
        super().__init__(target, cache, feature_layers, observer)
        self.paths = TargetRows(target, cache)

    def verify(self, slots, tokens, proposals):
        return self.paths.tree_pass(self.forward, tokens, proposals.trees[0])

    def keep(self, slots, keeps):
        self.paths.keep(self.replay, keeps[0])
        slots.append(len(keeps[0]))

    def replay(self, input_ids: torch.Tensor) -> None:
        """The target over ``input_ids`` [1, n] after what the cache holds, for its state only (the accepted path
        replayed)."""
        with timed(self.observer, TARGET):
            self.target(input_ids=input_ids, **cache_arg(self.cache), use_cache=True, **prefill_kwargs(self.target))


def target_passes(target, cache, feature_layers: tuple[int, ...], observer: StepTimer | None,
                  static: StaticPass | None = None) -> TargetPasses:
    """The passes this run verifies with: a hybrid target's path rows, else ``static`` when compiled (no hybrid
    compiles: treespec/static_pass.py refuses it), else eager."""
    if is_hybrid(target.config):
        return PathRowPasses(target, cache, feature_layers, observer)
    if static is not None:
        return StaticPasses(target, cache, feature_layers, observer, static)
    return TargetPasses(target, cache, feature_layers, observer)
