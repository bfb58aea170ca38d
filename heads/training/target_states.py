"""The frozen target teacher-forced on whole windows: the hidden states a drafter reads and the logits it is
scored against. Rank accuracy (each drafter module's ``rank_accuracy``) and training (treespec.train) read
them here; decoding gets its features from generate() instead.
"""

from __future__ import annotations

import torch

from treespec.drafter import stack_features


@torch.no_grad()
def target_hidden(target, input_ids: torch.Tensor, layers=(-1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states without its logits: (features [b, s, L·h] at ``layers``, side by side as
    generate() passes them; the last, final-norm hidden state [b, s, h], whose lm_head logits are the
    target's). ``target`` may be a stored one (treespec.train.training.features.StoredTarget)."""
    layers = tuple(layers)
    out = target.base_model(input_ids=input_ids, output_hidden_states=layers != (-1,))
    last = out.last_hidden_state
    return (last if layers == (-1,) else stack_features(out.hidden_states, layers)), last


@torch.no_grad()
def target_states(target, input_ids: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states at ``layers`` side by side [b, S, L·h] (as generate() passes them) and its
    logits [b, S, V] (float32) on ``input_ids`` [b, S]."""
    features, last = target_hidden(target, input_ids, layers)
    return features, target.get_output_embeddings()(last).float()
