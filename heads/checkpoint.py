"""Trained drafter folders: ``{kind}_config.json`` (with ``"drafter": kind``) beside ``{kind}.safetensors``,
and the checks a drafter makes against the target it is given.

Weights are safetensors only (no pickle is ever loaded), written atomically; the accuracy file that may
sit beside them is heads/accuracy.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from treespec.io import atomic_write, atomic_write_json, load_safetensors, read_json


def vocab_size_of(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


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
    config = read_json(folder / f"{kind}_config.json", f"{kind} drafter config")
    if config.pop("drafter", kind) != kind:
        raise ValueError(f"{folder} does not hold a {kind} drafter")
    return config, load_safetensors(folder / f"{kind}.safetensors", f"{kind} drafter weights")
