"""EAGLE-3 checkpoints as other projects write and read them, converted to and from treespec's ``Eagle3Model``
(``UpstreamEagle3Model`` where the checkpoint's layer differs from what the target's config builds).
heads/checkpoints/detect.py
reads the files and the kind (heads/eagle3/kind.py) calls ``eagle3_from_upstream``; heads/checkpoints/export.py calls
``eagle3_to_upstream`` (heads/eagle3/upstream_export.py: the writing) and writes the files.

**EAGLE-3** (SafeAILab/EAGLE ``cnets.py``; SpecForge; vLLM ``llama_eagle3.py``; SGLang ``llama_eagle3.py``;
speculators ``eagle3``): ``fc.weight`` [H, 3·Ht], the layer as ``midlayer.*`` (official, SGLang, SpecForge)
or ``layers.0.*`` (vLLM, speculators), optionally behind a ``model.`` prefix, ``norm.weight``,
``lm_head.weight`` [draft_vocab, H], ``d2t`` / ``t2d`` (absent for the full vocabulary), optionally
``embed_tokens.weight``. ``norm_before_residual`` (speculators, vLLM): the residual is the NORMED feature.

**Aux layers** (which target hidden states EAGLE-3 fuses). treespec indexes transformers'
``hidden_states``: ``hidden_states[i]`` is the input of decoder layer i (0 = the embeddings, L = the final
norm's output). Conventions found upstream:

=============================================  =======================  ===============================
where the ids are                               convention               treespec index
=============================================  =======================  ===============================
top-level ``eagle_aux_hidden_state_layer_ids``  input of layer i          i       (vLLM, speculators)
``eagle_config.eagle_aux_hidden_state_...``     output of layer i        i + 1   (SGLang, SpecForge)
absent                                          (2, L//2, L-3) inputs    as is   (official EAGLE, vLLM,
                                                                                  SGLang and speculators
                                                                                  defaults)
=============================================  =======================  ===============================

vLLM also reads the nested ids when no top-level ones exist, as inputs: a nested-only config is read
here as SGLang reads it (that is who writes them); ``load(..., aux_layers=...)`` overrides. Exports write
each consumer's own field only (vLLM and speculators: top level; SGLang: nested, minus one).
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from treespec.compat import cache_arg
from treespec.heads.checkpoints.drafter_folder import load_drafter, vocab_size_of
from treespec.heads.checkpoints.upstream_common import (
    check_vocab,
    layer_counts,
    layer_overrides,
    load_state,
    own_embeddings,
    strip_model_prefix,
)
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.eagle.network import apply_layer_overrides, conform_linear_biases
from treespec.heads.eagle3.layer import Eagle3Layer, llama_layer_config
from treespec.heads.eagle3.network import Eagle3Model, fits

EAGLE3_LAYER_KEY = re.compile(r"^midlayer\.(self_attn\.[qkvo]_proj\.(weight|bias)|self_attn\.[qk]_norm\.weight"
                              r"|mlp\.(gate|up|down)_proj\.(weight|bias)"
                              r"|(input_layernorm|hidden_norm|post_attention_layernorm)\.weight)$")
EAGLE3_TOP_KEYS = {"fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
EAGLE3_UNSUPPORTED = {"fc_norm": "EAGLE 3.1's fc_norm (per-aux norms)", "input_norm": "norm_before_fc",
                      "midlayers": "more than one decoder layer", "mask_hidden": "parallel drafting (PEagle)"}


def is_eagle3(weights: dict) -> bool:
    keys = set(weights)
    return "fc.weight" in keys and any(".hidden_norm." in k for k in keys)


def normalize_eagle3_keys(weights: dict, where: str) -> dict:
    """``model.`` prefixes stripped, ``layers.0.`` → ``midlayer.``, ``draft_id_to_target_id`` → ``d2t``."""
    weights = strip_model_prefix(weights, where)
    out = {}
    for key, value in weights.items():
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        elif key == "draft_id_to_target_id":
            key = "d2t"
        if key in out:
            raise ValueError(f"{where}: the decoder layer is stored twice (midlayer.* and layers.0.*)")
        out[key] = value
    return out


def eagle3_aux_layers(config: dict, num_hidden_layers: int, where: str, aux_layers=None) -> tuple[int, ...]:
    """The target hidden-state indices an EAGLE-3 checkpoint fuses, in treespec's convention (module
    docstring): explicit ``aux_layers``, else the top-level ids (input of layer i), else SGLang's nested
    ``eagle_config`` ids (output of layer i: +1), else the published default (2, L//2, L-3)."""
    n = int(num_hidden_layers)
    nested = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if aux_layers is not None:
        ids, source = [int(i) for i in aux_layers], "aux_layers"
    elif config.get("eagle_aux_hidden_state_layer_ids"):
        ids, source = [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]], "eagle_aux_hidden_state_layer_ids"
    elif nested.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) + 1 for i in nested["eagle_aux_hidden_state_layer_ids"]]
        source = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang: output of layer i = hidden_states[i + 1])"
    else:
        ids, source = [2, n // 2, n - 3], f"the published default (2, L//2, L-3) for L = {n}"
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"{where}: aux layers {ids} from {source} do not exist in a {n}-layer target (hidden_states "
                         f"0..{n}); pass load(..., aux_layers=[...]) with the indices it was trained with")
    return tuple(ids)


class UpstreamEagle3Layer(Eagle3Layer):
    """Eagle3Layer with speculators' ``norm_before_residual`` switch: the residual is hidden_norm(h), not h."""

    def __init__(self, target, config, norm_before_residual: bool = False):
        super().__init__(target, config, "llama")
        self.norm_before_residual = bool(norm_before_residual)

    def forward(self, embeds, hidden, position_embeddings, attention_mask, cache):
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [b, n, 2H]
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **cache_arg(cache))
        hidden = (normed if self.norm_before_residual else hidden) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _set_eps(norm: nn.Module, eps: float) -> None:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            setattr(norm, name, eps)
            return


class UpstreamEagle3Model(Eagle3Model):
    """An Eagle3Model whose layer follows an upstream checkpoint where it differs from the target's own
    config: ``layer_overrides`` (its RoPE, head count, MLP width, norm eps), ``norm_before_residual``,
    ``own_embeddings`` (a frozen ``embed_tokens`` of its own) and whatever biases its tensors hold. Saved as
    an "eagle3" folder whose config carries them under ``"upstream"``; heads/eagle3/kind.py reads it back."""

    def __init__(self, target, *, aux_layers=None, vocab_map=None, layer_overrides: dict | None = None,
                 norm_before_residual: bool = False, own_embeddings: bool = False):
        super().__init__(target, aux_layers=aux_layers, vocab_map=vocab_map, layer="llama")
        self.layer_config = apply_layer_overrides(llama_layer_config(target.config), layer_overrides)
        self.midlayer = UpstreamEagle3Layer(target, self.layer_config, norm_before_residual)
        self.rotary_emb = LlamaRotaryEmbedding(config=self.layer_config)
        for norm in (self.midlayer.input_layernorm, self.midlayer.hidden_norm, self.midlayer.post_attention_layernorm,
                     self.norm):
            _set_eps(norm, self.layer_config.rms_norm_eps)
        self.embed_tokens = None
        if own_embeddings:
            self.embed_tokens = nn.Embedding(self.vocab_size, target.config.hidden_size).requires_grad_(False)
            self._embed = [self.embed_tokens]
        self.config["upstream"] = {"layer_overrides": copy.deepcopy(dict(layer_overrides or {})),
                                   "norm_before_residual": bool(norm_before_residual),
                                   "own_embeddings": bool(own_embeddings)}
        self.to(target.device)
        for p in self.parameters():
            p.data = p.data.to(target.dtype)

    @property
    def norm_before_residual(self) -> bool:
        return self.midlayer.norm_before_residual

    @classmethod
    def from_pretrained(cls, folder, target) -> Eagle3Model:
        """A folder saved by ``save_pretrained`` (kind "eagle3" with an ``"upstream"`` config entry)."""
        config, weights = load_drafter(folder, "eagle3")
        upstream = config.get("upstream")
        if not isinstance(upstream, dict) or not isinstance(config.get("eagle_aux_hidden_state_layer_ids"), list):
            raise ValueError(f"{folder}: not an upstream-layout EAGLE-3 drafter (its config lacks 'upstream')")
        fits(config, target)
        try:
            model = cls(target, aux_layers=config["eagle_aux_hidden_state_layer_ids"],
                        vocab_map=(weights["d2t"], weights["t2d"]), **upstream)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"EAGLE-3 drafter in {folder}: {err}") from None
        conform_linear_biases(model, weights)
        return load_state(model, weights, str(folder))


WRITERS = ("specforge", "serving")  # whose norm_output convention a config follows (``check_norm_output``)


def norm_output_writer(config: dict, written_by: str | None = None) -> str | None:
    """Whose ``norm_output`` convention an EAGLE-3 config (its top level) follows: ``written_by`` when given;
    "serving" for a speculators config (``speculators_model_type``) or vLLM's ``Eagle3LlamaForCausalLM``; None for
    ``LlamaForCausalLMEagle3``, the name SpecForge's trainer and SGLang's server both write."""
    if written_by is not None:
        if written_by not in WRITERS:
            raise ValueError(f"written_by must be one of {WRITERS}, got {written_by!r}")
        return written_by
    if "speculators_model_type" in config or "Eagle3LlamaForCausalLM" in (config.get("architectures") or []):
        return "serving"
    return None


def check_norm_output(top: dict, config: dict, where: str, written_by: str | None = None) -> None:
    """Refuse a ``norm_output`` that asks for something other than EAGLE-3's lm_head(norm(out)). The flag means
    opposite things upstream: SpecForge's trainer (``LlamaForCausalLMEagle3``, default true) reads true as "the
    final norm before lm_head" and false as lm_head on the un-normed output; SGLang's server and speculators
    (default false) read true as EAGLE 3.1's normed output. Absent, every reader builds plain EAGLE-3; present in a
    config whose writer its fields do not name (``norm_output_writer``), it is refused with the flag to pass."""
    if "norm_output" not in config:
        return
    value = bool(config["norm_output"])
    writer = norm_output_writer(top, written_by)
    if writer is None:
        arch = ", ".join(top.get("architectures") or ["no architectures"])
        raise ValueError(f"{where}: norm_output: {str(value).lower()} in a {arch} config is ambiguous: SpecForge's "
                         "trainer reads it as 'the final norm before lm_head' (default true), SGLang's server and "
                         "speculators as EAGLE 3.1's normed output (default false). Say who wrote the file: "
                         "load(..., written_by='specforge') for a SpecForge training checkpoint, "
                         "written_by='serving' for an SGLang serving config (scripts/export_drafter.py --written-by)")
    if writer == "specforge" and not value:
        raise ValueError(f"{where}: norm_output: false (SpecForge: lm_head on the un-normed output, no final norm) is "
                         "not supported")
    if writer == "serving" and value:
        raise ValueError(f"{where}: norm_output: true (EAGLE 3.1's normed output) is not supported")


def eagle3_from_upstream(weights: dict, config: dict, target, where: str, aux_layers=None,
                         written_by: str | None = None) -> Eagle3Model:
    """An EAGLE-3 checkpoint (official, SpecForge, SGLang, vLLM or speculators layout) → an Eagle3Model for
    ``target`` (an ``UpstreamEagle3Model`` where its layer differs from a plain Llama layer of the target's
    sizes). ``written_by`` ("specforge" or "serving"): whose ``norm_output`` convention the config follows, where
    its fields do not say (``check_norm_output``)."""
    weights = normalize_eagle3_keys(weights, where)
    top = config
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{where}: speculators_model_type {config['speculators_model_type']!r} is not supported "
                             "(eagle3 is)")
        if not isinstance(config.get("transformer_layer_config"), dict):
            raise ValueError(f"{where}: a speculators config needs transformer_layer_config (a dict)")
        if "norm_before_residual" not in config:
            raise ValueError(f"{where}: this speculators config lacks norm_before_residual, which vLLM reads as true "
                             "and the speculators library as false; add the value it was trained with")
        config = {**config["transformer_layer_config"], **{k: v for k, v in config.items()
                                                           if k != "transformer_layer_config"}}
    for flag in ("fc_norm", "norm_before_fc"):
        if config.get(flag):
            raise ValueError(f"{where}: {flag}: true (EAGLE 3.1) is not supported")
    check_norm_output(top, config, where, written_by)
    if isinstance(top.get("eagle_config"), dict) and top["eagle_config"].get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state is false (no feature fusion): not supported")
    unknown = sorted(k for k in weights if k not in EAGLE3_TOP_KEYS and not EAGLE3_LAYER_KEY.match(k))
    if unknown:
        why = {why for k in unknown for name, why in EAGLE3_UNSUPPORTED.items() if k.startswith(name)}
        why |= {"more than one decoder layer" for k in unknown if re.match(r"^layers\.[1-9]", k)}
        why = sorted(why)
        raise ValueError(f"{where}: tensors an EAGLE-3 drafter does not have: {', '.join(unknown[:8])}"
                         + (f" ({'; '.join(why)}: not supported)" if why else ""))
    for key in ("fc.weight", "norm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"):
        if key not in weights:
            raise ValueError(f"{where}: missing {key}")
    h, n = target.config.hidden_size, target.config.num_hidden_layers
    fc = weights["fc.weight"]
    if fc.shape[0] != h:
        raise ValueError(f"{where}: the drafter's hidden size is {fc.shape[0]} (fc.weight {tuple(fc.shape)}), the "
                         f"target's {h}; treespec's EAGLE-3 shares the target's token table, so they must be equal")
    if config.get("target_hidden_size") not in (None, h):
        raise ValueError(f"{where}: target_hidden_size {config['target_hidden_size']} (config.json) but the target's "
                         f"hidden size is {h}")
    aux = eagle3_aux_layers(top, n, where, aux_layers)
    if fc.shape[1] != len(aux) * h:
        raise ValueError(f"{where}: fc.weight {tuple(fc.shape)} fuses {fc.shape[1] / h:g} target states of size {h}, "
                         f"but {len(aux)} aux layers {list(aux)} are configured")
    q = weights["midlayer.self_attn.q_proj.weight"]
    if q.shape[1] != 2 * h:
        raise ValueError(f"{where}: midlayer q_proj reads {q.shape[1]} inputs; EAGLE-3's reads 2 × {h}")
    check_vocab(config, target, where)
    vocab = vocab_size_of(target)
    draft_vocab = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else \
        int(config.get("draft_vocab_size") or vocab)
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if t2d is not None and t2d.numel() != vocab:
        raise ValueError(f"{where}: t2d has {t2d.numel()} entries, the target's vocabulary {vocab}")
    if d2t is None and t2d is None:
        if draft_vocab != vocab:
            raise ValueError(f"{where}: a draft vocabulary of {draft_vocab} tokens (target: {vocab}) needs d2t (draft "
                             "id → target id offsets), which is missing")
        d2t, t2d = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    elif d2t is None:
        d2t = DraftVocab(torch.nonzero(t2d.bool()).flatten(), vocab).d2t
    elif t2d is None:
        try:
            t2d = DraftVocab(torch.arange(d2t.numel()) + d2t.long(), vocab).t2d
        except ValueError as err:
            raise ValueError(f"{where}: d2t does not describe a draft vocabulary: {err}") from None
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    if d2t.numel() != draft_vocab:
        raise ValueError(f"{where}: d2t has {d2t.numel()} entries for an lm_head of {draft_vocab} rows")
    values = layer_counts(config, target, "midlayer.", weights, where, head_dim=config.get("head_dim"))
    values["num_hidden_layers"] = 1
    overrides = layer_overrides(target, values)
    own = own_embeddings(weights, target, where)
    nbr = bool(config.get("norm_before_residual", False))
    state = {k: v for k, v in weights.items() if k != "embed_tokens.weight" or own}
    state["d2t"], state["t2d"] = d2t, t2d
    try:
        if overrides or nbr or own:
            model = UpstreamEagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d), layer_overrides=overrides,
                                        norm_before_residual=nbr, own_embeddings=own)
        else:
            model = Eagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    state.setdefault("lm_head.weight", model.lm_head.weight.detach().clone())  # absent: the target's rows
    if conform_linear_biases(model, state, apply=False) and type(model) is Eagle3Model:
        model = UpstreamEagle3Model(target, aux_layers=aux, vocab_map=(d2t, t2d))
    conform_linear_biases(model, state)
    return load_state(model, state, where)
