"""The draft-model kind (SpS: Leviathan et al. 2023, Chen et al. 2023): a small causal LM of the target's
tokenizer, trained by the language-model job (scripts/train_lm.py) or distilled from a target (heads/draft_model/
objective.py). Its checkpoint is a transformers model folder
(format "transformers"), so ``treespec.heads.load("reference:draft", target)`` reads one as it reads EAGLE's or
Medusa's. A PARD model (heads/draft_model/parallel.py) is a draft model too, adapted by the recipe ``pard``
(conf/drafter/pard.yaml; heads/draft_model/pard_objective.py): its config.json holds its mask token
(``pard_token``), and such a folder drafts k depths in one pass (``ParallelDraft``) whichever way it is loaded."""

from __future__ import annotations

from transformers import PreTrainedModel

from treespec.drafter import CANDIDATE_MODES
from treespec.heads.checkpoints.drafter_folder import check_same_vocab
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.draft_model import objective, parallel, pard_objective
from treespec.heads.draft_model.drafter import DraftModel, rank_accuracy
from treespec.heads.draft_model.parallel import ParallelDraft, pard_settings
from treespec.heads.kind import DrafterKind
from treespec.reference import load_model

# keys that mark another kind's checkpoint (EAGLE's fusion layer, EAGLE-3's norm), whatever its config.json says:
# SafeAILab's EAGLE-1 configs name LlamaForCausalLM too
OTHER_KINDS = ("fc.weight", ".hidden_norm.")


class DraftModelKind(DrafterKind):
    """A small causal LM of the target's tokenizer (conf/drafter/draft.yaml; reference:draft)."""

    name = "draft"
    candidate_modes = CANDIDATE_MODES
    reduces_vocab = True
    module_type = PreTrainedModel
    upstream_format = "transformers"
    title = "draft model"
    vllm_method, sglang_algorithm = "draft_model", "STANDALONE"  # both load its transformers folder as it is
    top1_metric = "top1"
    top1_meaning = ("the draft model's argmax against the target's, teacher forced on the validation data's scored "
                    "positions")
    recipes = ("pard",)  # PARD: a trained draft adapted to fill k positions in one pass (a draft model still)

    def load(self, source, target):
        return load_model(source, dtype=target.dtype)[0].to(target.device)

    def new_drafter(self, module, candidates, draft_vocab, lean) -> DraftModel:
        drafter = DraftModel if pard_settings(module.config) is None else ParallelDraft
        return drafter(module, candidates=candidates, draft_vocab=draft_vocab, lean=lean)

    def rank_accuracy(self, target, module, windows, **options) -> list[list[float]]:
        settings = pard_settings(module.config)
        if settings is None:
            return rank_accuracy(target, module, windows, **options)
        k, mask_token_id = settings
        return parallel.rank_accuracy(target, module, windows, parallel=k, mask_token_id=mask_token_id, **options)

    def max_depth(self, module) -> int | None:
        settings = pard_settings(module.config)
        return None if settings is None else settings[0]

    def check_module(self, d, module) -> None:
        if self.run_name(d) in self.recipes and pard_settings(module.config) is None:
            raise ValueError(f"{d.get('source')} is a draft model that PARD did not adapt (its config.json has no "
                             "pard_token): give drafter=pard a PARD run's folder as its source (python "
                             "scripts/train_heads.py drafter=pard exports one), or draft with it as drafter=draft")

    def detects(self, weights, config, where) -> bool:
        return is_causal_lm(weights, config)

    def from_upstream(self, found, target, **options):
        return self.load(found.folder, target)  # read again by transformers, with treespec's checks

    def check_fits(self, module, target) -> None:
        check_same_vocab(module, target, "draft model")

    def to_upstream(self, module, target, to, *, verifier, speculative_tokens):
        raise Refused("a draft model is a transformers model folder already: save it with save_pretrained and "
                      "serve it as the draft model")

    def recipe(self, cfg, target, train_tokens=None):
        pard = self.run_name(cfg.drafter) in self.recipes
        return (pard_objective if pard else objective).recipe(cfg, target, train_tokens)

    def check_training(self, cfg, world_size: int) -> None:
        (pard_objective if self.run_name(cfg.drafter) in self.recipes else objective).check_settings(cfg)


KIND = DraftModelKind()


def is_causal_lm(weights: dict, config: dict) -> bool:
    """A whole causal LM: a ``*ForCausalLM`` architecture with token embeddings and decoder layers, none of the
    tensors that mark a drafter's head."""
    architectures = config.get("architectures") or []
    return (any(isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures)
            and any("embed" in k or k.endswith("wte.weight") for k in weights)
            and any(".layers.0." in k or ".h.0." in k for k in weights)
            and not any(k.endswith(OTHER_KINDS[0]) or OTHER_KINDS[1] in k for k in weights))
