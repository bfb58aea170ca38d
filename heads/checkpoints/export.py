"""Export a treespec drafter in the layout another project loads: ``export(drafter, target, out_dir, to=...)``.

=============  ==========================================  ===========================  ===================
``to``         EagleModel (variant "upstream")             Eagle3Model                  MedusaHeads
=============  ==========================================  ===========================  ===================
sglang         ``LlamaForCausalLMEagle``                   ``LlamaForCausalLMEagle3``   refused
vllm           ``EagleLlamaForCausalLM``                   ``Eagle3LlamaForCausalLM``   ``MedusaModel``
speculators    refused (vLLM reads eagle3 only)            ``Eagle3Speculator``         refused
eagle          SafeAILab/EAGLE (``pytorch_model.bin``)     SafeAILab/EAGLE EAGLE-3      refused
medusa         refused                                     refused                      ``medusa_lm_head.pt``
=============  ==========================================  ===========================  ===================

Each folder holds exactly the files that consumer reads (``config.json`` and one weight file: ``model.safetensors``,
or the pickle the original project reads: ``pytorch_model.bin`` for EAGLE-1, ``medusa_lm_head.pt`` for Medusa-1),
and the hidden list of what the export wrote (``MANIFEST``): an export never replaces a file it did not write unless
asked to (``overwrite``). The tensors carry the consumer's names, the config its architecture name, aux-layer ids in
its convention (heads/eagle3/upstream.py), RoPE as ``rope_parameters`` mirrored into ``rope_theta`` /
``rope_scaling``, ``max_position_embeddings`` at least the target's, and biases exactly as its loader builds them
(zeros where it expects one the drafter lacks). What a consumer cannot represent is refused with the reason
(``Refused``, a ValueError): a treespec-variant or fused EAGLE-1 drafter, a nonzero bias its loader would drop, aux
layers it cannot capture, norm_before_residual where it has none, a token table of the drafter's own where it uses
the target's. """

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from treespec.drafter import Drafter
from treespec.heads import registry
from treespec.io import atomic_write, atomic_write_json, folder_path, read_json

CONSUMERS = ("sglang", "vllm", "speculators", "eagle", "medusa")
# the list of files an export wrote, beside them: what a re-export into the same folder may replace
MANIFEST = ".treespec_export.json"  # hidden: consumers read config.json and the weights only
FOREIGN = ("*.safetensors", "*.bin", "*.pt", "*.index.json", "*_config.json")


def module_of(drafter_or_module) -> nn.Module:
    """The module inside a Drafter (Eagle / Eagle3: ``.model``; Medusa, Hydra: ``.heads``), or the module itself. A
    kind without an upstream layout (Hydra) is returned too: its ``to_upstream`` refuses every consumer."""
    exportable = tuple(k.module_type for k in registry.KINDS if k.module_type is not None)
    names = ", ".join(t.__name__ for t in exportable)
    if isinstance(drafter_or_module, Drafter):
        for name in ("model", "heads"):
            inner = getattr(drafter_or_module, name, None)
            if isinstance(inner, exportable):
                return inner
        raise TypeError(f"{type(drafter_or_module).__name__} has no weights to export")
    if isinstance(drafter_or_module, exportable):
        return drafter_or_module
    raise TypeError(f"cannot export a {type(drafter_or_module).__name__}: give an Eagle, Eagle3 or Medusa drafter or "
                    f"its {names}")


def convert(drafter_or_module, target, to: str, *, verifier: str | None = None,
            speculative_tokens: int = 3) -> tuple[dict, dict, str]:
    """(config.json, tensors, weight file name) for consumer ``to``, without writing anything."""
    if to not in CONSUMERS:
        raise ValueError(f"to must be one of {CONSUMERS}, got {to!r}")
    module = module_of(drafter_or_module)
    kind = registry.kind_of(module)
    kind.check_fits(module, target)
    return kind.to_upstream(module, target, to, verifier=verifier, speculative_tokens=speculative_tokens)


@torch.no_grad()
def formats(drafter_or_module, target, *, before_training: bool = False) -> dict[str, str | None]:
    """Each consumer → None when ``export`` can write this drafter for ``target`` in its layout, else the reason
    it refuses. The recorded verifier is not judged here (``export`` asks for one where the target's name will
    not do). ``before_training``: judge a freshly built drafter as it will be once trained: every trainable
    parameter is nudged for the check (and restored), so that a refusal that depends on values (a nonzero bias
    a consumer drops, Medusa blocks that differ) reads as it will for trained weights."""
    module = module_of(drafter_or_module)
    params = dict(module.named_parameters())
    kept = {name: p.detach().clone() for name, p in params.items() if p.requires_grad} if before_training else {}
    generator = torch.Generator().manual_seed(0)
    try:
        for name in kept:
            params[name].add_(1e-3 * torch.randn(params[name].shape, generator=generator).to(params[name]))
        reasons = {}
        for to in CONSUMERS:
            try:
                convert(module, target, to, verifier="verifier")
                reasons[to] = None
            except ValueError as err:  # Refused, or a drafter that does not fit the target
                reasons[to] = str(err)
        return reasons
    finally:
        for name, value in kept.items():
            params[name].copy_(value)


def export(drafter_or_module, target, out_dir, to: str, *, verifier: str | None = None,
           speculative_tokens: int = 3, overwrite: bool = False) -> Path:
    """Write ``drafter_or_module`` (a Drafter or its module) for ``target`` into ``out_dir`` in consumer ``to``'s
    layout (module docstring); returns the folder. ``verifier``: the target's name or path recorded where a
    consumer asks for one (speculators' verifier, Medusa's base model; default the target's own
    ``_name_or_path``); ``speculative_tokens``: speculators' proposal length.

    An export never replaces a file it did not write: the files it writes are listed in ``MANIFEST``, and a
    re-export into its own folder replaces them (removing those the new layout does not use); any other file
    it would replace is refused, naming it, unless ``overwrite``. A folder holding other drafter files is
    refused too (a consumer would find two checkpoints)."""
    config, tensors, filename = convert(drafter_or_module, target, to, verifier=verifier,
                                        speculative_tokens=speculative_tokens)
    out = Path(out_dir)
    mine = check_folder(out, [filename, "config.json"], to, overwrite)
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
    for stale in sorted(mine - {filename, "config.json", MANIFEST}):  # the previous export's other layout
        (out / stale).unlink(missing_ok=True)
    if filename.endswith(".safetensors"):
        atomic_write(out / filename, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    else:  # the pickle the original project reads (a plain dict of tensors; treespec reads it weights_only)
        atomic_write(out / filename, lambda tmp: torch.save(tensors, tmp))
    atomic_write_json(out / "config.json", config, indent=2)
    atomic_write_json(out / MANIFEST, {"written_by": "treespec.heads.checkpoints.export", "to": to,
                                       "files": sorted([filename, "config.json", MANIFEST])}, indent=1)
    return out


def written_files(out: Path) -> set[str]:
    """The files an earlier export listed in ``out``'s manifest (none without one; an unreadable manifest is an
    error naming it, since it decides what may be replaced)."""
    path = out / MANIFEST
    if not path.is_file():
        return set()
    data = read_json(path, "export manifest", dict)
    files = data.get("files")
    if not (isinstance(files, list) and all(isinstance(f, str) and "/" not in f and f not in ("", ".", "..")
                                            for f in files)):
        raise ValueError(f"export manifest {path}: 'files' must be a list of file names, got {files!r}")
    return set(files)


def check_folder(out: Path, writes: list[str], to: str, overwrite: bool) -> set[str]:
    """Refuse an ``out`` that is a file or lies under one, one whose files this export did not write and would
    replace (unless ``overwrite``), and one holding another checkpoint; → the files an earlier export wrote."""
    folder_path(out, "export folder")
    if not out.exists():
        return set()
    mine = written_files(out)
    foreign = sorted(name for name in writes if (out / name).exists() and name not in mine)
    if foreign and not overwrite:
        raise ValueError(f"{out} already holds {', '.join(foreign)}, which no treespec export wrote: exporting would "
                         "replace them. Choose an empty folder, or pass overwrite=True (--overwrite) to replace them")
    other = sorted({p.name for pattern in FOREIGN for p in out.glob(pattern)} - set(writes) - mine)
    if other:
        raise ValueError(f"{out} already holds {', '.join(other)}; export into an empty folder so that {to} finds "
                         "one checkpoint only")
    return mine
