"""A fresh draft model for a given target (SpS; Leviathan et al. 2023, Chen et al. 2023): a small
``LlamaForCausalLM`` with the target's vocabulary, special token ids and position range, tied embeddings, and the
size ``drafter.arch`` gives (conf/drafter/draft.yaml). Its tied embedding starts random or from the target's
(``init: target_embeddings``): copied when the widths agree, else the target's embedding projected on its top
principal directions, a fixed projection of the target's own token geometry that gives the small model a head
start. heads/draft_model/objective.py trains it; its export is a plain transformers folder.

    model = new_draft_model(target, {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                                     "num_attention_heads": 4, "num_key_value_heads": 4}, "target_embeddings")
"""

from __future__ import annotations

import numbers

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.inputs import max_positions

INITS = ("random", "target_embeddings")
# the LlamaConfig values drafter.arch may set (vocabulary and special tokens are the target's, never set here)
INTEGER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "initializer_range")
ARCH_KEYS = (*INTEGER_KEYS, *NUMBER_KEYS, "hidden_act", "tie_word_embeddings")


def check_arch(arch: dict) -> None:
    """Refuse a ``drafter.arch`` that cannot build a Llama, naming the key: unknown keys, missing sizes, counts
    that are not positive integers, heads that do not divide the width or the key/value heads."""
    if not isinstance(arch, dict):
        raise ValueError(f"drafter.arch must be a mapping of LlamaConfig values, got {arch!r}")
    unknown = sorted(set(arch) - set(ARCH_KEYS))
    if unknown:
        raise ValueError(f"drafter.arch: unknown key(s) {', '.join(unknown)}; it takes {', '.join(ARCH_KEYS)} (the "
                         "vocabulary and special token ids are the target's)")
    missing = [k for k in REQUIRED_KEYS if arch.get(k) is None]
    if missing:
        raise ValueError(f"drafter.arch needs {', '.join(missing)}")
    for key in INTEGER_KEYS:
        value = arch.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"drafter.arch.{key} must be an integer >= 1, got {value!r}")
    for key in NUMBER_KEYS:
        value = arch.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0):
            raise ValueError(f"drafter.arch.{key} must be a number > 0, got {value!r}")
    if not isinstance(arch.get("tie_word_embeddings", True), bool):
        raise ValueError(f"drafter.arch.tie_word_embeddings must be true or false, got {arch['tie_word_embeddings']!r}")
    heads = arch["num_attention_heads"]
    if arch.get("head_dim") is None and arch["hidden_size"] % heads:
        raise ValueError(f"drafter.arch.hidden_size={arch['hidden_size']} must be a multiple of num_attention_heads="
                         f"{heads} (or set head_dim)")
    kv = arch.get("num_key_value_heads") or heads
    if heads % kv:
        raise ValueError(f"drafter.arch.num_attention_heads={heads} must be a multiple of num_key_value_heads={kv}")


def draft_config(target, arch: dict) -> LlamaConfig:
    """The draft's config: ``arch`` over what the target fixes (its vocabulary and special token ids) and what it
    suggests (its position range and RoPE base: the draft reads the same positions the target does)."""
    check_arch(arch)
    tc = target.config
    rope = getattr(tc, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    values = {"max_position_embeddings": max_positions(tc) or 2048, "tie_word_embeddings": True,
              **({"rope_theta": theta} if theta else {}), **arch}
    heads = values.pop("num_attention_heads")
    return LlamaConfig(vocab_size=vocab_size_of(target), num_attention_heads=heads,
                       num_key_value_heads=values.pop("num_key_value_heads", None) or heads,
                       bos_token_id=getattr(tc, "bos_token_id", None), eos_token_id=getattr(tc, "eos_token_id", None),
                       pad_token_id=getattr(tc, "pad_token_id", None), **values)


@torch.no_grad()
def principal_embedding(embedding: torch.Tensor, width: int) -> torch.Tensor:
    """The rows of ``embedding`` [V, H], centred, projected on its ``width`` top principal directions → [V, width]
    (float32). The directions are the covariance's leading eigenvectors (float64, [H, H]: cheap for any vocabulary),
    each signed so its largest entry is positive: a fixed function of the target's weights."""
    e = embedding.detach().double()
    centred = e - e.mean(0)
    _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
    top = vectors[:, -width:].flip(-1)  # [H, width], the largest first
    signs = torch.sign(top.gather(0, top.abs().argmax(0, keepdim=True)))
    return (centred @ (top * signs)).float()


def matmul_weights(model) -> int:
    """Weights a token's forward multiplies by (every matrix but the input embedding, whose rows are looked up; a tied
    embedding counts once, as the head): the per-token cost of a memory-bound pass, for comparing a draft with its
    target."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not emb)
    return total + (head.numel() if head is emb else 0)


def new_draft_model(target, arch: dict, init: str = "random") -> LlamaForCausalLM:
    """A fresh draft for ``target`` (module docstring), its weights drawn from the global RNG (the job seeds it),
    on the target's device, float32."""
    if init not in INITS:
        raise ValueError(f"drafter.init must be one of {', '.join(INITS)}, got {init!r}")
    model = LlamaForCausalLM(draft_config(target, arch))
    if init == "target_embeddings":
        source = target.get_input_embeddings().weight
        width, target_width = model.config.hidden_size, source.shape[1]
        if width > target_width:
            raise ValueError(f"drafter.init=target_embeddings needs drafter.arch.hidden_size <= the target's hidden "
                             f"size {target_width}, got {width}: use init=random or a narrower draft")
        rows = source.detach().float() if width == target_width else principal_embedding(source, width)
        n = min(rows.shape[0], model.config.vocab_size)  # a target's embedding may have rows past its head's
        model.get_input_embeddings().weight.data[:n] = rows[:n].to(model.dtype)
    return model.to(target.device)
