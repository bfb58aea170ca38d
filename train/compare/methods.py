"""Which methods a comparison measures beyond the run-wide drafter × tree grid (train/compare/job.py reads the
config through these):

- ``available.<label>.trees``: a drafter's own tree specs, replacing the run's ``trees`` for it. Spec-Bench's
  methods each come with their own configuration (prompt lookup a chain, EAGLE-2 a dynamic tree, Medusa its
  static tree), so a benchmark run gives each drafter its one tree instead of timing every drafter on every
  tree. ``tree=...`` on the command line still replaces them all.
- ``skip_unshipped``: a drafter (or the assistant) whose ``reference:<name>`` checkpoint this checkout lacks is
  left out with a message instead of failing the run, so an experiment can list drafters that are still being
  trained (conf/experiment/specbench.yaml) and measure the ones that exist.
- ``baselines``: transformers' own methods (harness.PEERS: greedy, assisted, prompt_lookup) measured as methods
  of the main pass, interleaved prompt by prompt with vanilla and every drafter, rather than in the separate
  peer pass (``peers=true``) that times each drafter's best again beside them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from treespec import reference
from treespec.train.compare.harness import PEERS, expand_specs
from treespec.tree_spec import check_tree_spec


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
        entry = cfg.available.get(label)
        if entry is None or "source" not in entry or OmegaConf.is_missing(entry, "source") or entry.source is None:
            continue
        if not shipped(entry.source):
            out[label] = str(entry.source)
    return out


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
    """``baselines``: a list of ``PEERS``' kinds, only with ``peers=false`` (the peer pass measures them all)."""
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
