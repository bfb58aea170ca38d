"""Trained drafter folders: ``{kind}_config.json`` (with ``"drafter": kind``) beside ``{kind}.safetensors``,
and the one check every drafter makes against the target it is given (``check_fits_target``).

Weights are safetensors only (no pickle is ever loaded), written atomically; the accuracy file that may
sit beside them is heads/training/accuracy.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treespec.io import atomic_write, atomic_write_json, load_safetensors, read_json

# Target config values a drafter's weights depend on (llama/qwen2/mistral names and GPT-2's); a drafter
# is refused by a target that differs in any of them.
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "activation_function",
                     "n_inner", "rms_norm_eps", "layer_norm_epsilon", "attention_bias", "mlp_bias", "rope_parameters")

# what a refused drafter's error tells the user to change
FIX = ("load a drafter trained for this target (in the comparison, scripts/compare_trees.py: set "
       "available.<name>.source to its folder)")


def vocab_size_of(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def architecture(target) -> dict:
    """The target's architecture values (JSON-normalised) that a drafter trained for it must match."""
    config = target.config
    arch = {k: getattr(config, k) for k in ARCHITECTURE_KEYS if getattr(config, k, None) is not None}
    arch["vocab_size"] = vocab_size_of(target)
    return json.loads(json.dumps(arch))


def check_fits_target(kind: str, saved: dict, actual: dict, problems: tuple[str, ...] = ()) -> None:
    """Raise ValueError if a ``kind`` drafter ("EAGLE", "Medusa", ...) does not fit the target: every value
    where ``saved`` (what it was trained for) and ``actual`` (the target's) differ, plus ``problems`` found
    otherwise, and the fix."""
    keys = sorted(saved.keys() | actual.keys())
    diffs = [f"{k} {saved.get(k)!r} (drafter) vs {actual.get(k)!r} (target)" for k in keys
             if saved.get(k) != actual.get(k)]
    diffs += problems
    if diffs:
        raise ValueError(f"this {kind} drafter was trained for another target: {', '.join(diffs)}; {FIX}")


def check_same_vocab(draft, target, what: str = "drafter") -> None:
    v_draft, v_target = vocab_size_of(draft), vocab_size_of(target)
    if v_draft != v_target:
        raise ValueError(
            f"{what} vocabulary ({v_draft} tokens) differs from the target's ({v_target} tokens): "
            "draft and target must share one tokenizer"
        )


def save_drafter(module: torch.nn.Module, folder, kind: str, config: dict) -> None:
    folder = Path(folder)
    weights = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    atomic_write(folder / f"{kind}.safetensors", lambda tmp: save_file(weights, str(tmp)))
    atomic_write_json(folder / f"{kind}_config.json", {"drafter": kind, **config}, indent=2)


def load_drafter(folder, kind: str) -> tuple[dict, dict]:
    """(config without "drafter", state_dict) of a saved ``kind`` drafter; another kind is refused (ValueError)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter folder {folder} does not exist")
    config = read_json(folder / f"{kind}_config.json", f"{kind} drafter config", dict)
    if config.pop("drafter", kind) != kind:
        raise ValueError(f"{folder} does not hold a {kind} drafter")
    return config, load_safetensors(folder / f"{kind}.safetensors", f"{kind} drafter weights")
