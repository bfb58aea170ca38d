"""The EAGLE-1/2 kind (conf/drafter/eagle.yaml): treespec's folders and upstream EAGLE-1/2 checkpoints (SafeAILab,
vLLM, SGLang), trained by heads/eagle/objective.py."""

from __future__ import annotations

from treespec.drafter import CANDIDATE_MODES
from treespec.heads.checkpoints.upstream_common import Refused, strip_model_prefix
from treespec.heads.eagle import objective
from treespec.heads.eagle.drafter import Eagle, rank_accuracy
from treespec.heads.eagle.network import VARIANTS, EagleModel
from treespec.heads.eagle.upstream import eagle_from_upstream, eagle_to_upstream, is_eagle1
from treespec.heads.kind import DrafterKind
from treespec.heads.training.objective import check_loss
from treespec.heads.training.vocab_teacher import check_train_vocab
from treespec.reference import resolve


class EagleKind(DrafterKind):
    name = "eagle"
    candidate_modes = CANDIDATE_MODES
    reduces_vocab = True
    module_type = EagleModel
    upstream_format = "eagle"
    needs_config_json = True  # heads, RoPE and norms are read from it
    title = "EAGLE"
    vllm_method, sglang_algorithm, serving_export = "eagle", "EAGLE", True
    top1_metric = "top1_0"
    top1_meaning = "step 0 fed the target's features, teacher forced on the validation windows"
    layers_key = "drafter.feature_layers"
    export_hint = "drafter.variant=upstream, no fusion"  # the layout SafeAILab's EAGLE, vLLM and SGLang read

    def load(self, source, target) -> EagleModel:
        return EagleModel.from_pretrained(resolve(source), target)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> Eagle:
        return Eagle(module, candidates=candidates, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        return rank_accuracy(target, module, windows, **options)

    def detects(self, weights, config, where) -> bool:
        # a speculators config is EAGLE-3's (heads/eagle3/kind.py) whatever its tensors look like
        return is_eagle1(strip_model_prefix(weights, where)) and config.get("speculators_model_type") is None

    def from_upstream(self, found, target, **options) -> EagleModel:
        return eagle_from_upstream(found.weights, found.config, target, found.where)

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        if to == "speculators":
            raise Refused("speculators cannot hold an EAGLE-1 drafter (vLLM reads speculators' eagle3 format only)")
        if to == "medusa":
            raise Refused("an EAGLE drafter cannot be written as Medusa heads")
        if module.vocab is not None:
            raise Refused(f"this EAGLE drafter was trained over {len(module.vocab)} of the target's tokens "
                          "(drafter.train_vocab); upstream EAGLE-1 layouts draft through the full head and have no "
                          "place for its vocabulary: train without drafter.train_vocab to export it")
        config, tensors = eagle_to_upstream(module, target, to)
        return config, tensors, "pytorch_model.bin" if to == "eagle" else "model.safetensors"

    def recipe(self, cfg, target, train_tokens=None):
        return objective.recipe(cfg, target, train_tokens)

    def target_layers(self, d, num_hidden_layers: int) -> tuple[int, ...]:
        return objective.target_layers(d, num_hidden_layers)

    def check_training(self, cfg, world_size: int) -> None:
        variant = cfg.drafter.get("variant", "treespec")
        if variant not in VARIANTS:
            raise ValueError(f"drafter.variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        check_loss(cfg.drafter.get("loss"))
        check_train_vocab(cfg.drafter.get("train_vocab"))


KIND = EagleKind()
