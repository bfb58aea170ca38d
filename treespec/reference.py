"""The shipped reference models: a ~15M-parameter Llama target and a ~1.5M draft, trained here on the
Python standard library (see treespec/models/MODEL_CARD.md), plus held-out code prompts.

    target, tokenizer = treespec.reference.load("target")
    draft, _ = treespec.reference.load("draft")
    prompts = treespec.reference.prompts()        # held-out stdlib code, as text
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MODELS_DIR = Path(__file__).resolve().parent / "models"
NAMES = ("target", "draft")


def path(name: str) -> Path:
    if name not in NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose one of {NAMES}")
    folder = MODELS_DIR / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reference model {name!r} is not installed at {folder}")
    return folder


def load(name: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """(model, tokenizer) for a reference model, in eval mode. Weights are stored in bf16 and upcast to
    ``dtype`` (float32 is fastest on CPUs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = path(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def prompts(split: str = "test") -> list[str]:
    """Held-out code prompts (from validation-split stdlib files, never trained on)."""
    with open(MODELS_DIR / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["text"] for r in rows if r["split"] == split]
