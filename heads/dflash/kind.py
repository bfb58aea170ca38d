"""The DFlash kind (conf/drafter/dflash.yaml): treespec's folders and z-lab's DFlash checkpoints
(heads/dflash/upstream.py), trained by heads/dflash/objective.py. It drafts with the target's own lm_head, so FR-Spec
(a reduced draft vocabulary) applies."""

from __future__ import annotations

from treespec.drafter import CANDIDATE_MODES
from treespec.heads.dflash import objective
from treespec.heads.dflash.drafter import DFlash, rank_accuracy
from treespec.heads.dflash.network import DFlashModel
from treespec.heads.dflash.upstream import dflash_from_upstream, dflash_to_upstream, is_dflash
from treespec.heads.kind import DrafterKind
from treespec.reference import resolve


class DFlashKind(DrafterKind):
    name = "dflash"
    candidate_modes = CANDIDATE_MODES
    reduces_vocab = True
    module_type = DFlashModel
    upstream_format = "dflash"
    needs_config_json = True  # heads, RoPE, target layers and the mask token are read from it
    title = "DFlash"
    # z-lab's README: vLLM's --speculative-config method "dflash", SGLang's --speculative-algorithm DFLASH, both on
    # the z-lab layout export writes (not run here: docs/usage.md, "DFlash")
    vllm_method, sglang_algorithm, serving_export = "dflash", "DFLASH", True
    top1_metric = "dflash_top1_1"
    top1_meaning = ("block position 1 of blocks anchored at random trained positions of the validation data, teacher "
                    "forced, against the target's argmax")
    layers_key = "drafter.target_layer_ids"

    def load(self, source, target) -> DFlashModel:
        return DFlashModel.from_pretrained(resolve(source), target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> DFlash:
        return DFlash(module, candidates=candidates, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)

    def max_depth(self, module) -> int:
        return module.block_size - 1

    def detects(self, weights, config, where) -> bool:
        return is_dflash(weights, config)

    def from_upstream(self, found, target, **options) -> DFlashModel:
        return dflash_from_upstream(found.weights, found.config, target, found.where)

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        config, tensors = dflash_to_upstream(module, target, to)
        return config, tensors, "model.safetensors"

    def recipe(self, cfg, target, train_tokens=None):
        return objective.recipe(cfg, target, train_tokens)

    def target_layers(self, d, num_hidden_layers: int) -> tuple[int, ...]:
        return objective.target_layers(d, num_hidden_layers)

    def check_training(self, cfg, world_size: int) -> None:
        objective.check_settings(cfg.drafter)


KIND = DFlashKind()
