"""The Medusa kinds: Medusa-1 heads on a frozen target (conf/drafter/medusa.yaml), and Medusa-2, the same heads
trained jointly with the target (conf/drafter/medusa2.yaml), whose folders load as Medusa heads."""

from __future__ import annotations

from treespec.heads.kind import DrafterKind
from treespec.heads.medusa import medusa2, objective
from treespec.heads.medusa.drafter import Medusa, rank_accuracy
from treespec.heads.medusa.network import MedusaHeads
from treespec.heads.medusa.upstream import medusa_from_upstream, medusa_layout, medusa_to_upstream
from treespec.reference import resolve


class MedusaKind(DrafterKind):
    """Medusa heads; upstream checkpoints (Medusa-1 ``medusa_lm_head``, Medusa-2, vLLM's blocks) too."""

    name = "medusa"
    reduces_vocab = True
    module_type = MedusaHeads
    upstream_format = "medusa"

    def load(self, source, target) -> MedusaHeads:
        return MedusaHeads.from_pretrained(resolve(source), target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Medusa:
        return Medusa(module, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)

    def max_depth(self, module) -> int:
        return module.num_heads

    def detects(self, weights, config, where) -> bool:
        return medusa_layout(weights) is not None

    def from_upstream(self, found, target, **options) -> MedusaHeads:
        return medusa_from_upstream(found.weights, found.config, target, found.where)

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        config, tensors = medusa_to_upstream(module, target, to, verifier=verifier)
        return config, tensors, "medusa_lm_head.pt" if to == "medusa" else "model.safetensors"

    def recipe(self, cfg, target, train_tokens=None):
        return objective.recipe(cfg, target, train_tokens)


class Medusa2Kind(MedusaKind):
    """Medusa-2: trained with the target (heads/medusa/medusa2.py); its run's heads are Medusa heads."""

    name = "medusa2"
    upstream_format = None  # its folders are Medusa's: read through "medusa"

    def recipe(self, cfg, target, train_tokens=None):
        return medusa2.recipe(cfg, target, train_tokens)

    def check_training(self, cfg, world_size: int) -> None:
        medusa2.check_settings(cfg, world_size)

    @property
    def loads_as(self) -> str:
        return "medusa"


KIND = MedusaKind()
MEDUSA2 = Medusa2Kind()
