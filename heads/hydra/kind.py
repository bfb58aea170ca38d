"""The Hydra kind (conf/drafter/hydra.yaml): sequentially dependent heads on a frozen target, Hydra++'s options
included (heads/hydra/network.py, objective.py). Its folders are treespec's own (``hydra_config.json``); no
serving stack reads Hydra heads, so it has no upstream layout to export to."""

from __future__ import annotations

from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.hydra import objective
from treespec.heads.hydra.drafter import Hydra, rank_accuracy
from treespec.heads.hydra.network import HydraHeads
from treespec.heads.kind import DrafterKind
from treespec.reference import resolve

# the drafter keys a Hydra run reads, beyond the integers and switches every drafter's are checked for
SWITCHES = ("share_lm_head", "prefix_attention", "distill", "lean")


class HydraKind(DrafterKind):
    name = "hydra"
    module_type = HydraHeads
    candidate_modes = ("topk", "sample", "without_replacement")  # children per node: its own distribution
    title = "Hydra"
    top1_metric = "depth1_top1"
    top1_meaning = "head 1 on the target's hidden states of the validation windows, its path the window's next token"

    def load(self, source, target) -> HydraHeads:
        return HydraHeads.from_pretrained(resolve(source), target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Hydra:
        return Hydra(module, candidates=candidates, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)

    def max_depth(self, module) -> int:
        return module.num_heads

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        raise Refused(f"{to} has no layout for Hydra heads (sequentially dependent heads read the path's token "
                      "embeddings, which no serving stack's Medusa heads do): keep treespec's folder")

    def recipe(self, cfg, target, train_tokens=None):
        return objective.recipe(cfg, target, train_tokens)

    def check_training(self, cfg, world_size: int) -> None:
        d = cfg.drafter
        missing = [k for k in ("num_heads", "num_layers", "loss_decay", *SWITCHES[:3]) if k not in d]
        if missing:
            raise ValueError(f"drafter=hydra needs drafter.{', drafter.'.join(missing)} (conf/drafter/hydra.yaml)")
        for key in SWITCHES:
            if key in d and not isinstance(d[key], bool):
                raise ValueError(f"drafter.{key} must be true or false, got {d[key]!r}")


KIND = HydraKind()
