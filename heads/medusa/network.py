"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): K extra heads on the target's last (final-norm) hidden state.

With the hidden state at position t (whose lm_head logits give token t+1, the tree's root), head k
predicts token t+k+2, i.e. the candidates at tree depth k+1. Each head is a stack of residual blocks
``x + SiLU(W x + b)`` (W and b zero-initialised, so an untrained head starts as the identity and, with a shared
lm_head, predicts what the base head predicts) and a vocabulary projection: its own, or the target's
frozen lm_head (``share_lm_head``; keeps heads cheap on a small, vocabulary-heavy target). Every block
is its own module (the reference code repeats one block object, sharing weights by accident).

A static tree's path (r0, r1, ...) is rank r0 of head 0, then rank r1 of head 1, and so on: children do
not depend on their parent's token, so the candidates are deterministic given the context and are
verified losslessly by the walker's deterministic-candidate rule.
"""

from __future__ import annotations

import torch
from torch import nn

from treespec.heads.checkpoints.drafter_folder import check_fits_target, load_drafter, save_drafter, vocab_size_of
from treespec.heads.drafting.vocab import DraftVocab, ReducedHead
from treespec.io import load_checked_weights


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # with a zero bias too, the block starts as the identity
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    #: the drafter kind that drives it (heads/registry.py; the registry's "auto" kind reads it)
    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 share_lm_head: bool = True, lm_head: nn.Module | None = None):
        super().__init__()
        if share_lm_head and lm_head is None:
            raise ValueError("share_lm_head=True needs the target's lm_head")
        self.config = {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_heads": num_heads,
                       "num_layers": num_layers, "share_lm_head": share_lm_head}
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        if share_lm_head:
            self.projections = None
            self._lm_head = [lm_head]  # a list keeps the frozen target weight out of our parameters / state_dict
        else:
            self.projections = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if lm_head is not None:  # start every head from the base head's projection (Medusa does too)
                for proj in self.projections:
                    proj.weight.data.copy_(lm_head.weight.data)

    @property
    def num_heads(self) -> int:
        return self.config["num_heads"]

    def blocks_out(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [..., h] → each head's residual blocks' output [k, ..., h], before its vocabulary projection."""
        return torch.stack([self.blocks[k](hidden) for k in range(heads or self.num_heads)])

    def forward(self, hidden: torch.Tensor, heads: int | None = None, projections=None) -> torch.Tensor:
        """hidden [..., h] → logits [k, ..., V] for the first ``heads`` heads (default all); ``projections``
        (one per head, from ``reduced``) replace the vocabulary projections."""
        projections = projections or self.projections or [self._lm_head[0]] * self.num_heads
        return torch.stack([projections[k](x) for k, x in enumerate(self.blocks_out(hidden, heads))])

    @property
    def shared_lm_head(self) -> nn.Module | None:
        """The target's lm_head when every head projects through it (``share_lm_head``), else None."""
        return self._lm_head[0] if self.projections is None else None

    def reduced(self, vocab: DraftVocab) -> list[ReducedHead]:
        """Per head, its vocabulary projection restricted to ``vocab`` (FR-Spec): a shared lm_head is sliced once."""
        if self.projections is None:
            return [ReducedHead(self._lm_head[0], vocab)] * self.num_heads
        return [ReducedHead(projection, vocab) for projection in self.projections]

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        fits(self.config, target)

    def save_pretrained(self, folder) -> None:
        save_drafter(self, folder, self.kind, self.config)

    @classmethod
    def from_pretrained(cls, folder, target) -> MedusaHeads:
        """Load heads for ``target``; refuse heads trained for another hidden size or vocabulary."""
        config, weights = load_drafter(folder, cls.kind)
        check_config(config, folder)
        fits(config, target)
        heads = cls(**config, lm_head=target.get_output_embeddings())
        load_checked_weights(heads, weights, f"Medusa weights in {folder} (config {config})")
        return heads.to(device=target.device, dtype=target.dtype).eval()


# the saved config's fields and their types (hidden_size "384" would otherwise compare unequal to 384)
CONFIG_FIELDS = {"hidden_size": int, "vocab_size": int, "num_heads": int, "num_layers": int, "share_lm_head": bool}


def check_config(config: dict, folder) -> None:
    """Every field present, none unknown, each of its type: else a ValueError naming the file and field."""
    missing = sorted(CONFIG_FIELDS.keys() - config.keys())
    unknown = sorted(config.keys() - CONFIG_FIELDS.keys())
    wrong = sorted(k for k, kind in CONFIG_FIELDS.items()
                   if k in config and (type(config[k]) is not kind or (kind is int and config[k] < 1)))
    if missing or unknown or wrong:
        raise ValueError(f"Medusa config in {folder}: " + "; ".join(filter(None, [
            missing and f"missing {', '.join(missing)}", unknown and f"unknown {', '.join(unknown)}",
            wrong and "bad " + ", ".join(f"{k}={config[k]!r} (expected {CONFIG_FIELDS[k].__name__})" for k in wrong)])))


def fits(config: dict, target) -> None:
    """Raise ValueError if heads of ``config`` were trained for another hidden size or vocabulary than ``target``'s."""
    check_fits_target("Medusa", {k: config[k] for k in ("hidden_size", "vocab_size")},
                      {"hidden_size": target.config.hidden_size, "vocab_size": vocab_size_of(target)})
