"""What a drafter kind is: one object that knows how to load its trained module, make the Drafter generate()
takes, measure its per-depth rank accuracy, time its drafting, read and write its checkpoints in other
projects' layouts, and train it. This is the base; each kind's folder declares its own in ``heads/<kind>/kind.py``
(the same concept, one layer down), and heads/registry.py lists them by name for training, the comparison, the
loader and the scripts.

    kind = registry.get("eagle")
    module = kind.load("reference:eagle", target)               # the trained module (None: no weights)
    drafter = kind.make(module, candidates="sample")            # the Drafter
    acc = kind.rank_accuracy(target, module, windows)           # acc[d][r] (heads/training/accuracy.py), or None
    fixed, per_depth = kind.cost(drafter)                       # seconds, for predicted speedups
    recipe = kind.recipe(cfg, target, train_tokens)             # its training objective (heads/training/objective.py)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType

from torch import nn

from treespec.drafter import Drafter
from treespec.heads.drafting.vocab import DraftVocab
from treespec.timing import median_time


# -- cost timing: not part of the Drafter interface (the loop never calls it); the drafters that run a model
# (heads/drafting/expansion.py's ExpandingDrafter, Medusa) implement ``drafting_step(past_len, n_tokens, batch)``:
# one of
# their drafting calls on placeholder inputs, as they draft: one depth of ``n_tokens`` frontier nodes per row after
# ``past_len`` cached entries, or one whole proposal for a drafter that ``fills_tree_at_once``. It may leave
# per-sequence state behind: call ``reset()`` when done with it.
def drafting_step(drafter: Drafter, batch: int = 1) -> Callable[[], object] | None:
    """``drafter``'s timing call for ``batch`` rows; None for a drafter that runs no model (nothing to time)."""
    step = getattr(drafter, "drafting_step", None)
    return step(batch=batch) if step is not None else None


def fills_tree_at_once(drafter: Drafter) -> bool:
    """Whether one drafting call of ``drafter`` fills the whole tree (Medusa's heads) rather than one depth."""
    return bool(getattr(drafter, "fills_tree_at_once", False))


class DrafterKind:
    """Base class; a kind overrides ``load``, ``new_drafter`` and, where it has them, ``rank_accuracy`` and
    ``max_depth``, and sets the facts below that differ from the defaults. Everything known about a kind is here, so
    that no code elsewhere compares a kind's name (tests/test_kind_names.py); a kind without weights is a
    ``ModelFreeKind``."""

    #: the registry name (conf/drafter/<name>.yaml's ``name``)
    name: str = ""
    #: whether it has trained weights, loaded from a source (reference:<name>, a folder, a Hub repo id)
    has_weights: bool = True
    #: whether its drafter is made from other kinds' drafters (its config's ``parts``), by ``combine``, not ``make``
    has_parts: bool = False
    #: candidate modes it supports ("sample": children drawn i.i.d. from the draft distribution)
    candidate_modes: tuple[str, ...] = ("topk",)
    #: whether its full-vocabulary head can be restricted to a frequency-ranked subset (FR-Spec,
    # heads/drafting/vocab.py)
    reduces_vocab: bool = False
    #: the class of its trained module; a module names its kind (``module.kind``), and export and the "auto" kind
    #: drive it by that name
    module_type: type | None = None
    #: the name of the upstream layout it reads and writes (``load(format=...)``); None: treespec's folders only
    upstream_format: str | None = None
    #: whether its upstream checkpoints must come with a config.json
    needs_config_json: bool = False
    #: the loader's keywords its upstream layout takes (``load(aux_layers=...)``), refused for any other format
    upstream_options: tuple[str, ...] = ()
    #: its name in messages ("EAGLE-3"); empty: ``name``
    title: str = ""

    # -- serving (train/compare/serving.py prints the stacks' commands from these) -----------------------------------
    #: vLLM's ``--speculative-config`` method for it (``vllm/config/speculative.py``); None: vLLM serves no such drafter
    vllm_method: str | None = None
    #: SGLang's ``--speculative-algorithm`` for it (``server_args.py``); None: SGLang serves no such drafter
    sglang_algorithm: str | None = None
    #: whether its checkpoint is converted into each stack's layout first (scripts/export_drafter.py --to <stack>);
    #: False: a stack loads its source as it is (a draft model's folder) or there is none
    serving_export: bool = False
    #: the speculative config's keys for a drafter the stack runs without a model, each the name of the drafter
    #: setting it takes its value from (prompt lookup's n-gram sizes: {"prompt_lookup_max": "max_ngram", ...})
    vllm_settings: Mapping[str, str] = MappingProxyType({})
    #: the drafter's own keyword settings a comparison entry may set (conf/drafter/<name>.yaml; null there: the
    #: drafter's default): prompt lookup's n-gram sizes
    settings: tuple[str, ...] = ()

    # -- training facts (train/training/: its run's summary, warnings and export check) ------------------------------
    #: the validation metric its training loop logs as its depth-1 top-1 (``val/<key>``); None: it logs none
    top1_metric: str | None = None
    #: what that top-1 counts, so that it is not confused with the rank accuracies measured as decoding drafts
    top1_meaning: str = ""
    #: the drafter setting that picks the target hidden states it fuses (named when a run fuses one twice)
    layers_key: str | None = None
    #: what changes its drafter config so that the serving stacks can hold it (named when export_to is refused)
    export_hint: str | None = None
    #: its training recipes besides its own, by name: conf/drafter/<recipe>.yaml sets ``recipe: <recipe>``, its run
    #: and folder are named after it, and its checkpoints load as this kind (Medusa-2's heads are Medusa heads)
    recipes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<drafter kind {self.name!r}>"

    @property
    def reads_source(self) -> bool:
        """Whether ``load`` reads something from its source: its weights, or for a kind without (REST) what it
        drafts from."""
        return self.has_weights or type(self).load is not DrafterKind.load

    def load(self, source, target) -> nn.Module | None:
        """The trained module for ``target`` from ``source``; None for a kind without weights."""
        return None

    def make(self, module, candidates: str = "topk", draft_vocab: DraftVocab | None = None, lean: bool = True,
             settings: Mapping[str, object] | None = None) -> Drafter:
        """The Drafter that drives ``module``. ``draft_vocab``: restrict its vocabulary projection to these target
        ids (FR-Spec); ``lean``: draft without the base model's per-call work (heads/drafting/lean.py);
        ``settings``: values of the kind's ``settings`` (its drafter's keywords; None: its default), any other name
        refused."""
        if candidates not in self.candidate_modes:
            raise ValueError(f"drafter {self.name!r} takes candidates in {self.candidate_modes}, got {candidates!r}")
        if draft_vocab is not None and not self.reduces_vocab:
            raise ValueError(f"drafter {self.name!r} has no full-vocabulary head to restrict (FR-Spec: draft, medusa, "
                             "eagle)")
        settings = {k: v for k, v in (settings or {}).items() if v is not None}  # None: the drafter's default
        unknown = sorted(set(settings) - set(self.settings))
        if unknown:
            takes = f"takes {', '.join(self.settings)}" if self.settings else "takes no settings"
            raise ValueError(f"drafter {self.name!r} {takes}, got {', '.join(unknown)}")
        return self.new_drafter(module, candidates, draft_vocab, lean, **settings)

    def new_drafter(self, module, candidates: str, draft_vocab: DraftVocab | None, lean: bool, **settings
                    ) -> Drafter:
        """``make`` after its checks (``settings``: only a kind that declares some gets any)."""
        raise NotImplementedError

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]] | None:
        """acc[d][r] (heads/training/accuracy.py), teacher forced on held-out ``windows`` [n, S]; None: it has no fixed
        ranks to score. ``options``: the module's ``rank_accuracy`` keywords (``sampling``, ``depth``, ...)."""
        return None

    def max_depth(self, module) -> int | None:
        """The deepest tree it can fill (Medusa: its number of heads); None: unbounded."""
        return None

    def check_module(self, d, module) -> None:
        """Raise ValueError when drafter config ``d`` (a comparison's entry) cannot drive the ``module`` its source
        loaded (a recipe's entry given a checkpoint another recipe trained)."""

    def drafting_step(self, drafter: Drafter, batch: int = 1) -> Callable[[], object] | None:
        """A call that runs one drafting call of ``drafter`` for ``batch`` rows (what ``cost`` times), to time
        target passes after it; None: it has no weights to push the target's out of the caches."""
        return drafting_step(drafter, batch)

    def cost(self, drafter: Drafter, before: Callable[[], object] | None = None, batch: int = 1
             ) -> tuple[float, float]:
        """(seconds per proposal, seconds per drafted depth) of ``drafter`` as it drafts (lean or not) for ``batch``
        rows, for predicted speedups: a drafter that fills its tree at once costs per proposal, the others per
        depth. ``before()`` runs untimed ahead of each timed call (a target pass, as in decoding):
        ``bench.median_time``."""
        step = self.drafting_step(drafter, batch)
        if step is None:
            return 0.0, 0.0
        seconds = median_time(step, before=before)
        drafter.reset()
        return (seconds, 0.0) if fills_tree_at_once(drafter) else (0.0, seconds)

    # -- checkpoints (heads/checkpoints/detect.py finds the kind, heads/registry.py's ``load`` and
    # heads/checkpoints/export.py call these) --
    def load_folder(self, folder, config: dict, target) -> nn.Module:
        """The module of a treespec folder of this kind (``{kind}_config.json`` is ``config``)."""
        return self.load(folder, target)

    def detects(self, weights: dict, config: dict, where: str) -> bool:
        """Whether ``weights`` (and ``config.json``'s ``config``) are this kind's upstream layout."""
        return False

    def from_upstream(self, found, target, **options) -> nn.Module:
        """The module of an upstream checkpoint this kind ``detects`` (``found``: heads/checkpoints/detect.py's
        ``Found``, the
        folder as read: its weights, config.json, files); ``options``: the loader's per-format keywords
        (EAGLE-3's ``aux_layers``, ``written_by``)."""
        raise NotImplementedError

    def check_fits(self, module, target) -> None:
        """Raise ValueError when ``module`` was not made for ``target`` (its hidden size, vocabulary, layers)."""
        module.check_fits(target)

    def to_upstream(self, module, target, to: str, *, verifier: str | None, speculative_tokens: int
                    ) -> tuple[dict, dict, str]:
        """(config.json, tensors, weight file name) of ``module`` in consumer ``to``'s layout; a consumer that
        cannot hold it raises ``upstream_common.Refused`` with the reason."""
        raise NotImplementedError

    # -- training (train/training/drafter_job.py asks the kind; heads/<kind>/objective.py holds the losses) ---------
    @property
    def trainable(self) -> bool:
        return type(self).recipe is not DrafterKind.recipe

    def recipe(self, cfg, target, train_tokens=None):
        """Its training objective for the job's config ``cfg`` (a ``heads.objective.Recipe``); ``train_tokens``:
        the training stream, for recipes that need its statistics (EAGLE-3's draft vocabulary)."""
        raise ValueError(f"drafter {self.name!r} cannot be trained here")

    def target_layers(self, d, num_hidden_layers: int) -> tuple[int, ...]:
        """The target hidden states it reads besides the last one (``d``: its drafter config): what offline
        features must hold."""
        return ()

    def check_training(self, cfg, world_size: int) -> None:
        """Refuse, before any model loads, settings this kind cannot train with (``world_size``: processes)."""

    def run_name(self, d) -> str:
        """The name a training run of drafter config ``d`` goes by (its run folder, logs and summary): its recipe
        (``d.recipe``, one of ``recipes``), else the kind's name."""
        recipe = d.get("recipe")
        if recipe is None:
            return self.name
        if recipe not in self.recipes:
            has = f"the recipes {', '.join(self.recipes)}" if self.recipes else "no recipe besides its own"
            raise ValueError(f"drafter.recipe={recipe!r}: drafter {self.name!r} has {has} (conf/drafter/<recipe>.yaml)")
        return recipe

    def kind_of(self, module) -> DrafterKind:
        """The kind that drives ``module``, which this kind loaded: itself ("auto": the kind it turned out to be)."""
        return self


class ModelFreeKind(DrafterKind):
    """A kind without weights (prompt lookup, SuffixDecoding, Token Recycling, REST, Lookahead): nothing to score,
    time or train. ``drafter()`` makes its Drafter; with ``reads(source, target)`` (REST: its datastore, from the
    corpus its source names) ``load`` returns what that reads and ``drafter(it)`` gets it. ``facts``: the
    class's other attributes it sets (``vllm_method`` and the like)."""

    has_weights = False

    def __init__(self, name: str, drafter: Callable[..., Drafter],
                 reads: Callable[[object, object], object] | None = None, **facts):
        unknown = [key for key in facts if not hasattr(DrafterKind, key) or callable(getattr(DrafterKind, key))]
        if unknown:  # a misspelt fact would otherwise be kept unread, and the kind would silently lack it
            raise TypeError(f"drafter kind {name!r}: {', '.join(unknown)} is not a DrafterKind attribute")
        self.name, self.drafter, self.reads = name, drafter, reads
        for key, value in facts.items():
            setattr(self, key, value)

    @property
    def reads_source(self) -> bool:
        return self.reads is not None

    def load(self, source, target):
        # read here, before anything is timed, not at the first generate()
        return self.reads(source, target) if self.reads is not None else None

    def new_drafter(self, module, candidates, draft_vocab, lean, **settings) -> Drafter:
        return self.drafter(module, **settings) if self.reads is not None else self.drafter(**settings)

    def setting_values(self, settings: Mapping[str, object] | None = None) -> dict[str, object]:
        """Every one of the kind's ``settings``: ``settings``' value, else its drafter's default (its constructor's)."""
        given = {k: v for k, v in (settings or {}).items() if v is not None}
        return {name: given.get(name, inspect.signature(self.drafter).parameters[name].default)
                for name in self.settings}
