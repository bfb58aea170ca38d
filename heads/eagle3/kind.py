"""The EAGLE-3 kind (conf/drafter/eagle3.yaml): treespec's folders and upstream EAGLE-3 checkpoints (SafeAILab,
SpecForge, SGLang, vLLM, speculators), trained by heads/eagle3/objective.py. Its head has a draft vocabulary of
its own, so FR-Spec does not apply."""

from __future__ import annotations

from treespec.drafter import CANDIDATE_MODES
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.eagle3 import objective
from treespec.heads.eagle3.drafter import Eagle3, rank_accuracy
from treespec.heads.eagle3.network import Eagle3Model
from treespec.heads.eagle3.upstream import (
    UpstreamEagle3Model,
    eagle3_from_upstream,
    is_eagle3,
    normalize_eagle3_keys,
)
from treespec.heads.eagle3.upstream_export import eagle3_to_upstream
from treespec.heads.kind import DrafterKind
from treespec.heads.training.objective import check_loss
from treespec.reference import resolve


class Eagle3Kind(DrafterKind):
    name = "eagle3"
    candidate_modes = CANDIDATE_MODES
    module_type = Eagle3Model
    upstream_format = "eagle3"
    needs_config_json = True  # heads, RoPE and norms are read from it
    upstream_options = ("aux_layers", "written_by")  # what its config may leave unsaid (heads/eagle3/upstream.py)
    title = "EAGLE-3"
    vllm_method, sglang_algorithm, serving_export = "eagle3", "EAGLE3", True
    top1_metric = "eagle3_top1_0"
    top1_meaning = ("step 0, teacher forced on the validation windows, only positions whose target token is in the "
                    "draft vocabulary, against the target's argmax over that vocabulary")
    layers_key = "drafter.aux_layers"
    export_hint = "drafter.layer=llama"  # the decoder layer the serving stacks implement

    def load(self, source, target) -> Eagle3Model:
        return Eagle3Model.from_pretrained(resolve(source), target)

    def load_folder(self, folder, config, target) -> Eagle3Model:
        if "upstream" in config:  # an upstream layer kept as it was (heads/eagle3/upstream.py)
            return UpstreamEagle3Model.from_pretrained(folder, target)
        return Eagle3Model.from_pretrained(folder, target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Eagle3:
        return Eagle3(module, candidates=candidates, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)

    def detects(self, weights, config, where) -> bool:
        return config.get("speculators_model_type") is not None or is_eagle3(normalize_eagle3_keys(weights, where))

    def from_upstream(self, found, target, *, aux_layers=None, written_by=None) -> Eagle3Model:
        return eagle3_from_upstream(found.weights, found.config, target, found.where, aux_layers=aux_layers,
                                    written_by=written_by)

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        if to == "medusa":
            raise Refused("an EAGLE-3 drafter cannot be written as Medusa heads")
        config, tensors = eagle3_to_upstream(module, target, to, verifier=verifier,
                                             speculative_tokens=speculative_tokens)
        return config, tensors, "model.safetensors"

    def recipe(self, cfg, target, train_tokens=None):
        return objective.recipe(cfg, target, train_tokens)

    def target_layers(self, d, num_hidden_layers: int) -> tuple[int, ...]:
        return objective.target_layers(d, num_hidden_layers)

    def check_training(self, cfg, world_size: int) -> None:
        check_loss(cfg.drafter.get("loss"))


KIND = Eagle3Kind()
