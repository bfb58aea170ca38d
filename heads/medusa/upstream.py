"""Medusa heads as other projects write and read them, converted to and from treespec's ``MedusaHeads``.

* **Medusa-1** (FasterDecoding/Medusa ``medusa_model.py``): ``medusa_lm_head.pt``, ``torch.save`` of the
  heads' ModuleList: head h is ``Sequential(ResBlock × L, Linear(H, V, bias=False))`` with
  ``ResBlock(x) = x + SiLU(Linear(H, H)(x))``, so the keys are ``{h}.{j}.linear.weight/bias`` (j < L) and
  ``{h}.{L}.weight``. The code repeats ONE ResBlock object L times per head (tied weights; the file holds
  the same tensors under every j). ``medusa_num_heads`` in published configs is not always the number of
  heads in the file: the keys decide. Head h predicts token t + 2 + h from the final-norm feature at t, as
  treespec's head h does.
* **"v2"** (TGI ``MedusaHeadV2``): ``medusa_lm_head.safetensors`` with residual blocks only (``{h}.0.linear``);
  every head projects with the target's own lm_head.
* **Medusa-2** folders hold ``medusa_head.{h}.{j}...`` beside the base model's weights: the prefix is
  stripped and the base weights are ignored (load the fine-tuned base model as the target).
* **vLLM** (``model_executor/models/medusa.py``): ``blocks.{h}.layers.{l}.weight`` (+ ``.bias`` only when
  config ``medusa_fc_bias`` is true, default false), ``lm_heads.{h}.weight``, or one shared ``lm_head.weight``
  with ``original_lm_head: true``; ``token_map`` / ``truncated_vocab_size`` < vocab (a reduced vocabulary)
  is not supported here.

Pickle files are only ever read with ``torch.load(weights_only=True)`` (heads/checkpoints/detect.py).
"""

from __future__ import annotations

import re

import torch

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.checkpoints.upstream_common import Refused, dtype_name, verifier_name
from treespec.heads.medusa.network import MedusaHeads
from treespec.io import check_float_weights

MEDUSA1_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
MEDUSA1_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")


def strip_medusa_prefix(weights: dict) -> dict:
    """Medusa-2 (``medusa_head.``) and vLLM-internal (``medusa_heads.``) prefixes removed; when a prefix is in
    use, keys without it (the base model's weights beside the heads) are left out."""
    for prefix in ("medusa_head.", "medusa_heads."):
        if any(k.startswith(prefix) for k in weights):
            return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    return dict(weights)


def medusa_layout(weights: dict) -> str | None:
    """"medusa" (Medusa-1 or v2 keys), "vllm" (vLLM's MedusaModel keys) or None."""
    keys = set(strip_medusa_prefix(weights))
    if keys and any(VLLM_BLOCK.match(k) for k in keys):
        return "vllm"
    if keys and any(MEDUSA1_BLOCK.match(k) for k in keys):
        return "medusa"
    return None


def _contiguous(values, what: str, where: str) -> int:
    values = sorted(set(values))
    if values != list(range(len(values))):
        raise ValueError(f"{where}: {what} {values} are not numbered 0..{len(values) - 1}")
    return len(values)


def _all_or_no_biases(blocks: dict, where: str) -> None:
    """Every residual block has its bias, or none has: a deleted one would load as zeros, silently."""
    with_bias = {k for k, b in blocks.items() if "bias" in b}
    if with_bias and len(with_bias) < len(blocks):
        absent = ", ".join(f"head {a} block {b}" for a, b in sorted(set(blocks) - with_bias))
        raise ValueError(f"{where}: residual block biases are missing for {absent} (the other blocks have theirs)")


def medusa_from_upstream(weights: dict, config: dict, target, where: str) -> MedusaHeads:
    """Medusa-1, v2, Medusa-2 or vLLM Medusa tensors (+ config.json) → ``MedusaHeads`` for ``target``."""
    weights = strip_medusa_prefix(weights)
    layout = medusa_layout(weights)
    h, vocab = target.config.hidden_size, vocab_size_of(target)
    blocks, heads, shared = {}, {}, None  # (head, layer) → {"weight", "bias"}; head → lm_head
    if layout == "medusa":
        for key, value in weights.items():
            if m := MEDUSA1_BLOCK.match(key):
                blocks.setdefault((int(m[1]), int(m[2])), {})[m[3]] = value
            elif m := MEDUSA1_HEAD.match(key):
                heads[(int(m[1]), int(m[2]))] = value
            else:
                raise ValueError(f"{where}: {key!r} is not a Medusa head tensor ({{head}}.{{j}}.linear.weight/bias or "
                                 "{head}.{L}.weight)")
    elif layout == "vllm":
        if "token_map" in weights or int(config.get("truncated_vocab_size") or vocab) < vocab:
            raise ValueError(f"{where}: a reduced Medusa vocabulary (token_map / truncated_vocab_size) is not "
                             "supported")
        for key, value in weights.items():
            if m := VLLM_BLOCK.match(key):
                blocks.setdefault((int(m[1]), int(m[2])), {})[m[3]] = value
            elif m := VLLM_HEAD.match(key):
                heads[(int(m[1]), None)] = value
            elif key == "lm_head.weight":
                shared = value
            else:
                raise ValueError(f"{where}: {key!r} is not a vLLM Medusa tensor "
                                 "(blocks.{h}.layers.{l}.weight/bias, lm_heads.{h}.weight, lm_head.weight)")
        has_bias = any("bias" in b for b in blocks.values())
        if "medusa_fc_bias" in config and bool(config["medusa_fc_bias"]) != has_bias:
            raise ValueError(f"{where}: config.json says medusa_fc_bias {config['medusa_fc_bias']} but the block "
                             f"biases are {'present' if has_bias else 'missing'}")
    else:
        raise ValueError(f"{where}: no Medusa head tensors ({{h}}.{{j}}.linear.weight or "
                         "blocks.{h}.layers.{l}.weight)")
    _all_or_no_biases(blocks, where)
    num_heads = _contiguous([k[0] for k in blocks], "heads", where)
    per_head = {}
    for (head, layer) in blocks:
        per_head.setdefault(head, []).append(layer)
    counts = {head: _contiguous(layers, f"residual blocks of head {head}", where) for head, layers in per_head.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"{where}: heads have different numbers of residual blocks {counts}; treespec's are uniform")
    num_layers = next(iter(counts.values()))
    if layout == "medusa":
        bad = [f"{a}.{b}" for a, b in heads if b != num_layers or a >= num_heads]
        if bad:
            raise ValueError(f"{where}: lm_head tensors {bad} do not sit after {num_layers} residual block(s) of heads "
                             f"0..{num_heads - 1}")
        heads = {a: v for (a, _), v in heads.items()}
    else:
        heads = {a: v for (a, _), v in heads.items()}
        if shared is not None:
            heads = {a: shared for a in range(num_heads)}
    if heads and sorted(heads) != list(range(num_heads)):
        raise ValueError(f"{where}: lm_heads for heads {sorted(heads)} but residual blocks for heads "
                         f"0..{num_heads - 1}")
    for (head, layer), tensors in blocks.items():
        w = tensors.get("weight")
        if w is None or tuple(w.shape) != (h, h) or ("bias" in tensors and tuple(tensors["bias"].shape) != (h,)):
            raise ValueError(f"{where}: residual block {layer} of head {head} is "
                             f"{tuple(w.shape) if w is not None else 'missing its weight'}; a head for this target "
                             f"(hidden size {h}) has [{h}, {h}] weights and [{h}] biases")
    for head, w in heads.items():
        if tuple(w.shape) != (vocab, h):
            raise ValueError(f"{where}: lm_head of head {head} is {tuple(w.shape)}; this target needs [{vocab}, {h}] "
                             f"(vocabulary × hidden size)")
    lm_head = target.get_output_embeddings()
    share = not heads or all(torch.equal(w.to(lm_head.weight.dtype).cpu(), lm_head.weight.detach().cpu())
                             for w in heads.values())
    model = MedusaHeads(h, vocab, num_heads=num_heads, num_layers=num_layers, share_lm_head=share, lm_head=lm_head)
    state = {}
    for (head, layer), tensors in blocks.items():
        state[f"blocks.{head}.{layer}.linear.weight"] = tensors["weight"]
        state[f"blocks.{head}.{layer}.linear.bias"] = tensors.get("bias", torch.zeros(h, dtype=tensors["weight"].dtype))
    if not share:
        state.update({f"projections.{head}.weight": w for head, w in heads.items()})
    check_float_weights(state, model, where)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"{where}: the tensors do not fit Medusa heads: {err}") from None
    return model.to(device=target.device, dtype=target.dtype).eval()


def medusa_to_upstream(heads: MedusaHeads, target, consumer: str, *, verifier: str | None = None) -> tuple[dict, dict]:
    """(config.json, tensors) of Medusa heads for ``consumer``: "medusa" (FasterDecoding/Medusa's
    ``medusa_lm_head.pt``) or "vllm" (its MedusaModel)."""
    cfg = heads.config
    n, layers, h, vocab = cfg["num_heads"], cfg["num_layers"], cfg["hidden_size"], cfg["vocab_size"]
    sd = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    lm_head = target.get_output_embeddings().weight.detach().to(heads.blocks[0][0].linear.weight.dtype).cpu()
    projection = {k: (lm_head if heads.projections is None else sd[f"projections.{k}.weight"]) for k in range(n)}
    # FasterDecoding/Medusa loads the base model by this name; vLLM ignores it
    name = verifier_name(target, verifier, "FasterDecoding/Medusa", required=consumer == "medusa")
    dtype = dtype_name(heads.blocks[0][0].linear.weight.dtype)
    if consumer == "medusa":
        for k in range(n):
            first = [sd[f"blocks.{k}.0.linear.{p}"] for p in ("weight", "bias")]
            for j in range(1, layers):
                if not all(torch.equal(a, sd[f"blocks.{k}.{j}.linear.{p}"]) for a, p in zip(first, ("weight", "bias"),
                                                                                               strict=True)):
                    raise Refused("FasterDecoding/Medusa repeats one residual block per head (tied weights); head "
                                  f"{k}'s {layers} blocks differ")
        tensors = {}
        for k in range(n):
            for j in range(layers):
                tensors[f"{k}.{j}.linear.weight"] = sd[f"blocks.{k}.{j}.linear.weight"]
                tensors[f"{k}.{j}.linear.bias"] = sd[f"blocks.{k}.{j}.linear.bias"]
            tensors[f"{k}.{layers}.weight"] = projection[k].clone()
        config = {"medusa_num_heads": n, "medusa_num_layers": layers, "base_model_name_or_path": name,
                  "hidden_size": h, "vocab_size": vocab, "torch_dtype": dtype}
        return config, tensors
    if consumer == "vllm":
        bias = any(bool(sd[f"blocks.{k}.{j}.linear.bias"].abs().gt(0).any()) for k in range(n) for j in range(layers))
        tensors = {}
        for k in range(n):
            for j in range(layers):
                tensors[f"blocks.{k}.layers.{j}.weight"] = sd[f"blocks.{k}.{j}.linear.weight"]
                if bias:
                    tensors[f"blocks.{k}.layers.{j}.bias"] = sd[f"blocks.{k}.{j}.linear.bias"]
        if heads.projections is None:
            tensors["lm_head.weight"] = lm_head.clone()
        else:
            tensors.update({f"lm_heads.{k}.weight": projection[k] for k in range(n)})
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": h, "vocab_size": vocab,
                  "num_heads": n, "num_hidden_layers": layers, "truncated_vocab_size": vocab, "medusa_fc_bias": bias,
                  "original_lm_head": heads.projections is None, "base_model_name_or_path": name, "torch_dtype": dtype}
        return config, tensors
    raise Refused(f"{consumer} does not load Medusa heads; export them to 'medusa' or 'vllm'")
