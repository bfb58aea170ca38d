"""The shipped reference models: a ~15M-parameter Llama target and a ~1.5M draft, trained here on the
Python standard library (see treespec/models/MODEL_CARD.md), drafters for the target, held-out code
prompts; and the one loader every job uses for a model named in a config.

    target, tokenizer = treespec.reference.load("target")
    draft, _ = treespec.reference.load("draft")
    prompts = treespec.reference.prompts()        # held-out stdlib code, as text
    model, tokenizer = treespec.reference.load_model("reference:target")   # or a transformers model folder
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODELS_DIR = Path(__file__).resolve().parent / "models"
NAMES = ("target", "draft")
PREFIX = "reference:"


def resolve(spec: str | Path) -> Path:
    """``reference:<name>`` (a folder under treespec/models) or a path → the folder; a missing one is named."""
    spec = str(spec)
    folder = MODELS_DIR / spec[len(PREFIX):] if spec.startswith(PREFIX) else Path(spec)
    if not folder.is_dir():
        shipped = sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir())
        raise FileNotFoundError(f"{spec!r}: no folder at {folder} (shipped: {', '.join(PREFIX + s for s in shipped)}; "
                                "or give a local folder)")
    return folder


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
    return load_model(path(name), dtype=dtype, attn_implementation=attn_implementation)


def load_model(spec: str | Path, *, dtype: torch.dtype | str = torch.float32, attn_implementation: str = "sdpa"):
    """(model in eval mode, tokenizer) from ``reference:<name>`` or a transformers model folder. A folder
    that transformers cannot read, or weights with NaN/inf, is an error naming the folder."""
    folder = resolve(spec)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: not a transformers model folder")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot load the model in {folder}: {err}") from err
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"the weights in {folder} hold NaN or infinite values ({', '.join(bad[:3])}): corrupt file?")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot load the tokenizer in {folder}: {err}") from err
    return model.eval(), tokenizer


def prompts(split: str = "test") -> list[str]:
    """Held-out code prompts (from validation-split stdlib files, never trained on)."""
    with open(MODELS_DIR / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["text"] for r in rows if r["split"] == split]
