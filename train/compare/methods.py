"""Which methods a comparison measures beyond the run-wide drafter × tree grid (train/compare/job.py reads the
config through these):

- ``available.<label>.trees``: a drafter's own tree specs, replacing the run's ``trees`` for it. Spec-Bench's
  methods each come with their own configuration (prompt lookup a chain, EAGLE-2 a dynamic tree, Medusa its
  static tree), so a benchmark run gives each drafter its one tree instead of timing every drafter on every
  tree. ``tree=...`` on the command line still replaces them all.
- ``skip_unshipped``: a drafter (or the assistant) whose ``reference:<name>`` checkpoint this checkout lacks is
  left out with a message instead of failing the run, so an experiment can list drafters that are still being
  trained (conf/experiment/specbench.yaml) and measure the ones that exist.
- ``available.<label>.parts``: a combined drafter's parts (conf/drafter/combined.yaml), other entries of
  ``available``, each checked, loaded and made as it is alone, then combined into one Drafter.
- ``baselines``: transformers' own methods (peers.PEERS: greedy, assisted, prompt_lookup) measured as methods
  of the main pass, interleaved prompt by prompt with vanilla and every drafter (null, the default: all three),
  rather than in the separate peer pass (``peers=true``) that times each drafter's best again beside them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from treespec import reference
from treespec.planning.tree_spec import check_tree_spec
from treespec.train.compare.configurations import expand_specs
from treespec.train.compare.peers import PEERS


def shipped(source) -> bool:
    """Whether a ``reference:<name>`` source is in this checkout (any other source counts as given: loading it
    says what is wrong with it)."""
    if not str(source).startswith(reference.PREFIX):
        return True
    try:
        reference.resolve(source)
    except FileNotFoundError:
        return False
    return True


def unshipped(cfg, labels: list[str]) -> dict[str, str]:
    """{label: source} of the drafters among ``labels`` whose ``reference:`` checkpoint this checkout lacks, when
    ``skip_unshipped`` is true (else none: loading them fails and says why)."""
    if not cfg.get("skip_unshipped"):
        return {}
    out = {}
    for label in labels:
        lacking = unshipped(cfg, parts_of(cfg, label)) if parts_of(cfg, label) else {}
        if lacking:  # a combined drafter lacking a part
            out[label] = ", ".join(lacking.values())
            continue
        entry = cfg.available.get(label)
        if entry is None or "source" not in entry or OmegaConf.is_missing(entry, "source") or entry.source is None:
            continue
        if not shipped(entry.source):
            out[label] = str(entry.source)
    return out


def parts_of(cfg, label: str) -> list[str]:
    """The labels of drafter ``label``'s parts (``available.<label>.parts``); [] for a drafter without parts."""
    entry = cfg.available.get(label)
    return [] if entry is None or entry.get("parts") is None else [str(p) for p in entry.parts]


def check_parts(cfg, label: str, kind) -> list[str]:
    """A combined drafter's parts, each an entry of ``available`` with fixed-rank candidates and no parts of its
    own, and its settings (``kind.check_settings``) → the parts' labels."""
    parts = cfg.available[label].get("parts")
    if parts is None or isinstance(parts, str) or not (OmegaConf.is_list(parts) or isinstance(parts, list)) \
            or len(parts) < 2:
        raise ValueError(f"available.{label}.parts must list two or more of the available drafters (e.g. [suffix, "
                         f"eagle3]), got {parts!r}")
    for part in parts_of(cfg, label):
        if part not in cfg.available:
            raise ValueError(f"available.{label}.parts: {part!r} is not one of the available drafters "
                             f"({', '.join(cfg.available)})")
        if parts_of(cfg, part) or part == label:
            raise ValueError(f"available.{label}.parts: {part!r} is a combined drafter itself; list its parts instead")
        if cfg.available[part].get("candidates", "topk") != "topk":
            raise ValueError(f"available.{label}.parts: {part!r} samples its candidates (candidates="
                             f"{cfg.available[part].candidates}); a combination merges fixed ranks: use a topk entry")
    entry = cfg.available[label]
    kind.check_settings(entry.get("mode", "union"), entry.get("nodes"), entry.get("min_nodes", 1),
                        part_trees_of(cfg, label))
    return parts_of(cfg, label)


def part_trees_of(cfg, label: str) -> list | None:
    """A combined drafter's ``available.<label>.part_trees`` as plain specs (None: every part on the step's tree)."""
    trees = cfg.available[label].get("part_trees")
    return trees if trees is None or isinstance(trees, str) else OmegaConf.to_container(trees, resolve=True)


def own_trees(cfg, label: str) -> list[dict] | None:
    """Drafter ``label``'s own tree specs (``available.<label>.trees``), checked; None when it has none or
    ``tree=...`` replaces every tree of the run."""
    own = cfg.available[label].get("trees")
    if cfg.get("tree") or own is None:
        return None
    specs = OmegaConf.to_container(own, resolve=True)
    if not isinstance(specs, list) or not specs or not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"available.{label}.trees must be a non-empty list of tree specs ({{kind: chain, depth: 4}}, "
                         f"...), got {specs!r}")
    for spec in expand_specs(specs):
        check_tree_spec(spec)
    return specs


def check_baselines(cfg) -> list[str]:
    """``baselines``: a list of ``PEERS``' kinds, only with ``peers=false`` (the peer pass measures them all); null:
    all three without the peer pass, none with it."""
    if cfg.get("baselines") is None:
        return [] if cfg.get("peers", False) else list(PEERS)
    baselines = cfg.get("baselines") or []
    if isinstance(baselines, str) or not OmegaConf.is_list(baselines) and not isinstance(baselines, list):
        raise ValueError(f"baselines must be a list of {', '.join(PEERS)}, got {baselines!r}")
    baselines = [str(b) for b in baselines]
    unknown = [b for b in baselines if b not in PEERS]
    if unknown:
        raise ValueError(f"baselines: {unknown} not one of {', '.join(PEERS)} (transformers' own methods)")
    if baselines and cfg.get("peers", True):
        raise ValueError(f"baselines={baselines} measures transformers' methods beside every configuration; "
                         "peers=true measures them in a pass of their own: set peers=false")
    return baselines


def baselines_of(cfg, assistant) -> list[str]:
    """The baselines a run measures: assisted generation only when an assistant was loaded (``job.assistant_peer``
    skips one that does not fit the target, with a note in the stamp)."""
    return [b for b in check_baselines(cfg) if b != "assisted" or assistant is not None]


def wants_assistant(cfg) -> bool:
    """Whether the run measures assisted generation: in the peer pass or as a baseline."""
    return bool(cfg.peers) or "assisted" in check_baselines(cfg)
