"""The EAGLE drafter's model (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"; EAGLE-2, Li et al. 2024b): what it computes, its variants and its checkpoint folder. The
drafter that drives it is heads/eagle/drafter.py's ``Eagle``.

Instead of predicting tokens from tokens, the drafter predicts the target's next *feature* (its last,
final-norm hidden state, whose lm_head logits are the target's logits) from the current feature and
the token that feature was sampled into, which removes the uncertainty of which token was drawn:

    g_j = decoder(fc(cat(embed(x_{j+1}), f_j)))        g_j ≈ f_{j+1},   lm_head(g_j) ≈ logits at j + 1

Entry j of the drafter's sequence pairs committed token x_{j+1} with the target feature f_j at the
position before it (token j + 1 pairs with feature j), so the drafter's sequence is the target's shifted
by one and entry j sits at position j. Beyond the committed tokens it drafts over its OWN features: a
tree node pairs its token with its parent's output g. ``decoder`` is one decoder layer (plus the final
norm) of the target's own architecture: the stock transformers base-model class built from the
target's config with one layer, with its rotary embedding; embed and lm_head are the target's, frozen
and shared (not in this module's state_dict). EAGLE-3's fusion (``feature_layers``, e.g. (1, mid, -1))
feeds the concatenated low, mid and high hidden states of the target through ``fusion`` (L·h → h) first.

**Variants.** ``variant="treespec"`` (the default, and the shipped drafter) is the description above: the
decoder layer keeps its input norm and the decoder its final norm. ``variant="upstream"`` is EAGLE-1/2 as
published (SafeAILab/EAGLE ``cnets1.py``; vLLM ``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``):
layer 0 has NO input norm (fc's output enters attention as it is) and there is no final norm (the layer's
output goes straight to the target's lm_head); further layers keep their input norms. Only that variant
can be exported to those consumers (heads/checkpoints/export.py). ``layer_overrides`` replace target config values
for the drafter's own layers (an upstream checkpoint's RoPE, head count, MLP width, norm eps, layer
count: ``LAYER_OVERRIDE_KEYS``); ``fc_bias=False`` drops fc's bias; ``own_embeddings=True`` keeps a
frozen token table of the drafter's own (an upstream checkpoint's ``embed_tokens``) instead of the
target's. All four are saved in the drafter's config, and omitted there when at their defaults.

**A training vocabulary** (``drafter.train_vocab``: N, heads/eagle/objective.py): the drafter learns over the N most
frequent training tokens only, through those N rows of the target's lm_head (``TrainingVocab``,
heads/drafting/vocab.py); it travels with the weights as ``draft_vocab.safetensors`` and is the drafter's FR-Spec
vocabulary when decoding.
"""

from __future__ import annotations

import copy

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
from treespec.heads.checkpoints.layer_config import one_layer_config, set_full_attention
from treespec.heads.drafting.lean import LeanProjection
from treespec.heads.drafting.vocab import ReducedHead, TrainingVocab
from treespec.io import load_checked_weights

VARIANTS = ("treespec", "upstream")

# Target config values an EAGLE drafter's own decoder layers may replace (``layer_overrides``): what an
# upstream checkpoint's config.json and tensor shapes say about its layers.
LAYER_OVERRIDE_KEYS = ("num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "rms_norm_eps", "hidden_act", "rope_parameters", "max_position_embeddings")


def apply_layer_overrides(config, overrides: dict | None):
    """``config`` (a one-layer copy of the target's, modified in place and returned) with ``overrides``
    (keys from ``LAYER_OVERRIDE_KEYS``) applied; per-layer lists follow a new layer count."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(LAYER_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"layer_overrides: unknown key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(LAYER_OVERRIDE_KEYS)}")
    for key, value in overrides.items():
        setattr(config, key, copy.deepcopy(value))
    set_full_attention(config)
    return config


def conform_linear_biases(module: nn.Module, weights: dict, *, apply: bool = True) -> list[str]:
    """Give every ``nn.Linear`` of ``module`` whose weight is in ``weights`` a bias exactly when ``weights``
    holds one (zeros until loaded), or none: upstream checkpoints decide their biases (Qwen2-style q/k/v
    biases on a Llama target, none on a Qwen2 target, an o_proj bias a consumer insists on). Returns the
    names of the modules that differ(ed); ``apply=False`` only reports them."""
    changed = []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.Linear) or f"{name}.weight" not in weights:
            continue
        has = f"{name}.bias" in weights
        if has == (sub.bias is not None):
            continue
        changed.append(name)
        if apply:
            sub.bias = nn.Parameter(torch.zeros(sub.out_features, dtype=sub.weight.dtype,
                                                device=sub.weight.device)) if has else None
    return changed


class EagleModel(TrainingVocab, nn.Module):
    """fc(cat(embed(token), feature)) → one decoder layer of the target's architecture → lm_head."""

    #: the drafter kind that drives it (heads/registry.py; the registry's "auto" kind reads it)
    kind = "eagle"
    #: a draft vocabulary of its own (EAGLE-3's d2t/t2d); None: it projects with the target's full lm_head,
    #: which FR-Spec may restrict (heads/drafting/vocab.py)
    draft_vocab = None

    def __init__(self, target, feature_layers=(-1,), *, variant: str = "treespec", layer_overrides: dict | None = None,
                 fc_bias: bool = True, own_embeddings: bool = False):
        """variant: "treespec" or "upstream" (module docstring); layer_overrides: target config values the
        drafter's layers replace (``LAYER_OVERRIDE_KEYS``); own_embeddings: a frozen token table of its own."""
        super().__init__()
        n_layers = target.config.num_hidden_layers
        self.feature_layers = tuple(int(i) for i in feature_layers)
        if not self.feature_layers or any(not -(n_layers + 1) <= i <= n_layers for i in self.feature_layers):
            raise ValueError(f"feature_layers {self.feature_layers} must index the target's {n_layers + 1} hidden "
                             f"states (embeddings, then layers 1..{n_layers}; -1 = last, after the final norm)")
        if variant not in VARIANTS:
            raise ValueError(f"EAGLE variant must be one of {VARIANTS}, got {variant!r}")
        h = target.config.hidden_size
        self.variant = variant
        self.config = {"feature_layers": list(self.feature_layers), "architecture": architecture(target)}
        # only what differs from the defaults, so that a default drafter's config reads as it always has
        extras = {"variant": variant if variant != "treespec" else None, "layer_overrides": dict(layer_overrides or {}),
                  "fc_bias": None if fc_bias else False, "own_embeddings": True if own_embeddings else None}
        self.config.update({k: v for k, v in extras.items() if v})
        self.layer_config = apply_layer_overrides(one_layer_config(target.config), layer_overrides)
        # EAGLE-3: low, mid and high target features fused into one; EAGLE-1 takes the last one as it is.
        self.fusion = nn.Linear(len(self.feature_layers) * h, h, bias=False) if len(self.feature_layers) > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        # The stock base-model class with one layer: its own decoder layer, rotary embedding, mask and cache
        # handling and final norm, no forked model code. Tokens are embedded by the target's table instead.
        self.decoder = type(target.base_model)(self.layer_config)
        self.decoder.set_input_embeddings(None)
        if variant == "upstream":  # EAGLE-1 as published: no input norm on layer 0, no final norm
            layers = getattr(self.decoder, "layers", None)
            if layers is None or not hasattr(layers[0], "input_layernorm") or not hasattr(self.decoder, "norm"):
                raise ValueError(f"the upstream EAGLE variant needs a Llama-like target (decoder layers with an "
                                 f"input_layernorm, a final norm); {type(target).__name__} is not one")
            layers[0].input_layernorm = nn.Identity()
            self.decoder.norm = nn.Identity()
        self.embed_tokens = None
        if own_embeddings:  # frozen, like the target's table it stands in for
            self.embed_tokens = nn.Embedding(vocab_size_of(target), h).requires_grad_(False)
        # a list keeps the target's frozen tables out of our parameters and state_dict
        self._target_tables = [target.get_input_embeddings(), target.get_output_embeddings()]
        self.to(target.device)
        for p in self.parameters():  # parameters only: the rotary inv_freq buffer stays float32, as the target's
            p.data = p.data.to(target.dtype)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target hidden states [..., L·h] (the feature layers side by side) → drafter features [..., h]."""
        return target_features if self.fusion is None else self.fusion(target_features)

    @property
    def lm_head(self) -> nn.Module:
        """The target's frozen lm_head (not a parameter of the drafter)."""
        return self._target_tables[1]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., h] → [..., V] with the target's lm_head."""
        return self.lm_head(features)

    def proposal_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., h] → [..., V]: what drafting proposes from, the target's lm_head or, with a training vocabulary, its
        rows only (-inf elsewhere)."""
        return self.logits(features) if self.vocab is None else self.vocab.scatter(self.draft_logits(features))

    def head(self, lean: bool = False):
        """features [..., h] → logits [..., V]: ``logits``, or with ``lean`` a lean projection of the same
        lm_head (heads/drafting/lean.py) for drafting; with a training vocabulary, its rows only (-inf elsewhere)."""
        if self.vocab is not None:
            return ReducedHead(self.lm_head, self.vocab, lean=lean)
        return LeanProjection.of(self.lm_head) if lean else self.logits

    def decoder_input(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc(cat(embed(input_ids), features)): [b, n] and [b, n, h] → the decoder's input [b, n, h]."""
        embed = self.embed_tokens if self.embed_tokens is not None else self._target_tables[0]
        return self.fc(torch.cat([embed(input_ids), features], dim=-1))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, *, attention_mask=None, position_ids=None,
                cache=None) -> torch.Tensor:
        """input_ids [b, n] and the features they pair with [b, n, h] → predicted next features [b, n, h].

        Without ``attention_mask`` the attention is causal after whatever ``cache`` holds."""
        return self.decoder(inputs_embeds=self.decoder_input(input_ids, features), attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=cache is not None,
                            **cache_arg(cache)).last_hidden_state

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        fits(self.config, target)

    def save_pretrained(self, folder) -> None:
        """Weights and config, and a training vocabulary's ids beside them (each written atomically)."""
        save_drafter(self, folder, "eagle", self.config)
        self.save_vocab(folder)

    @classmethod
    def from_pretrained(cls, folder, target) -> EagleModel:
        """Load a drafter for ``target``; refuse one trained for another architecture (ValueError)."""
        config, weights = load_drafter(folder, "eagle")
        if not (isinstance(config.get("feature_layers"), list) and isinstance(config.get("architecture"), dict)):
            raise ValueError(f"EAGLE config in {folder} needs 'feature_layers' (a list) and 'architecture' (a dict), "
                             f"got keys {sorted(config)}")
        fits(config, target)
        variant = config.get("variant", "treespec")
        try:
            model = cls(target, feature_layers=config["feature_layers"], variant=variant,
                        layer_overrides=config.get("layer_overrides"), fc_bias=config.get("fc_bias", True),
                        own_embeddings=config.get("own_embeddings", False))
        except (TypeError, ValueError) as err:
            raise ValueError(f"EAGLE config in {folder}: {err}") from None
        if variant != "treespec":  # an upstream checkpoint's biases are whatever it holds
            conform_linear_biases(model, weights)
        load_checked_weights(model, weights, f"EAGLE weights in {folder}")
        model.load_vocab(folder)
        return model.eval()


def fits(config: dict, target) -> None:
    """Raise ValueError naming every architecture value where ``target`` differs from the one the drafter of
    ``config`` was trained for."""
    check_fits_target("EAGLE", config["architecture"], architecture(target))


def fused_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3-style fusion switch's low, mid and high features: after the first layer, after the middle
    one, and the last (final-norm) hidden state."""
    return (1, max(1, num_hidden_layers // 2), -1)

