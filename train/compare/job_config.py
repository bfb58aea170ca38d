"""The comparison's config: what it selects (``drafter_labels``: the drafters, with the target's defaults;
``tree_specs_of``: the trees; ``acceptance_rules``) and everything that can be wrong in it, raised before any model
is loaded (``check_config``, ``check_workload``). train/compare/job.py runs what it allows.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from treespec import reference
from treespec.heads import registry
from treespec.planning.tree_spec import check_tree_spec
from treespec.train.compare.auto_across import across_specs, check_across, check_distinct
from treespec.train.compare.configurations import ACROSS_KEY, expand_specs
from treespec.train.compare.entries import check_entry
from treespec.train.compare.methods import check_baselines, own_trees
from treespec.train.compare.templates import check_system_prompt, check_template
from treespec.train.compare.workload import chat_validation, check_texts
from treespec.train.training import config_checks
from treespec.walker import ACCEPTANCE_MODES

REFERENCE_TARGET = "reference:target"
# drafters: null on the reference target; its draft model runs as the assisted-generation baseline
REFERENCE_DRAFTERS = ("prompt_lookup", "recycling", "suffix", "medusa", "eagle")
SOURCES = ("reference", "jsonl", "dataset", "texts")


def is_reference_target(cfg) -> bool:
    try:
        return reference.resolve(cfg.target).resolve() == reference.resolve(REFERENCE_TARGET).resolve()
    except FileNotFoundError:
        return False


def drafter_labels(cfg) -> list[str]:
    """The drafters to run: ``cfg.drafters``, or (null) the defaults for the target (module docstring)."""
    if cfg.get("drafters") is not None:
        return list(cfg.drafters)
    if is_reference_target(cfg):
        return list(REFERENCE_DRAFTERS)
    given = [label for label, entry in cfg.available.items() if "source" in entry
             and not OmegaConf.is_missing(entry, "source") and entry.source is not None
             and not str(entry.source).startswith(reference.PREFIX)]
    return [*(label for label in model_free(cfg) if label not in given), *given]


def model_free(cfg) -> list[str]:
    """The entries of ``available`` whose drafter needs nothing trained or read for the target: kinds without
    weights or parts that read no source, one entry per kind. REST reads its corpus (its default is the code
    reference's stdlib, minutes to encode with another tokenizer and unlike its text): it runs when given one, as an
    entry given a source."""
    kinds = {label: registry.get(entry.name) for label, entry in cfg.available.items()}
    # kind → its first entry; a variant (lookup24: prompt lookup's n-grams 4 to 2) runs when named
    first: dict[str, str] = {}
    for label, kind in kinds.items():
        if not kind.has_weights and not kind.has_parts and not kind.reads_source:
            first.setdefault(kind.name, label)
    return list(first.values())


def tree_specs_of(cfg) -> list[dict]:
    """The run's tree specs (``tree=...`` replaces ``trees``), expanded and checked before anything loads."""
    specs = [OmegaConf.to_container(cfg.tree, resolve=True)] if cfg.get("tree") else \
        OmegaConf.to_container(cfg.trees, resolve=True)
    for spec in expand_specs(specs):
        if ACROSS_KEY not in spec:  # "auto" across drafters: checked against the run's drafters (check_config)
            check_tree_spec(spec)
    return specs


def acceptance_rules(cfg) -> str | list[str]:
    """``cfg.acceptance``: one walker rule, or a list run side by side (treespec.walker.ACCEPTANCE_MODES)."""
    rules = cfg.get("acceptance", "rejection")
    rules = [rules] if isinstance(rules, str) else list(rules)
    unknown = [r for r in rules if r not in ACCEPTANCE_MODES]
    if unknown or not rules:
        raise ValueError(f"acceptance: {unknown or 'an empty list'} is not one of {ACCEPTANCE_MODES} (or a list)")
    return rules[0] if len(rules) == 1 else rules


def check_workload(cfg) -> None:
    w = cfg.workload
    if w.get("source") not in SOURCES:
        raise ValueError(f"workload.source={w.get('source')!r} is not one of {', '.join(SOURCES)} (conf/workload/)")
    for key in {"jsonl": ("path",), "texts": ("path",), "dataset": ("name",)}.get(w.source, ()):
        if OmegaConf.is_missing(w, key) or not w.get(key):
            raise ValueError(f"workload={w.source} needs workload.{key}=... (docs/workloads.md)")
    config_checks.integer(cfg.prompts, "prompts", optional=True)
    per_category = w.get("per_category")  # one count, or {category: count, default: count} (selection.py)
    for key, n in (per_category.items() if OmegaConf.is_dict(per_category) else [(None, per_category)]):
        config_checks.integer(n, "workload.per_category" + (f".{key}" if key else ""), optional=True)
    config_checks.integer(w.get("max_prompt_tokens"), "workload.max_prompt_tokens", optional=True)
    config_checks.integer(w.get("held_out", 0), "workload.held_out", 0)
    config_checks.integer(w.get("held_out_tokens"), "workload.held_out_tokens", optional=True)
    config_checks.integer(w.get("seed", 0), "workload.seed", 0)
    budgets = w.get("max_new_tokens")
    if budgets is not None and not OmegaConf.is_dict(budgets):
        raise ValueError(f"workload.max_new_tokens must be {{category: tokens}} or null, got {budgets!r} (one budget "
                         "for every category: max_new_tokens=N)")
    for category, n in (budgets or {}).items():  # the categories themselves are checked once the workload is read
        config_checks.integer(n, f"workload.max_new_tokens.{category}")
    check_system_prompt(w.get("system_prompt"))
    check_template(w.get("template", "auto"))
    if w.get("chat_validation") is not None:  # a chat training run's held-out conversations (workload.py)
        if w.source not in ("jsonl", "dataset"):
            raise ValueError(f"workload.chat_validation selects a chat training run's held-out conversations from its "
                             f"data.chat.source: a jsonl or dataset workload, not workload={w.source}")
        chat_validation(w.chat_validation)
    if w.source == "texts":
        check_texts(w.get("pattern", "*"), w.get("window_chars", 1000), w.get("windows_per_file", 4))
    if w.source == "reference":
        available = len(reference.prompts())
        if cfg.prompts is not None and cfg.prompts > available:
            raise ValueError(f"prompts={cfg.prompts}: only {available} held-out prompts are shipped")


def check_config(cfg) -> None:
    """Everything that can be wrong in the config, raised before any model is loaded."""
    for spec in across_specs(tree_specs_of(cfg)):
        check_across(spec, drafter_labels(cfg))
    check_distinct(tree_specs_of(cfg), drafter_labels(cfg))
    acceptance_rules(cfg)
    for label in drafter_labels(cfg):
        if label not in cfg.available:
            raise ValueError(f"drafters: {label!r} is not one of the available drafters ({', '.join(cfg.available)}; "
                             "conf/drafter/ describes them)")
        own_trees(cfg, label)
        check_entry(cfg, label)
    for key in ("repeats", "max_new_tokens", "max_nodes"):
        config_checks.integer(cfg.get(key, 1), key)
    config_checks.number(cfg.temperature, "temperature", 0)
    config_checks.number(cfg.top_p, "top_p", 0, 1, low_open=True)
    config_checks.integer(cfg.get("threads"), "threads", optional=True)
    config_checks.integer(cfg.get("seed") or 0, "seed", 0)
    config_checks.boolean(cfg.get("peers", True), "peers")
    config_checks.boolean(cfg.get("compile", False), "compile")
    config_checks.boolean(cfg.get("skip_unshipped", False), "skip_unshipped")
    check_baselines(cfg)
    config_checks.boolean(cfg.get("resume", False), "resume")
    config_checks.cost_sizes(cfg.cost_sizes, "cost_sizes")
    if cfg.get("batch_sizes") is not None:  # the comparison across batch sizes (train/compare/batch_compare.py)
        config_checks.integers(cfg.get("batch_sizes"), "batch_sizes")
        if min(cfg.get("batch_sizes")) < 1:
            raise ValueError(f"batch_sizes must be integers >= 1, got {list(cfg.get('batch_sizes'))}")
        config_checks.cost_sizes(cfg.get("batch_cost_sizes"), "batch_cost_sizes")
        config_checks.integer(cfg.get("batches", 3), "batches")
    config_checks.device(cfg.get("device") or "cpu")
    boot = bootstrap_settings(cfg)
    if boot["samples"] < 100 or not 0 < boot["level"] < 1:
        raise ValueError(f"bootstrap: samples must be >= 100 and 0 < level < 1, got {boot}")
    check_workload(cfg)


def bootstrap_settings(cfg) -> dict:
    b = cfg.get("bootstrap") or {}
    return {"samples": int(b.get("samples", 2000)), "level": float(b.get("level", 0.95)),
            "seed": int(b.get("seed", 0))}
