"""EAGLE: a feature-level drafter (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"; EAGLE-2, Li et al. 2024b; EAGLE-3, Li et al. 2025).

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
can be exported to those consumers (heads/export.py). ``layer_overrides`` replace target config values
for the drafter's own layers (an upstream checkpoint's RoPE, head count, MLP width, norm eps, layer
count: ``LAYER_OVERRIDE_KEYS``); ``fc_bias=False`` drops fc's bias; ``own_embeddings=True`` keeps a
frozen token table of the drafter's own (an upstream checkpoint's ``embed_tokens``) instead of the
target's. All four are saved in the drafter's config, and omitted there when at their defaults.

Between steps the drafter's cache holds one entry per committed token from the second (the first has
no feature before it) up to the previous step's root; the target features of the tokens accepted since
arrive in ``accept`` and are fed, with the new root and its feature, at the start of the next
``propose``. Tree nodes it expanded were fed drafter features, so none of them is kept (EAGLE refeeds
the accepted path with the target's).
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn
from transformers import DynamicCache

from treespec.cache import TreeCache
from treespec.drafter import target_hidden
from treespec.dynamic_tree import DynamicTree
from treespec.masks import DENSE_MASK_ATTENTION, ancestor_mask
from treespec.sampling import GREEDY, Sampling
from treespec.tree import Tree

from .accuracy import RankHits
from .checkpoint import load_drafter, save_drafter, vocab_size_of
from .expansion import ExpandingDrafter
from .lean import LeanProjection, lean_decoder
from .vocab import DraftVocab, ReducedHead

# Target config values a drafter's weights depend on (llama/qwen2/mistral names and GPT-2's); a drafter
# is refused by a target that differs in any of them.
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "activation_function",
                     "n_inner", "rms_norm_eps", "layer_norm_epsilon", "attention_bias", "mlp_bias", "rope_parameters")


def architecture(target) -> dict:
    """The target's architecture values (JSON-normalised) that a drafter trained for it must match."""
    config = target.config
    arch = {k: getattr(config, k) for k in ARCHITECTURE_KEYS if getattr(config, k, None) is not None}
    arch["vocab_size"] = vocab_size_of(target)
    return json.loads(json.dumps(arch))


def check_fits_target(config: dict, target) -> None:
    """Raise ValueError naming every architecture value where ``target`` differs from the drafter's."""
    saved, actual = config["architecture"], architecture(target)
    keys = sorted(saved.keys() | actual.keys())
    diff = {k: (saved.get(k), actual.get(k)) for k in keys if saved.get(k) != actual.get(k)}
    if diff:
        details = ", ".join(f"{k} {a!r} (drafter) vs {b!r} (target)" for k, (a, b) in diff.items())
        raise ValueError(f"this EAGLE drafter was trained for another target architecture: {details}")


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
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * config.num_hidden_layers
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


def one_layer_config(target_config):
    """The target's config with one decoder layer, full attention (a DynamicCache) and a tree-mask
    capable attention implementation.

    Full attention also for a sliding-window target (Mistral, Gemma-2/3, gpt-oss): the drafter is trained on its
    own, over features that already carry the target's windowed context, and a full layer's cache is rolled back
    by plain compaction (treespec/cache.py)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):  # models keying masks by layer type (Gemma-2/3, gpt-oss, Qwen2)
        config.layer_types = ["full_attention"]
    elif getattr(config, "sliding_window", None) is not None:  # one window for every layer (Mistral, Phi-3, Mixtral)
        config.sliding_window = None
    if getattr(config, "_attn_implementation", None) not in DENSE_MASK_ATTENTION:  # expansion passes a float mask
        config._attn_implementation = "sdpa"
    return config


class EagleModel(nn.Module):
    """fc(cat(embed(token), feature)) → one decoder layer of the target's architecture → lm_head."""

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

    def head(self, lean: bool = False):
        """features [..., h] → logits [..., V]: ``logits``, or with ``lean`` a transposed copy of the same
        lm_head (heads/lean.py) for drafting."""
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
                            position_ids=position_ids, cache=cache, use_cache=cache is not None).last_hidden_state

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        check_fits_target(self.config, target)

    def save_pretrained(self, folder) -> None:
        save_drafter(self, folder, "eagle", self.config)

    @classmethod
    def from_pretrained(cls, folder, target) -> EagleModel:
        """Load a drafter for ``target``; refuse one trained for another architecture (ValueError)."""
        config, weights = load_drafter(folder, "eagle")
        if not (isinstance(config.get("feature_layers"), list) and isinstance(config.get("architecture"), dict)):
            raise ValueError(f"EAGLE config in {folder} needs 'feature_layers' (a list) and 'architecture' (a dict), "
                             f"got keys {sorted(config)}")
        check_fits_target(config, target)
        variant = config.get("variant", "treespec")
        try:
            model = cls(target, feature_layers=config["feature_layers"], variant=variant,
                        layer_overrides=config.get("layer_overrides"), fc_bias=config.get("fc_bias", True),
                        own_embeddings=config.get("own_embeddings", False))
        except (TypeError, ValueError) as err:
            raise ValueError(f"EAGLE config in {folder}: {err}") from None
        if variant != "treespec":  # an upstream checkpoint's biases are whatever it holds
            conform_linear_biases(model, weights)
        try:
            model.load_state_dict(weights)  # copied into our device and dtype
        except RuntimeError as err:  # missing, unexpected or mis-shaped tensors
            raise ValueError(f"EAGLE weights in {folder} do not fit the drafter: {err}") from None
        return model.eval()


class Eagle(ExpandingDrafter):
    """The drafter: autoregressive over its own features, expanding a static or dynamic tree."""

    needs_features = True
    keeps_expanded_path = False  # expanded nodes were fed the drafter's features, not the target's

    def __init__(self, model: EagleModel, *, default_tree: Tree | DynamicTree | None = None,
                 candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True):
        """default_tree: EAGLE-2's dynamic tree, sized for CPUs (research.md: 16 verified tokens cost ~1.5×
        one); the paper's GPU default is DynamicTree(60, 7, 10). candidates: as for DraftModel.
        draft_vocab: project onto these target ids only (FR-Spec, heads/vocab.py; still lossless).
        lean: draft without the base model's per-call work (heads/lean.py); False: the plain forward."""
        super().__init__(model, default_tree if default_tree is not None else DynamicTree(16, 5, 4), candidates)
        self.feature_layers = model.feature_layers
        if draft_vocab is not None and hasattr(model, "draft_vocab"):
            raise ValueError("this EAGLE-3 drafter has its own draft vocabulary (d2t/t2d); FR-Spec is for "
                             "full-vocabulary heads")
        self._logits = ReducedHead(model.lm_head, draft_vocab, lean=lean) if draft_vocab is not None else \
            model.head(lean)
        decoder = getattr(model, "decoder", None)
        self._decoder = lean_decoder(decoder, model.layer_config) if lean and decoder is not None else None

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


def fused_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3-style fusion switch's low, mid and high features: after the first layer, after the middle
    one, and the last (final-norm) hidden state."""
    return (1, max(1, num_hidden_layers // 2), -1)


# -- training-time test: the drafter unrolled over its own features on whole windows -----------------------
def unroll_mask(n: int, step: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive mask [1, 1, n, (step + 1)·n] for unrolled step ``step`` >= 1 over keys of steps
    0..step (n entries each, in the cache in that order): entry j sees step-0 entries i <= j − step and,
    of each step m in 1..step, entry j − step + m only (its own chain; m = step is itself). That is the
    ancestor relation of the chain drafted from entry j − step, so it is an ancestor mask."""
    j = torch.arange(n, device=device)[:, None]  # [q, 1]
    i = torch.arange(n, device=device)[None, :]  # [1, t]
    blocks = [i <= j - step] + [i == j - step + m for m in range(1, step + 1)]  # each [q, t]
    return ancestor_mask(torch.cat(blocks, dim=1), 0, dtype=dtype, device=device)  # [1, 1, q, (step + 1)·t]


def unrolled(target, model: EagleModel, batch: torch.Tensor, *, steps: int, noise_std: float = 0.0):
    """The drafter's predictions on ``batch`` [b, S] (entries j = 0..S−2 pair token j + 1 with the target
    feature at j) for draft depths 1..steps + 1 → (f_next [b, n, h], target_logits [b, n, V], steps), where
    ``steps`` yields (k, g [b, n, h], valid) lazily: step k = depth k + 1; ``valid`` selects the entries
    whose chain starts inside the window. target_logits at entry j are the target's for token j + 2.

    Step k feeds entry j the output of step k − 1 at entry j − 1, and entry j attends to what it would see
    when drafting depth k from the root at entry j − k (``unroll_mask``): EAGLE-3's training-time test."""
    inputs, last = target_hidden(target, batch, model.feature_layers)  # [b, S, L·h], [b, S, h]
    tokens, f_next = batch[:, 1:], last[:, 1:]  # [b, n], [b, n, h]: entry j predicts f_{j+1}
    with torch.no_grad():
        target_logits = model.logits(f_next).float()  # [b, n, V]: the target's next token
    features = inputs[:, :-1]
    if noise_std > 0 and model.training:
        features = features + noise_std * torch.randn_like(features)
    n = tokens.shape[1]
    steps = min(steps, n - 1)  # step k scores entries k..n-1

    def run():
        cache = DynamicCache(config=model.layer_config) if steps else None
        g = model(tokens, model.fuse(features), cache=cache)  # [b, n, h], causal
        yield 0, g, slice(None)
        positions = torch.arange(n, device=g.device)[None]
        for k in range(1, steps + 1):
            own = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # entry j pairs with step k−1's g at j−1
            mask = unroll_mask(n, k, dtype=g.dtype, device=g.device)
            g = model(tokens, own, attention_mask=mask, position_ids=positions, cache=cache)
            yield k, g, torch.arange(n, device=g.device) >= k

    return f_next, target_logits, run()


@torch.no_grad()
def rank_accuracy(target, model: EagleModel, windows: torch.Tensor, *, depth: int = 8, top_k: int = 10,
                  batch_size: int = 4, sampling: Sampling = GREEDY) -> list[list[float]]:
    """acc[d][r] (heads/accuracy.py) drafting from the root over the drafter's own features along the
    window's tokens (what an accepted tree path feeds it), on held-out ``windows`` [n, S]."""
    was_training = model.training
    model.eval()
    counter = RankHits(depth, top_k, sampling)
    for batch in windows.split(batch_size):
        _, target_logits, steps = unrolled(target, model, batch, steps=depth - 1)
        for k, g, valid in steps:
            counter.add(k, model.logits(g[:, valid]).topk(top_k, dim=-1).indices, target_logits[:, valid])
    model.train(was_training)
    return counter.table()
