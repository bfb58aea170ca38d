"""The Medusa kind: Medusa heads (conf/drafter/medusa.yaml), trained on a frozen target (Medusa-1) or, with the
recipe ``medusa2`` (conf/drafter/medusa2.yaml: ``recipe: medusa2``), jointly with the target (heads/medusa/
medusa2.py); either run's folder holds Medusa heads and loads as this kind."""

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
    title = "Medusa"
    reduces_vocab = True
    module_type = MedusaHeads
    upstream_format = "medusa"
    vllm_method, serving_export = "medusa", True  # SGLang serves no Medusa heads
    top1_metric = "depth1_top1"
    top1_meaning = "head 1 on the target's hidden states of the validation windows"
    recipes = ("medusa2",)  # Medusa-2: the heads trained jointly with the target

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
        joint = self.run_name(cfg.drafter) in self.recipes
        return (medusa2 if joint else objective).recipe(cfg, target, train_tokens)

    def check_training(self, cfg, world_size: int) -> None:
        if self.run_name(cfg.drafter) in self.recipes:
            medusa2.check_settings(cfg, world_size)


KIND = MedusaKind()
