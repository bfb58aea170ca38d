"""The opt-in serving check's own parts (train/checks/interop_serving.py), without vLLM: the printed line it
parses, the counters it reads, the comparison prompts it rebuilds. The vLLM run itself is
``scripts/interop_check.py --vllm`` (docs/interop.md)."""

import json

import pytest

from treespec import Tree, reference
from treespec.train.checks.interop_serving import printed_vllm, spec_counters, workload_prompts
from treespec.train.compare.serving import settings

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 6.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 18.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 9.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="t"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 4.0
"""


def test_the_printed_vllm_line_parses_back_to_its_arguments_and_config():
    s = settings("eagle3", "eagle3", "reference:eagle3", Tree.chain(3), "/models/my target", out_dir="/tmp/ex")
    args, config = printed_vllm(s.vllm)
    assert args[:2] == ["serve", "/models/my target"]
    assert config == {"method": "eagle3", "num_speculative_tokens": 3, "model": "/tmp/ex/eagle3-vllm"}
    with pytest.raises(ValueError, match="not a vllm serve line"):
        printed_vllm("python -m sglang.launch_server --model-path t")


def test_spec_counters_sum_engines_and_skip_other_series():
    assert spec_counters(METRICS) == {"drafts": 6.0, "accepted": 11.0}
    assert spec_counters("") == {"drafts": 0.0, "accepted": 0.0}


def test_the_reference_workload_prompts_are_rebuilt_and_others_refused():
    _, tokenizer = reference.load("target")
    with open(reference.MODELS_DIR / "prompts.jsonl") as f:
        row = json.loads(f.readline())
    n = len(tokenizer(row["text"]).input_ids)
    stamp = {"workload": {"formats": {"reference": 24}, "template": "none"}}
    info = {"id": row["source"], "turn": 1, "prompt_tokens": n, "max_new_tokens": 32}
    prompts = workload_prompts({"stamp": stamp, "prompt_info": [info]}, tokenizer)
    assert prompts == [{"id": row["source"], "ids": tokenizer(row["text"]).input_ids, "max_new_tokens": 32}]
    with pytest.raises(ValueError, match="tokens here"):  # not the prompt the run measured
        workload_prompts({"stamp": stamp, "prompt_info": [{**info, "prompt_tokens": n + 1}]}, tokenizer)
    chat = {"workload": {"formats": {"jsonl": 8}, "template": "auto", "source": "q.jsonl"}}
    with pytest.raises(ValueError, match="reference workload only"):
        workload_prompts({"stamp": chat, "prompt_info": [info]}, tokenizer)
