"""The prompt-lookup kind (conf/drafter/prompt_lookup.yaml): n-gram matches in the context; no weights, so nothing
to load, score, time or train. vLLM serves it as its ``ngram`` method, SGLang as ``NGRAM``."""

from __future__ import annotations

from treespec.heads.kind import ModelFreeKind
from treespec.heads.prompt_lookup.drafter import PromptLookup

KIND = ModelFreeKind(
    "prompt_lookup", PromptLookup, vllm_method="ngram", sglang_algorithm="NGRAM", settings=("max_ngram", "min_ngram"),
    # vLLM's n-gram sizes are the drafter's, so that the stack drafts as the comparison measured
    vllm_settings={"prompt_lookup_max": "max_ngram", "prompt_lookup_min": "min_ngram"})
