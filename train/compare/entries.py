"""A comparison's drafter from its ``available.<label>`` entry (conf/drafter/): its settings checked against its
kind, its module loaded and its Drafter made from the registry (a combined drafter from its parts, each made as it
is alone: available.<label>.parts), its depth limit, the record that makes it again, and its weights' stamp."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from treespec import reference
from treespec.heads import registry
from treespec.train.compare.methods import check_parts, part_trees_of, parts_of
from treespec.train.compare.stamp import model_checksum


def check_entry(cfg, label: str) -> None:
    """``available.<label>``'s settings against its kind (a combined drafter's parts each too)."""
    entry = cfg.available[label]
    kind = registry.get(entry.name)
    if kind.has_parts:
        for part in check_parts(cfg, label, kind):
            check_entry(cfg, part)
        return
    if kind.has_weights and OmegaConf.is_missing(entry, "source"):
        raise ValueError(f"drafter {label!r} needs its checkpoint: available.{label}.source=/path/to/folder")
    if entry.get("draft_vocab") is not None and not kind.reduces_vocab:
        raise ValueError(f"drafter {label!r}: {entry.name} has no full-vocabulary head for draft_vocab")
    if entry.get("candidates", "topk") not in kind.candidate_modes:
        raise ValueError(f"drafter {label!r}: {entry.name} takes candidates in {kind.candidate_modes}")


def made(cfg, label: str, target, vocab_of=lambda spec, label: None):
    """(its module, its Drafter, its FR-Spec vocabulary) of ``available.<label>``, from the registry; a combined
    drafter's module is the list of its parts' modules, each part made as it is alone. ``vocab_of(spec, label)``:
    the vocabulary of an entry's ``draft_vocab`` (the comparison keeps a copy in its run: ``VOCAB_FILE``)."""
    entry = cfg.available[label]
    kind = registry.get(entry.name)
    if kind.has_parts:
        parts = [made(cfg, part, target, vocab_of) for part in parts_of(cfg, label)]
        drafter = kind.combine([d for _, d, _ in parts], mode=entry.get("mode", "union"), nodes=entry.get("nodes"),
                               min_nodes=entry.get("min_nodes", 1), part_trees=part_trees_of(cfg, label))
        return [m for m, _, _ in parts], drafter, None
    try:
        module = registry.load_module(entry.name, target, entry.get("source"))
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(
            f"drafters: {label!r} (available.{label}.source={entry.get('source')}) cannot serve the target "
            f"{cfg.target}: {err}. Leave it out (drafters=[...] without {label}; drafters=null picks the ones "
            f"that fit) or set available.{label}.source to a {entry.name} checkpoint trained for this target "
            f"(python scripts/train_heads.py target={cfg.target} drafter={entry.name})") from None
    kind.check_module(entry, module)
    draft_vocab = vocab_of(entry.get("draft_vocab"), label)
    drafter = registry.make(entry.name, module, entry.get("candidates", "topk"), draft_vocab,
                            lean=entry.get("lean", True), settings=settings_of(entry, kind))
    return module, drafter, draft_vocab


#: where a comparison run keeps the FR-Spec vocabulary a drafter entry drafted with (relative to the run's folder):
#: an entry's ``draft_vocab`` of N is ranked from the run's own held-out text, so the run keeps what it used
VOCAB_FILE = "draft_vocab/{label}.safetensors"


def settings_of(entry, kind) -> dict:
    """The drafter's own settings (``kind.settings``) an entry sets: those not null."""
    return {name: entry[name] for name in kind.settings if entry.get(name) is not None}


def max_depth_of(cfg, label: str, module) -> int | None:
    """The deepest tree drafter ``label`` fills (a combination: the shallowest of the parts drafting on the step's
    tree; a part with a tree of its own, ``part_trees``, fills that one, as heads/combined/drafter.py has it); None:
    unbounded."""
    kind = registry.get(cfg.available[label].name)
    if not kind.has_parts:
        return kind.max_depth(module)
    own = cfg.available[label].get("part_trees") or [None] * len(module)
    depths = [max_depth_of(cfg, part, m) for part, m, tree in zip(parts_of(cfg, label), module, own, strict=True)
              if tree is None]
    return min((d for d in depths if d is not None), default=None)


def entry_record(cfg, label: str, module=None) -> dict:
    """How to make drafter ``label`` again (results.json, the saved trees, results.md's usage lines): its registry
    name, source and candidates; a combination's mode, budget and parts too. With the ``module`` it loaded, an
    "auto" entry (drafter=upstream) records the kind its checkpoint turned out to be (``kind``): what serves it
    (train/compare/serving.py)."""
    entry = cfg.available[label]
    record = {"name": entry.name, "source": entry.get("source"), "candidates": entry.get("candidates", "topk")}
    kind = registry.get(entry.name)
    if settings := settings_of(entry, kind):
        record["settings"] = settings
    if entry.get("draft_vocab") is not None:  # FR-Spec: as asked, and the vocabulary the run kept
        record |= {"draft_vocab": entry.draft_vocab, "draft_vocab_file": VOCAB_FILE.format(label=label)}
    if module is not None and kind.kind_of(module) is not kind:
        record["kind"] = kind.kind_of(module).name
    parts = parts_of(cfg, label)
    if parts:
        record |= {"mode": entry.get("mode", "union"), "nodes": entry.get("nodes"),
                   "min_nodes": entry.get("min_nodes", 1), "parts": [entry_record(cfg, p) for p in parts]}
        if (trees := part_trees_of(cfg, label)) is not None:
            record["part_trees"] = trees
    return record


def drafter_checksum(entry, module) -> dict:
    """The stamp's record of one drafter: its source, weight files' sha1 and loaded weights' sha1 (a combination:
    its parts' weights together)."""
    if isinstance(module, list):
        weights = [m for m in module if isinstance(m, torch.nn.Module)]
        source = " + ".join(str(part) for part in entry.parts)
        return model_checksum(torch.nn.ModuleList(weights), source) if weights else {"source": source, "weights": None}
    if module is None or not isinstance(module, torch.nn.Module):  # no weights (REST's datastore: keyed by its corpus)
        return {"source": entry.get("source"), "weights": None}
    try:
        folder = reference.resolve(entry.source)
    except (FileNotFoundError, TypeError):
        folder = None
    return model_checksum(module, entry.get("source"), folder)
