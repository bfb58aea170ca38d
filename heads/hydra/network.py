"""Hydra heads (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding"): Medusa-style
heads on the target's last hidden state whose candidates depend on the path drafted before them.

With h_t the target's final-norm hidden state at position t (its lm_head logits give x_{t+1}, the tree's root),
head k (k = 0, 1, ...) fills depth k + 1: it reads h_t and the input embeddings of the k + 1 tokens on the node's
own path, root included, and predicts x_{t+k+2}:

    z_k = blocks_k(W_k · cat(h_t, e(x_{t+1}), ..., e(x_{t+k+1})) + b_k)     logits_k = lm_head(z_k)

``W_k`` [h, (k + 2)·h] starts as [I, 0, ..., 0] and each residual block ``x + SiLU(Ax + c)`` as the identity (A, c
zero), so an untrained head predicts what the base head predicts, as a fresh Medusa head does; the embeddings'
columns then learn how the path changes the guess. The vocabulary projection is the target's frozen lm_head
(``share_lm_head``, the default) or one per head, initialised from it. ``e`` is the target's own frozen input
table (the paper's heads read the base model's token embeddings too).

Hydra++'s options (the paper's §4): ``num_layers`` residual blocks per head (Hydra++ uses 4 layers per head MLP),
and ``prefix_attention``: one extra decoder layer over the target's hidden states whose output replaces h_t as
the heads' input (the paper's "prefix attention": it lets the heads query the whole context, not one position).
It is the target's own decoder-layer class with one layer (heads/checkpoints/layer_config.py's config, as EAGLE
builds its
layer), fed the hidden states as inputs_embeds, and it enters through a gate that starts at zero,

    base_t = h_t + g ⊙ prefix(h_{≤t})_t        g [h], zero-initialised

so at the start of training the heads see h_t exactly (the layer's own final norm would otherwise rescale it).
Teacher distillation, the third option, is a property of the loss (heads/hydra/objective.py).
"""

from __future__ import annotations

import torch
from torch import nn

from treespec.compat import cache_arg
from treespec.heads.checkpoints.drafter_folder import (
    architecture,
    check_fits_target,
    load_drafter,
    save_drafter,
    vocab_size_of,
)
from treespec.heads.checkpoints.layer_config import one_layer_config
from treespec.io import load_checked_weights


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: the block starts as the identity (Medusa's block, per head)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class HydraHead(nn.Module):
    """One head: cat(base, k + 1 path embeddings) [..., (k + 2)·h] → [..., h], before its vocabulary projection."""

    def __init__(self, hidden_size: int, path_tokens: int, num_layers: int):
        super().__init__()
        self.input = nn.Linear((1 + path_tokens) * hidden_size, hidden_size)
        with torch.no_grad():  # [I, 0, ..., 0]: the base state passes through, the path is ignored at first
            self.input.weight.zero_()
            self.input.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.input.bias.zero_()
        self.blocks = nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.input(x))


class HydraHeads(nn.Module):
    #: the drafter kind that drives it (heads/registry.py; the registry's "auto" kind reads it)
    kind = "hydra"

    def __init__(self, target, num_heads: int = 4, num_layers: int = 1, share_lm_head: bool = True,
                 prefix_attention: bool = False):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hydra {name} must be an integer >= 1, got {value!r}")
        for name, value in (("share_lm_head", share_lm_head), ("prefix_attention", prefix_attention)):
            if not isinstance(value, bool):
                raise ValueError(f"Hydra {name} must be true or false, got {value!r}")
        h, vocab = target.config.hidden_size, vocab_size_of(target)
        self.config = {"hidden_size": h, "vocab_size": vocab, "num_heads": num_heads, "num_layers": num_layers,
                       "share_lm_head": share_lm_head, "prefix_attention": prefix_attention}
        if prefix_attention:  # the layer is built from the target's config: it fits that architecture only
            self.config["architecture"] = architecture(target)
        self.heads = nn.ModuleList(HydraHead(h, k + 1, num_layers) for k in range(num_heads))
        lm_head = target.get_output_embeddings()
        # a list keeps the target's frozen tables out of our parameters and state_dict
        self._tables = [target.get_input_embeddings(), lm_head]
        self.projections = None
        if not share_lm_head:
            self.projections = nn.ModuleList(nn.Linear(h, vocab, bias=False) for _ in range(num_heads))
            for proj in self.projections:
                proj.weight.data.copy_(lm_head.weight.data)
        self.prefix, self.prefix_gate, self.layer_config = None, None, None
        if prefix_attention:
            self.layer_config = one_layer_config(target.config)
            self.prefix = type(target.base_model)(self.layer_config)  # stock classes, no forked model code
            self.prefix.set_input_embeddings(None)  # fed the target's hidden states, never tokens
            self.prefix_gate = nn.Parameter(torch.zeros(h))
        self.to(target.device)
        for p in self.parameters():  # parameters only: a rotary inv_freq buffer stays float32, as the target's
            p.data = p.data.to(target.dtype)

    @property
    def num_heads(self) -> int:
        return self.config["num_heads"]

    @property
    def device(self) -> torch.device:
        return self.heads[0].input.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0].input.weight.dtype

    @property
    def shared_lm_head(self) -> nn.Module | None:
        """The target's lm_head when every head projects through it (``share_lm_head``), else None."""
        return self._tables[1] if self.projections is None else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] → the target's input embeddings [..., h], in the heads' dtype."""
        return self._tables[0](tokens).to(self.dtype)

    def base(self, hidden: torch.Tensor, *, cache=None, attention_mask=None, position_ids=None) -> torch.Tensor:
        """The heads' base state at each position of ``hidden`` [b, s, h] (the target's final-norm hidden states):
        ``hidden`` itself, or with prefix attention h + g ⊙ prefix(h), causal after whatever ``cache`` holds."""
        if self.prefix is None:
            return hidden
        out = self.prefix(inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=cache is not None, **cache_arg(cache)).last_hidden_state
        return hidden + self.prefix_gate * out

    def head_out(self, k: int, base: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Head k on base states [..., h] and the embeddings of each node's path [..., k + 1, h] → [..., h]."""
        return self.heads[k](torch.cat([base, path.flatten(-2)], dim=-1))

    def project(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k's vocabulary projection: [..., h] → logits [..., V]."""
        return (self.projections[k] if self.projections is not None else self._tables[1])(x)

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        fits(self.config, target)

    def save_pretrained(self, folder) -> None:
        save_drafter(self, folder, self.kind, self.config)

    @classmethod
    def from_pretrained(cls, folder, target) -> HydraHeads:
        """Load heads for ``target``; refuse heads trained for another hidden size, vocabulary or (with prefix
        attention) architecture."""
        config, weights = load_drafter(folder, cls.kind)
        check_config(config, folder)
        fits(config, target)
        heads = cls(target, **{k: config[k] for k in ("num_heads", "num_layers", "share_lm_head", "prefix_attention")})
        load_checked_weights(heads, weights, f"Hydra weights in {folder} (config {config})")
        return heads.eval()


# the saved config's fields and their types
CONFIG_FIELDS = {"hidden_size": int, "vocab_size": int, "num_heads": int, "num_layers": int, "share_lm_head": bool,
                 "prefix_attention": bool}


def check_config(config: dict, folder) -> None:
    """Every field present, none unknown (``architecture`` with prefix attention only), each of its type: else a
    ValueError naming the file and field."""
    allowed = CONFIG_FIELDS.keys() | ({"architecture"} if config.get("prefix_attention") else set())
    missing = sorted((CONFIG_FIELDS.keys() | allowed) - config.keys())
    unknown = sorted(config.keys() - allowed)
    wrong = sorted(k for k, kind in CONFIG_FIELDS.items()
                   if k in config and (type(config[k]) is not kind or (kind is int and config[k] < 1)))
    if "architecture" in config and not isinstance(config["architecture"], dict):
        wrong.append("architecture")
    if missing or unknown or wrong:
        raise ValueError(f"Hydra config in {folder}: " + "; ".join(filter(None, [
            missing and f"missing {', '.join(missing)}", unknown and f"unknown {', '.join(unknown)}",
            wrong and "bad " + ", ".join(f"{k}={config[k]!r}" for k in wrong)])))


def fits(config: dict, target) -> None:
    """Raise ValueError if heads of ``config`` were trained for another target than ``target``."""
    if "architecture" in config:
        check_fits_target("Hydra", config["architecture"], architecture(target))
    check_fits_target("Hydra", {k: config[k] for k in ("hidden_size", "vocab_size")},
                      {"hidden_size": target.config.hidden_size, "vocab_size": vocab_size_of(target)})
