"""The drafter registry: every drafter kind by name, the one place a kind is registered (heads/kind.py: how to
load it, make it a Drafter, measure its rank accuracy and drafting cost, read and write its checkpoints, train
it; each kind's folder declares its own in heads/<kind>/kind.py). Training (treespec.train.training.drafter_job),
the comparison (treespec.train.compare.job), the loader and the scripts look drafters up here and nowhere else;
conf/drafter/<name>.yaml describes each one's settings once. Adding a kind: its folder, and one line in KINDS. The
"combined" kind has parts instead of a module: other kinds' drafters, ``combine``d (``kind.has_parts``).

    kind = registry.get("eagle")
    drafter = registry.build("eagle", target, source="reference:eagle", candidates="sample")
    drafter = load("/path/to/any/checkpoint", target)              # the "auto" kind: treespec.heads.load
    profile = load_profile("/path/to/any/checkpoint")              # its measurements (treespec/planning/profile.py)
    profile = load_profile("reference:eagle", target)              # what lacks on this machine measured (cached)
"""

from __future__ import annotations

from torch import nn

from treespec.drafter import CANDIDATE_MODES, Drafter
from treespec.heads import (
    combined,
    dflash,
    draft_model,
    eagle,
    eagle3,
    hydra,
    lookahead,
    medusa,
    prompt_lookup,
    recycling,
    rest,
    suffix,
)
from treespec.heads.checkpoints import local_profile
from treespec.heads.checkpoints.detect import Found, formats, resolve_source
from treespec.heads.checkpoints.detect import detect as detect_in
from treespec.heads.checkpoints.detect import load_module as read_module
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.kind import DrafterKind
from treespec.heads.training.accuracy import read_accuracy
from treespec.linear_kernels import follow_target_kernel
from treespec.planning.autotree import read_cost_curve
from treespec.planning.chain_tau import read_chain_tau
from treespec.planning.measured_tau import read_measured_trees
from treespec.planning.profile import DrafterProfile

#: every kind, in the order the comparison lists them (the "auto" kind, any checkpoint, follows them)
KINDS: tuple[DrafterKind, ...] = (
    draft_model.KIND,
    prompt_lookup.KIND,
    recycling.KIND,
    suffix.KIND,
    rest.KIND,
    lookahead.KIND,
    medusa.KIND,
    hydra.KIND,
    dflash.KIND,  # before EAGLE's: its fc + hidden_norm + layers.* would read as theirs
    eagle.KIND,
    eagle3.KIND,
    combined.KIND,
)


class AutoKind(DrafterKind):
    """"auto": any checkpoint ``heads.detect.load_module`` reads, driven and measured as the kind of module it turns
    out to be (``module.kind``)."""

    name = "auto"
    candidate_modes = CANDIDATE_MODES

    def kind_of(self, module) -> DrafterKind:
        trained = [k for k in KINDS if k.module_type is not None]
        kind = next((k for k in trained if k.name == getattr(module, "kind", None)), None)
        # a module that does not name its kind (a transformers model: the draft model) by its class
        kind = kind or next((k for k in trained if isinstance(module, k.module_type)), None)
        if kind is None:
            raise TypeError(f"drafter 'auto' loaded a {type(module).__name__}, which it cannot drive")
        return kind

    def load(self, source, target, *, format: str = "auto", aux_layers=None,
             written_by: str | None = None) -> nn.Module:
        return read_module(source, target, KINDS, format=format, aux_layers=aux_layers, written_by=written_by)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Drafter:
        return self.kind_of(module).make(module, candidates, draft_vocab, lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]] | None:
        return self.kind_of(module).rank_accuracy(target, module, windows, **options)

    def max_depth(self, module) -> int | None:
        return self.kind_of(module).max_depth(module)


AUTO = AutoKind()
_BY_NAME = {kind.name: kind for kind in (*KINDS, AUTO)}
#: the ``format=`` values ``load`` takes: "auto" (detect), "treespec", then each kind's upstream layout
FORMATS = formats(KINDS)


def detect(folder, format: str = "auto") -> Found:
    """What ``folder`` holds: its format and kind (heads/checkpoints/detect.py), among the registered kinds."""
    return detect_in(folder, KINDS, format)


def get(name: str) -> DrafterKind:
    if name not in _BY_NAME:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def kind_of(module) -> DrafterKind:
    """The kind that drives a trained ``module`` (``module.kind``)."""
    return AUTO.kind_of(module)


def load_module(name: str, target, source=None):
    """The trained module of drafter ``name`` from ``source`` (``reference:<name>``, a folder, or for "auto" a Hub
    repo id); for a drafter without weights what its kind's ``load`` reads from ``source`` (REST: its datastore),
    else None."""
    kind = get(name)
    if not kind.has_weights:  # a model-free kind may still read something: REST its corpus (None: its default)
        return kind.load(source, target)
    if source is None:
        raise ValueError(f"drafter {name!r} needs a source: reference:<name> or a folder of trained weights")
    module = kind.load(source, target)
    follow_target_kernel(module, target)  # the target's CPU linear kernel (treespec/linear_kernels.py)
    return module


def make(name: str, module, candidates: str = "topk", draft_vocab: DraftVocab | None = None, *,
         lean: bool = True, settings=None) -> Drafter:
    """``DrafterKind.make`` of drafter ``name``: ``draft_vocab`` restricts its vocabulary projection to these
    target ids (FR-Spec); ``lean``: draft without the base model's per-call work (heads/drafting/lean.py), False for the
    plain forward; ``settings``: the drafter's own keywords its kind declares (prompt lookup's n-gram sizes)."""
    return get(name).make(module, candidates, draft_vocab, lean, settings)


def build(name: str, target, source=None, candidates: str = "topk", settings=None) -> Drafter:
    """load + make: a ready Drafter of kind ``name`` for ``target`` (its measurements: ``load_profile``);
    ``settings``: as ``make``'s, e.g. ``build("prompt_lookup", target, settings={"min_ngram": 2})``."""
    return make(name, load_module(name, target, source), candidates, settings=settings)


def load(source, target, *, format: str = "auto", aux_layers=None, written_by: str | None = None,
         candidates: str = "topk") -> Drafter:
    """A ready Drafter for ``target`` from ``source``: a local folder, ``reference:<name>`` or a Hugging Face Hub
    repo id. ``format``: "auto" (detect), "treespec", "eagle" (EAGLE-1/2), "eagle3" or "medusa"; ``aux_layers``:
    the target hidden-state indices an EAGLE-3 checkpoint fuses, when its config does not say (treespec's
    convention: ``hidden_states[i]`` is the input of decoder layer i); ``written_by``: "specforge" or "serving",
    whose convention an EAGLE-3 config's ``norm_output`` follows where its fields do not say
    (heads/eagle3/upstream.py); ``candidates``: "topk" or "sample". Its measurements: ``load_profile(source)``."""
    folder = resolve_source(source)  # a Hub id is fetched once
    module = AUTO.load(folder, target, format=format, aux_layers=aux_layers, written_by=written_by)
    follow_target_kernel(module, target)
    return AUTO.make(module, candidates)


def load_profile(source, target=None, *, log=print) -> DrafterProfile:
    """What a drafter's folder holds beside its weights, so that generate(..., profile=) can grow
    ``{"kind": "accuracy"}`` and ``{"kind": "auto"}`` trees for it (treespec.planning.tree_spec): its measured
    accuracies (head_accuracy.json), its cost curve (cost_curve.json), its chain τ of sampled candidates
    (chain_tau.json) and, for a model-free drafter's profile a comparison kept, its τ per tree from a dry run
    (measured_trees.json). Any may be missing (None).

    With its ``target``, what is missing on this machine is measured once on first use and cached
    (heads/checkpoints/local_profile.py): the cost curve, when the folder holds none measured here for this target (the
    shipped drafters' are not), now; a chain τ at a sampling it lacks, when "auto" first needs it."""
    folder = resolve_source(source)
    accuracy, chains = read_accuracy(folder), read_chain_tau(folder) or None
    measured = read_measured_trees(folder) or None
    if target is None:
        return DrafterProfile.from_cost_curve(accuracy, read_cost_curve(folder), chains, measured=measured)
    record = local_profile.cost_record(target, load(folder, target), folder, log)
    measure = local_profile.chain_tau_measurer(target, folder, log)
    return DrafterProfile.from_cost_curve(accuracy, record, chains, measure, measured)
