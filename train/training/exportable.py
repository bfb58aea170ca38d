"""Which formats the configured drafter can be exported to, checked when a drafter training starts.

A drafter some consumer cannot represent (an EAGLE-3 layer with the target's q/k norms, a treespec-variant EAGLE,
Medusa blocks that differ) used to be found out only at export, after training. The job now builds the drafter
it is about to train once more, as a probe, before any data is prepared, logs which formats
(``treespec.heads.checkpoints.export.CONSUMERS``) it can be exported to and why not the others, and refuses to start
when
``export_to`` (conf/train_heads.yaml) names one it cannot reach.
"""

from __future__ import annotations

import torch

from treespec.heads import registry
from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.checkpoints.export import CONSUMERS, formats


def check_export_names(cfg) -> list[str]:
    """``export_to`` as a list, every entry a known format (ValueError otherwise); before any model is loaded."""
    wanted = [str(c) for c in (cfg.get("export_to") or [])]
    unknown = [c for c in wanted if c not in CONSUMERS]
    if unknown:
        raise ValueError(f"export_to: unknown format(s) {', '.join(unknown)}; formats: {', '.join(CONSUMERS)}")
    return wanted


def refusals(reach: dict[str, str | None]) -> dict[str, list[str]]:
    """The refused consumers of ``export.formats``' answer grouped by their reason (a draft model: one reason for
    all of them)."""
    grouped: dict[str, list[str]] = {}
    for consumer, why in reach.items():
        if why is not None:
            grouped.setdefault(why, []).append(consumer)
    return grouped


def check_export_targets(cfg, target, recipe, *, log: bool = True) -> list[str]:
    """Build the drafter ``recipe`` (heads/training/objective.py's function) makes for ``target`` as a probe (the
    global RNG is
    left as it was), print (``log``) the formats it can be exported to and why not the others, and raise ValueError when
    ``export_to`` names one it cannot reach. Returns the reachable formats."""
    wanted = check_export_names(cfg)
    with torch.random.fork_rng(devices=[]):
        module = recipe(cfg, target, torch.arange(vocab_size_of(target))).drafter()  # its weights (export.module_of)
    reach = formats(module, target, before_training=True)
    ok = [c for c, why in reach.items() if why is None]
    name = cfg.drafter.name
    if log:
        print(f"{name}: exportable to {', '.join(ok) or 'no format'}")
        for why, consumers in refusals(reach).items():
            print(f"  not to {', '.join(consumers)}: {why}")
    blocked = [c for c in wanted if reach[c] is not None]
    if blocked:
        hint = registry.get(name).export_hint  # what changes the config so that the serving stacks can hold it
        hint = f" ({hint} reaches the serving stacks)" if hint else ""
        raise ValueError(f"export_to names {', '.join(blocked)}, which this {name} drafter cannot be exported to: "
                         + "; ".join(f"{c}: {reach[c]}" for c in blocked)
                         + f". Change the drafter config{hint} or drop them from export_to")
    return ok
