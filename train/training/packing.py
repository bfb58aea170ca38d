"""Sequence packing for chat data (``data.chat.pack``, on by default): whole conversations back to back in windows
of ``data.chat.max_length`` tokens (``trainer.seq_len`` by default), as SpecForge and speculators train, instead of
one conversation per right-padded row, where short conversations leave most of a row padding.

**Attention and loss stay inside each conversation.** A packed row carries ``position_ids`` that restart at 0 with
each conversation; the drafters' objectives read them (heads/training/segments.py): the target and any transformers
model
attend block-diagonally (transformers builds that mask from per-document position ids; ``check_packing`` makes sure
the target does), the EAGLE drafters' own layers get the same relation as an additive mask
(heads/training/unroll.py), and no
token is predicted across a boundary (``shifted_mask``'s ``segments``). A packed batch therefore trains exactly what
its conversations run one at a time would (tests/train/training/test_packing.py), only in fewer, fuller rows.

**The plan** is best-fit decreasing over the conversations' lengths: longest first, each into the open window with
the least room that still holds it. It depends on the lengths alone (no seed), so it is computed once; a step's
windows are ``permuted_indices`` of (seed, step) over the windows, as one-conversation rows are over conversations,
so a resumed run and any number of ranks see the same batches. A conversation never spans two windows: those
longer than a window were cut to ``max_length`` (``overlong: truncate``, counted) or skipped (``overlong: skip``,
counted) when they were encoded (train/training/chat.py).

**Stored features** (``data.features``) hold each conversation's target states computed on its own, so the same
plan packs them (``FeatureSplit`` samples) with the stored states beside the tokens.
"""

from __future__ import annotations

import bisect

import torch

from treespec.heads.training.segments import PackedModel
from treespec.train.training.data import permuted_indices


def plan(lengths, width: int) -> list[list[int]]:
    """Sample indices per window (module docstring): best-fit decreasing of ``lengths`` into windows of ``width``
    tokens. Every sample is in exactly one window; a sample longer than ``width`` is an error."""
    lengths = [int(n) for n in lengths]
    too_long = [n for n in lengths if n > width]
    if too_long:
        raise ValueError(f"{len(too_long)} sample(s) longer than the packing window of {width} tokens (the longest "
                         f"{max(too_long)}): encode them with max_length <= {width}")
    windows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, window), sorted: the first fitting one has the least room
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(rooms, (lengths[i], -1))
        if k < len(rooms):
            room, w = rooms.pop(k)
        else:
            room, w = width, len(windows)
            windows.append([])
        windows[w].append(i)
        if room - lengths[i] > 0:
            bisect.insort(rooms, (room - lengths[i], w))
    return windows


def sample_row(samples, i: int) -> dict:
    """Sample ``i`` as per-token tensors: {"input_ids" [n] long, "loss_mask" [n] bool, (stored) "hidden.<l>"
    [n, h]}, from chat.Samples (a (tokens, mask) pair) or a FeatureSplit (a dict)."""
    row = samples.sample(int(i))
    if isinstance(row, dict):
        return row
    ids, mask = row
    return {"input_ids": ids.long(), "loss_mask": mask.bool()}


def collate_packed(rows_per_window: list[list[dict]], pad_id: int = 0) -> dict:
    """Windows of samples (each a list of ``sample_row`` dicts) → a packed batch, right-padded to the fullest
    window: {"input_ids" [b, L] long, "loss_mask" [b, L] bool, "attention_mask" [b, L] bool (False on padding),
    "position_ids" [b, L] long (0.. per conversation; padding continues the last), "hidden.<l>" [b, L, h]}."""
    totals = [sum(r["input_ids"].shape[0] for r in rows) for rows in rows_per_window]
    b, width = len(rows_per_window), max(totals, default=0)
    first = rows_per_window[0][0]
    out = {"input_ids": torch.full((b, width), pad_id, dtype=torch.long),
           "loss_mask": torch.zeros(b, width, dtype=torch.bool),
           "attention_mask": torch.zeros(b, width, dtype=torch.bool),
           "position_ids": torch.zeros(b, width, dtype=torch.long)}
    for name, value in first.items():
        if name.startswith("hidden."):
            out[name] = torch.zeros(b, width, *value.shape[1:], dtype=value.dtype)
    for w, rows in enumerate(rows_per_window):
        at = 0
        for r in rows:
            n = r["input_ids"].shape[0]
            for name, value in r.items():
                out[name][w, at : at + n] = value
            out["position_ids"][w, at : at + n] = torch.arange(n)
            at += n
        out["attention_mask"][w, :at] = True
        last = int(out["position_ids"][w, at - 1]) if at else -1
        out["position_ids"][w, at:] = torch.arange(last + 1, last + 1 + width - at)
    return out


class PackedBatches:
    """Deterministic batches of packed windows of whole samples (module docstring): step → ``permuted_indices``
    over the windows → ``collate_packed``. ``samples``: chat.Samples or a FeatureSplit; ``what`` names the
    samples in the error a set too small for one batch raises."""

    def __init__(self, samples, width: int, batch_size: int, seed: int = 0, pad_id: int = 0, *,
                 what: str = "training conversations"):
        self.samples, self.width, self.batch_size = samples, int(width), batch_size
        self.seed, self.pad_id = seed, pad_id
        self.lengths = [int(n) for n in samples.lengths()]
        self.windows = plan(self.lengths, self.width)
        if len(self.windows) < batch_size:
            raise ValueError(f"{len(samples)} {what} pack into {len(self.windows)} window(s) of {self.width} tokens, "
                             f"fewer than batch_size={batch_size}: lower trainer.batch_size or data.chat.max_length, "
                             "or train one conversation per row (data.chat.pack=false)")
        self.steps_per_epoch = len(self.windows) // batch_size

    def fill(self) -> float:
        """The share of the windows' tokens that are conversation tokens (1 − padding)."""
        return sum(self.lengths) / max(1, len(self.windows) * self.width)

    def summary(self) -> str:
        return (f"packed {len(self.lengths)} conversations into {len(self.windows)} windows of {self.width} tokens "
                f"({self.fill():.0%} full; attention and loss inside each conversation)")

    def indices(self, step: int) -> torch.Tensor:
        return permuted_indices(len(self.windows), self.batch_size, self.seed, step)

    def batch(self, step: int) -> dict:
        windows = [self.windows[int(w)] for w in self.indices(step)]
        return collate_packed([[sample_row(self.samples, i) for i in w] for w in windows], self.pad_id)


@torch.no_grad()
def check_packing(model, samples, *, what: str = "the target", tolerance: float | None = None) -> float:
    """Run two conversations of ``samples`` packed in one row and each on its own through ``model`` (a
    transformers causal LM): their last hidden states must agree, else attention crosses conversations (a model
    or attention implementation that ignores per-conversation position ids) and a ValueError says what to do.
    Returns the largest difference relative to the states' scale."""
    if len(samples) < 2:
        return 0.0
    rows = [sample_row(samples, i)["input_ids"][:64] for i in range(2)]  # [n_a], [n_b]
    device = next(model.parameters()).device
    packed = torch.cat(rows)[None].to(device)  # [1, n_a + n_b]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    got = PackedModel(model, positions).base_model(input_ids=packed).last_hidden_state[0].float()
    alone = torch.cat([model.base_model(input_ids=r[None].to(device), use_cache=False).last_hidden_state[0]
                       for r in rows]).float()
    error = float((got - alone).abs().max() / alone.abs().max().clamp(min=1e-6))
    if tolerance is None:
        tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    if error > tolerance:
        impl = getattr(model.config, "_attn_implementation", None)
        raise ValueError(f"{what} ({type(model).__name__}, attention {impl!r}) lets attention cross conversations "
                         f"in a packed row (relative difference {error:.2e} from running them one at a time): it "
                         "ignores per-conversation position ids. Train one conversation per row (data.chat.pack="
                         "false) or load it with attn_implementation sdpa or eager")
    return error
