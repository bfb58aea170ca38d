"""Training batches as a drafter's objective reads them (heads/<kind>/objective.py), and the frozen target answered
from stored features: the two things a loss needs to know about the data, whichever job (train/training/) made it.

    input_ids, loss_mask, target = batch_parts(batch, target)     # target: the model, or a StoredTarget
    for piece in split_batch(batch, 8): ...                        # consecutive rows
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from treespec.heads.training.segments import PackedModel, packed_positions, same_segment

# -- batches: a LongTensor of token windows, or a dict of row-aligned tensors ---------------------------------
# A batch is either a LongTensor [b, S] (corpus windows, every position trained on) or a dict with
# "input_ids" [b, S] and, for chat data, "loss_mask" [b, S] (True on the tokens the drafter learns to predict)
# and "attention_mask" [b, S] (False on right padding), and, for stored target features (train/training/features.py),
# "hidden.<i>" [b, S, h] (the target's hidden_states[i]). Rows are right-padded: under causal attention no real
# token sees padding, so padding never needs a mask in the forward passes, only in the losses. A packed batch
# (several conversations per row, train/training/packing.py) adds "position_ids" [b, S], restarting at 0 with each
# conversation: heads/training/segments.py keeps attention and the losses inside each one.
Batch = torch.Tensor | dict


def batch_rows(batch: Batch, start: int, stop: int) -> Batch:
    """Rows [start, stop) of a batch; a dict batch is trimmed to its longest remaining row."""
    if torch.is_tensor(batch):
        return batch[start:stop]
    rows = {k: v[start:stop] for k, v in batch.items()}
    if "attention_mask" in rows and rows["attention_mask"].numel():
        width = int(rows["attention_mask"].sum(1).max())
        seq = batch["attention_mask"].shape[1]
        rows = {k: v[:, :width] if v.dim() >= 2 and v.shape[1] == seq else v for k, v in rows.items()}
    return rows


def batch_size_of(batch: Batch) -> int:
    return (batch if torch.is_tensor(batch) else batch["input_ids"]).shape[0]


def batch_tokens(batch: Batch) -> int:
    """Tokens a batch trains on: every position but the first of each window; for dict batches, the
    non-padding positions."""
    if torch.is_tensor(batch):
        return batch.shape[0] * (batch.shape[1] - 1)
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum()) - batch_size_of(batch)
    return batch["input_ids"].shape[0] * (batch["input_ids"].shape[1] - 1)


def batch_to(batch: Batch, device) -> Batch:
    if torch.is_tensor(batch):
        return batch.to(device)
    return {k: v.to(device) for k, v in batch.items()}


def split_batch(batch: Batch, size: int) -> list:
    """Consecutive pieces of at most ``size`` rows."""
    n = batch_size_of(batch)
    return [batch_rows(batch, i, min(n, i + size)) for i in range(0, n, size)]


# -- the target, answered from stored states -------------------------------------------------------------
class _StoredStates:
    """``hidden_states`` as a transformers model returns them, for the stored indices only."""

    def __init__(self, hidden: dict, n: int, n_states: int, dtype, device):
        self.hidden, self.n, self.n_states, self.dtype, self.device = hidden, n, n_states, dtype, device

    def __len__(self) -> int:
        return self.n_states

    def __getitem__(self, i: int) -> torch.Tensor:
        layer = int(i) % self.n_states
        if layer not in self.hidden:
            raise ValueError(f"stored features hold hidden_states {sorted(self.hidden)}, not {layer}: prepare them "
                             "again for this drafter")
        return self.hidden[layer][:, : self.n].to(self.device, self.dtype)


class StoredTarget:
    """The frozen target as the recipes' losses use it (``target_hidden``: ``base_model(input_ids,
    output_hidden_states)``; the lm_head and embeddings), with the decoder's outputs read from a batch's
    stored ``hidden.<i>`` tensors instead of computed. ``input_ids`` must be a prefix of the batch's."""

    def __init__(self, target, batch: dict):
        self._target, self.config = target, target.config
        self._ids = batch["input_ids"]
        self._hidden = {int(k.split(".", 1)[1]): v for k, v in batch.items() if k.startswith("hidden.")}

    @property
    def device(self):
        return self._target.device

    @property
    def dtype(self):
        return self._target.dtype

    def base_model(self, input_ids=None, output_hidden_states=False, **_):
        n = input_ids.shape[1]
        ids = self._ids[:, :n].to(input_ids.device)
        same = input_ids.shape[0] == ids.shape[0] and torch.equal(input_ids, ids)
        if not same:
            raise RuntimeError("StoredTarget was asked for tokens other than the batch's stored ones")
        n_states = self.config.num_hidden_layers + 1
        states = _StoredStates(self._hidden, n, n_states, self._target.dtype, input_ids.device)
        return SimpleNamespace(last_hidden_state=states[-1], hidden_states=states)

    def get_output_embeddings(self):
        return self._target.get_output_embeddings()

    def get_input_embeddings(self):
        return self._target.get_input_embeddings()


def batch_parts(batch, target, device=None):
    """(input_ids [b, S], loss mask [b, S] or None, the target, a ``StoredTarget`` or a ``PackedModel``) of any
    batch form (train/training/data.py), on ``device`` when given. Stored states were computed one conversation at
    a time, so a packed batch's ``StoredTarget`` needs no position ids; a packed batch run online gets the target
    wrapped so that its attention stays inside each conversation (heads/training/segments.py)."""
    if device is not None:
        batch = batch_to(batch, device)
    if torch.is_tensor(batch):
        return batch, None, target
    if any(k.startswith("hidden.") for k in batch):
        return batch["input_ids"], batch.get("loss_mask"), StoredTarget(target, batch)
    positions = packed_positions(batch)
    packed = target if positions is None or target is None else PackedModel(target, positions)
    return batch["input_ids"], batch.get("loss_mask"), packed


def shifted_mask(loss_mask: torch.Tensor, shift: int, width: int, segments: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """[b, S] loss mask → [b, width] bool whose entry j is ``loss_mask[:, j + shift]`` (False past the end):
    whether the token an entry (a position, a drafter entry, a head's position) predicts is trained on. With a
    packed batch's ``segments`` [b, S] (heads/training/segments.py), also whether position j and the token j + shift lie
    in one conversation: no token is predicted across a boundary."""
    b, s = loss_mask.shape
    out = torch.zeros(b, width, dtype=torch.bool, device=loss_mask.device)
    n = max(0, min(width, s - shift))
    out[:, :n] = loss_mask[:, shift : shift + n].bool()
    return out if segments is None else out & same_segment(segments, 0, shift, width)
