"""What a drafter checkpoint folder holds: where it is, its weights, and which kind and format they are; the
module read from it (``load_module``). ``treespec.heads.load`` (heads/registry.py) is the entry users call:

    from treespec.heads import load
    drafter = load("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", target)      # a Hub repo id (downloaded), or
    drafter = load("/path/to/folder", target, format="auto")          # a local folder, or reference:<name>
    out = generate(target, input_ids, drafter=drafter, max_new_tokens=128)

``source`` is a local folder, ``reference:<name>`` (treespec/models) or a Hugging Face Hub repo id, fetched
with huggingface_hub (weights and JSON only). The format is read from the files and the tensors' names
and shapes, never from a config's counts alone:

=================  ============================================================================================
format             what identifies it
=================  ============================================================================================
``treespec``       ``{eagle,eagle3,medusa}_config.json`` with ``"drafter"``, beside ``{kind}.safetensors``
``eagle``          EAGLE-1/2 (SafeAILab, vLLM, SGLang): ``fc.weight`` [H, 2H], ``layers.{i}.*``, no ``hidden_norm``
``eagle3``         EAGLE-3 (SafeAILab, SpecForge, SGLang, vLLM, speculators): ``fc.weight``, ``*.hidden_norm.*``
``dflash``         z-lab's DFlash: ``dflash_config`` in config.json, or a top-level ``hidden_norm.weight`` beside
                   ``fc.weight`` and ``layers.{i}.*`` (heads/dflash/upstream.py)
``medusa``         ``medusa_lm_head.{pt,safetensors}`` (Medusa-1, v2), ``medusa_head.*`` (Medusa-2), or
                   vLLM's ``blocks.{h}.layers.{l}.*`` in ``model.safetensors``
``transformers``   a draft model: a ``*ForCausalLM`` config.json, token embeddings and decoder layers, no
                   ``fc.weight`` or ``hidden_norm`` (heads/draft_model/kind.py); read by transformers again
=================  ============================================================================================

Weights are read from ``model.safetensors`` (or its ``.index.json`` shards), else ``pytorch_model.bin``
(or shards), else ``medusa_lm_head.{safetensors,pt}``: safetensors first, and a pickle (``.bin``, ``.pt``)
ONLY with ``torch.load(weights_only=True)``, which builds tensors and plain containers and refuses
anything else. Missing, truncated or corrupt files, NaN/inf tensors, unknown layouts and drafters that do
not fit the target (hidden size, vocabulary, layer count) are errors naming the file and what was found
versus expected. heads/eagle/upstream.py, upstream_eagle3.py and upstream_medusa.py hold the per-format
conversions (and document each layout and the aux-layer conventions). The loaded module names its kind
(``module.kind``), which drives and measures it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from torch import nn

from treespec.heads.kind import DrafterKind
from treespec.io import index_shards, load_safetensors, read_json
from treespec.reference import PREFIX, resolve

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# weight files in the order they are tried; the first present one (with its shards) is read
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.pt"]


# -- where the files are ---------------------------------------------------------------------------------------
def resolve_source(source) -> Path:
    """A local folder, ``reference:<name>``, or a Hub repo id downloaded into the Hugging Face cache."""
    text = str(source)
    if text.startswith(PREFIX):
        return resolve(text)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file; pass the folder that holds it (with its config.json)")
        return path
    if not HUB_ID.match(text):
        raise FileNotFoundError(f"{text!r}: no such folder, and not a Hugging Face Hub repo id (owner/name)")
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline, unknown repo, gated repo, ...: one clear message whatever the cause
        raise FileNotFoundError(
            f"{text!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no detail'}). If this machine is "
            f"offline, download it where there is a network (huggingface-cli download {text} --local-dir DIR), "
            f"copy DIR here and pass the folder: treespec.heads.load('DIR', target)") from None


def load_pickle(path: Path, what: str = "weights") -> dict:
    """A ``.bin`` / ``.pt`` state dict through ``torch.load(weights_only=True)`` only: {name: Tensor}. A file
    that is truncated, corrupt, not a flat dict of tensors, or holds anything weights_only refuses (code, custom
    classes) is a ValueError naming it; so is a NaN/inf tensor."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError (refused objects), RuntimeError / EOFError (truncated zip), ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what} {path} cannot be read with torch.load(weights_only=True) ({type(err).__name__}: "
                         f"{first}); it is truncated or corrupt, or holds objects other than tensors") from None
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in obj.items()):
        raise ValueError(f"{what} {path} is not a state dict (a dict of named tensors): got {type(obj).__name__}")
    for name, tensor in obj.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} {path}: tensor {name!r} holds non-finite values (NaN or inf)")
    return dict(obj)


def _read_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        return load_safetensors(path, "drafter weights")
    return load_pickle(path, "drafter weights")


def read_weights(folder: Path) -> tuple[dict, list[str]]:
    """({name: Tensor}, the files read) from the first weight file of ``WEIGHT_FILES`` in ``folder``."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            shards = index_shards(path)
            absent = [s for s in shards if not (folder / s).is_file()]
            if absent:
                raise ValueError(f"weight index {path} names shards that do not exist: {', '.join(absent)}")
            weights = {}
            for shard in shards:
                weights.update(_read_file(folder / shard))
            return weights, [name, *shards]
        return _read_file(path), [name]
    return {}, []


# -- what the files are -------------------------------------------------------------------------------------------
@dataclass
class Found:
    """A checkpoint folder as read: its format, treespec kind (format "treespec"), config, tensors, files."""

    folder: Path
    format: str
    kind: str | None = None
    config: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.folder} ({', '.join(self.files) or 'no weight file'})"


def formats(kinds) -> tuple[str, ...]:
    """The ``format=`` values ``detect`` takes, given the registry's ``kinds``."""
    return ("auto", "treespec", *(k.upstream_format for k in kinds if k.upstream_format))


def detect(folder, kinds: tuple[DrafterKind, ...], format: str = "auto") -> Found:
    """Read ``folder`` and name its format (``formats(kinds)``) and kind; ``format`` other than "auto" must
    agree with the files. Unrecognised folders are a ValueError listing what is there and what each format
    needs."""
    known = formats(kinds)
    if format not in known:
        raise ValueError(f"format must be one of {known}, got {format!r}")
    folder = Path(folder)
    trained = [k.name for k in kinds if k.module_type is not None and (folder / f"{k.name}_config.json").is_file()]
    if trained:
        if len(trained) > 1:
            raise ValueError(f"{folder} holds treespec configs of several drafters ({', '.join(trained)}): ambiguous")
        config = read_json(folder / f"{trained[0]}_config.json", "drafter config", dict)
        found = Found(folder, "treespec", trained[0], config, files=[f"{trained[0]}.safetensors"])
        return _agree(found, format)
    config = read_json(folder / "config.json", "drafter config", dict) if (folder / "config.json").is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"drafter config {folder / 'config.json'} is not a JSON object")
    weights, files = read_weights(folder)
    found = Found(folder, "unknown", None, config, weights, files)
    if not weights:
        present = sorted(p.name for p in folder.iterdir())[:20] if folder.is_dir() else []
        names = ",".join(k.name for k in kinds if k.module_type is not None)
        raise ValueError(f"{folder}: no drafter weights found (files: {', '.join(present) or 'none'}); expected a "
                         f"treespec folder ({{{names}}}_config.json + .safetensors) or one of "
                         f"{', '.join(WEIGHT_FILES)}")
    for kind in kinds:
        if kind.upstream_format and kind.detects(weights, config, found.where):
            found.format, found.kind = kind.upstream_format, kind.name
            break
    if found.format == "unknown":
        sample = ", ".join(sorted(weights)[:8]) + (", ..." if len(weights) > 8 else "")
        raise ValueError(f"{found.where}: unrecognised drafter layout (tensors: {sample}"
                         "); expected EAGLE-1 (fc.weight [H, 2H] + layers.{i}.*), EAGLE-3 (fc.weight + "
                         "midlayer.* or layers.0.* with hidden_norm), DFlash (fc.weight + hidden_norm.weight + "
                         "layers.{i}.*), Medusa ({h}.{j}.linear.weight), vLLM Medusa (blocks.{h}.layers.{l}.weight) "
                         "or a transformers causal LM (a draft model: config.json architectures *ForCausalLM)")
    return _agree(found, format)


def _agree(found: Found, format: str) -> Found:
    if format not in ("auto", found.format):
        what = f"a treespec {found.kind} drafter" if found.format == "treespec" else f"a {found.format!r} checkpoint"
        raise ValueError(f"format={format!r} was asked for, but {found.where} holds {what}")
    return found


# -- the module ---------------------------------------------------------------------------------------------------
def load_module(source, target, kinds: tuple[DrafterKind, ...], *, format: str = "auto", **options) -> nn.Module:
    """The drafter's module for ``target`` from ``source`` (a folder, ``reference:<name>`` or a Hub repo id),
    read by the kind ``detect`` finds among ``kinds``. ``options``: per-format keywords (EAGLE-3's
    ``aux_layers``, ``written_by``), refused for the formats without them."""
    folder = resolve_source(source)
    found = detect(folder, kinds, format)
    kind = next(k for k in kinds if k.name == found.kind)
    for name, value in options.items():
        if value is not None and (found.format == "treespec" or name not in kind.upstream_options):
            takers = " or ".join(k.title or k.name for k in kinds if name in k.upstream_options)
            raise ValueError(f"{name} applies to upstream {takers} checkpoints; {found.where} is {found.format!r}")
    if found.format == "treespec":
        return kind.load_folder(folder, found.config, target)
    if kind.needs_config_json and not (folder / "config.json").is_file():
        raise ValueError(f"{found.where}: EAGLE checkpoints come with a config.json (heads, RoPE, norms), and this "
                         "folder has none")
    return kind.from_upstream(found, target, **options)
