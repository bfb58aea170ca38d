"""One entry for every drafter checkpoint: ``load(source, target)`` → a ready ``Drafter``; the drafter
registry's "auto" kind (``AUTO``) is the same entry.

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
``medusa``         ``medusa_lm_head.{pt,safetensors}`` (Medusa-1, v2), ``medusa_head.*`` (Medusa-2), or
                   vLLM's ``blocks.{h}.layers.{l}.*`` in ``model.safetensors``
=================  ============================================================================================

Weights are read from ``model.safetensors`` (or its ``.index.json`` shards), else ``pytorch_model.bin``
(or shards), else ``medusa_lm_head.{safetensors,pt}``: safetensors first, and a pickle (``.bin``, ``.pt``)
ONLY with ``torch.load(weights_only=True)``, which builds tensors and plain containers and refuses
anything else. Missing, truncated or corrupt files, NaN/inf tensors, unknown layouts and drafters that do
not fit the target (hidden size, vocabulary, layer count) are errors naming the file and what was found
versus expected. heads/upstream_eagle.py, upstream_eagle3.py and upstream_medusa.py hold the per-format
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

from treespec.autotree import read_cost_curve, saved_chooser
from treespec.drafter import CANDIDATE_MODES, Drafter
from treespec.io import index_shards, load_safetensors, read_json
from treespec.reference import PREFIX, resolve

from . import eagle, eagle3, medusa
from .accuracy import read_accuracy
from .eagle3_model import Eagle3Model
from .eagle_model import EagleModel
from .kind import DrafterKind
from .medusa import MedusaHeads
from .upstream import strip_model_prefix
from .upstream_eagle import eagle_from_upstream, is_eagle1
from .upstream_eagle3 import UpstreamEagle3Model, eagle3_from_upstream, is_eagle3, normalize_eagle3_keys
from .upstream_medusa import medusa_from_upstream, medusa_layout

FORMATS = ("auto", "treespec", "eagle", "eagle3", "medusa")
TREESPEC_KINDS = ("eagle", "eagle3", "medusa")
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


def detect(folder, format: str = "auto") -> Found:
    """Read ``folder`` and name its format (``FORMATS``); ``format`` other than "auto" must agree with the
    files. Unrecognised folders are a ValueError listing what is there and what each format needs."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    folder = Path(folder)
    kinds = [k for k in TREESPEC_KINDS if (folder / f"{k}_config.json").is_file()]
    if kinds:
        if len(kinds) > 1:
            raise ValueError(f"{folder} holds treespec configs of several drafters ({', '.join(kinds)}): ambiguous")
        config = read_json(folder / f"{kinds[0]}_config.json", "drafter config", dict)
        found = Found(folder, "treespec", kinds[0], config, files=[f"{kinds[0]}.safetensors"])
        return _agree(found, format)
    config = read_json(folder / "config.json", "drafter config", dict) if (folder / "config.json").is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"drafter config {folder / 'config.json'} is not a JSON object")
    weights, files = read_weights(folder)
    found = Found(folder, "unknown", None, config, weights, files)
    if not weights:
        present = sorted(p.name for p in folder.iterdir())[:20] if folder.is_dir() else []
        raise ValueError(f"{folder}: no drafter weights found (files: {', '.join(present) or 'none'}); expected a "
                         f"treespec folder ({{eagle,eagle3,medusa}}_config.json + .safetensors) or one of "
                         f"{', '.join(WEIGHT_FILES)}")
    if medusa_layout(weights) is not None:
        found.format = "medusa"
    else:
        keys = strip_model_prefix(weights, found.where)
        if config.get("speculators_model_type") is not None or is_eagle3(normalize_eagle3_keys(weights, found.where)):
            found.format = "eagle3"
        elif is_eagle1(keys):
            found.format = "eagle"
    if found.format == "unknown":
        sample = ", ".join(sorted(weights)[:8]) + (", ..." if len(weights) > 8 else "")
        raise ValueError(f"{found.where}: unrecognised drafter layout (tensors: {sample}"
                         "); expected EAGLE-1 (fc.weight [H, 2H] + layers.{i}.*), EAGLE-3 (fc.weight + "
                         "midlayer.* or layers.0.* with hidden_norm), Medusa ({h}.{j}.linear.weight) or vLLM Medusa "
                         "(blocks.{h}.layers.{l}.weight)")
    return _agree(found, format)


def _agree(found: Found, format: str) -> Found:
    if format not in ("auto", found.format):
        what = f"a treespec {found.kind} drafter" if found.format == "treespec" else f"a {found.format!r} checkpoint"
        raise ValueError(f"format={format!r} was asked for, but {found.where} holds {what}")
    return found


# -- the entry ----------------------------------------------------------------------------------------------------
def load_module(source, target, *, format: str = "auto", aux_layers=None, written_by: str | None = None) -> nn.Module:
    """The drafter's module (EagleModel, Eagle3Model or MedusaHeads) for ``target`` from ``source`` (see
    ``load``)."""
    folder = resolve_source(source)
    found = detect(folder, format)
    for name, value in (("aux_layers", aux_layers), ("written_by", written_by)):
        if value is not None and found.format != "eagle3":
            raise ValueError(f"{name} applies to upstream EAGLE-3 checkpoints; {found.where} is {found.format!r}")
    if found.format == "treespec":
        if found.kind == "eagle":
            return EagleModel.from_pretrained(folder, target)
        if found.kind == "eagle3":
            if "upstream" in found.config:
                return UpstreamEagle3Model.from_pretrained(folder, target)
            return Eagle3Model.from_pretrained(folder, target)
        return MedusaHeads.from_pretrained(folder, target)
    if found.format == "eagle":
        _needs_config(found)
        return eagle_from_upstream(found.weights, found.config, target, found.where)
    if found.format == "eagle3":
        _needs_config(found)
        return eagle3_from_upstream(found.weights, found.config, target, found.where, aux_layers=aux_layers,
                                    written_by=written_by)
    return medusa_from_upstream(found.weights, found.config, target, found.where)


def _needs_config(found: Found) -> None:
    if not (found.folder / "config.json").is_file():
        raise ValueError(f"{found.where}: EAGLE checkpoints come with a config.json (heads, RoPE, norms), and this "
                         "folder has none")


class AutoKind(DrafterKind):
    """"auto": any checkpoint ``load_module`` reads, driven and measured as the kind of module it turns out to be
    (``module.kind``: eagle, eagle3 or medusa)."""

    name = "auto"
    candidate_modes = CANDIDATE_MODES
    kinds = {kind.name: kind for kind in (eagle.KIND, eagle3.KIND, medusa.KIND)}

    def kind_of(self, module) -> DrafterKind:
        kind = self.kinds.get(getattr(module, "kind", None))
        if kind is None:
            raise TypeError(f"drafter 'auto' loaded a {type(module).__name__}, which it cannot drive")
        return kind

    def load(self, source, target, *, format: str = "auto", aux_layers=None,
             written_by: str | None = None) -> nn.Module:
        return load_module(source, target, format=format, aux_layers=aux_layers, written_by=written_by)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Drafter:
        return self.kind_of(module).make(module, candidates, draft_vocab, lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]] | None:
        return self.kind_of(module).rank_accuracy(target, module, windows, **options)

    def max_depth(self, module) -> int | None:
        return self.kind_of(module).max_depth(module)


AUTO = AutoKind()


def load(source, target, *, format: str = "auto", aux_layers=None, written_by: str | None = None,
         candidates: str = "topk") -> Drafter:
    """A ready Drafter for ``target`` from ``source``: a local folder, ``reference:<name>`` or a Hugging Face Hub
    repo id. ``format``: "auto" (detect), "treespec", "eagle" (EAGLE-1/2), "eagle3" or "medusa"; ``aux_layers``:
    the target hidden-state indices an EAGLE-3 checkpoint fuses, when its config does not say (treespec's
    convention: ``hidden_states[i]`` is the input of decoder layer i); ``written_by``: "specforge" or "serving",
    whose convention an EAGLE-3 config's ``norm_output`` follows where its fields do not say
    (heads/upstream_eagle3.py); ``candidates``: "topk" or "sample"."""
    folder = resolve_source(source)  # a Hub id is fetched once
    module = AUTO.load(folder, target, format=format, aux_layers=aux_layers, written_by=written_by)
    return with_measurements(AUTO.make(module, candidates), folder)


def with_measurements(drafter: Drafter, source) -> Drafter:
    """``drafter`` with what its folder holds beside the weights: its measured accuracies (head_accuracy.json) and
    this device's cost curve (cost_curve.json), so that generate() can grow ``{"kind": "accuracy"}`` and
    ``{"kind": "auto"}`` trees for it (treespec.tree_spec)."""
    folder = resolve_source(source)
    drafter.accuracy = read_accuracy(folder)
    curve = read_cost_curve(folder)
    drafter.tree_chooser = saved_chooser(curve) if curve is not None else None
    return drafter

