"""From a comparison's winner to serving settings (train/compare/serving.py): each kind's vLLM and SGLang lines,
trees a stack cannot represent rounded and said so, treespec's own names turned into folders a stack loads."""

import json
import shlex

from treespec import Tree
from treespec.reference import resolve
from treespec.train.compare.serving import markdown, settings


def vllm_config(line: str) -> dict:
    words = shlex.split(line)
    return json.loads(words[words.index("--speculative-config") + 1])


def flags(line: str) -> dict:
    words = shlex.split(line)
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}


def test_an_eagle3_chain_is_served_exactly_by_both_stacks():
    s = settings("eagle3", "eagle3", "runs/heads/eagle3/final", Tree.chain(4), "org/target")
    assert s.exports == [f"python scripts/export_drafter.py runs/heads/eagle3/final --target org/target --to {stack} "
                         f"--out exports/eagle3-{stack}" for stack in ("vllm", "sglang")]
    assert vllm_config(s.vllm) == {"method": "eagle3", "num_speculative_tokens": 4, "model": "exports/eagle3-vllm"}
    assert shlex.split(s.vllm)[:3] == ["vllm", "serve", "org/target"]
    assert flags(s.sglang) == {"--model-path": "org/target", "--speculative-algorithm": "EAGLE3",
                               "--speculative-draft-model-path": "exports/eagle3-sglang",
                               "--speculative-num-steps": "4", "--speculative-eagle-topk": "1",
                               "--speculative-num-draft-tokens": "5"}
    assert s.notes == []


def test_a_branching_tree_is_rounded_and_says_so():
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    s = settings("eagle", "eagle", "reference:eagle", tree, "/models/t", verifier="org/t")
    assert vllm_config(s.vllm)["num_speculative_tokens"] == 3 and "--verifier org/t" in s.exports[0]
    sglang = flags(s.sglang)
    assert (sglang["--speculative-eagle-topk"], sglang["--speculative-num-draft-tokens"]) == ("2", "6")
    assert len(s.notes) == 2 and "not its 5-node tree" in s.notes[0] and "not this exact tree" in s.notes[1]


def test_each_kind_maps_to_its_method():
    medusa = settings("medusa", "medusa", "reference:medusa", Tree.chain(3), "reference:target")
    assert vllm_config(medusa.vllm)["method"] == "medusa" and medusa.sglang is None
    assert medusa.notes == ["SGLang serves no medusa drafter"] and len(medusa.exports) == 1
    assert shlex.split(medusa.vllm)[2] != "reference:target"  # a folder the stack can load, not treespec's name
    assert shlex.split(medusa.vllm)[2].endswith(str(resolve("reference:target"))[-20:])
    lookup = settings("prompt_lookup", "prompt_lookup", None, Tree.chain(2), "org/t")
    assert vllm_config(lookup.vllm) == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                        "prompt_lookup_min": 1}
    ngram = flags(lookup.sglang)  # NGRAM sets its own breadth and depth: only the tokens per step are given
    assert ngram == {"--model-path": "org/t", "--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": "3"}
    assert lookup.exports == [] and "NGRAM grows its own tree" in lookup.notes[0]
    draft = settings("draft", "draft", "/models/small", Tree.chain(2), "org/t")
    assert vllm_config(draft.vllm) == {"method": "draft_model", "num_speculative_tokens": 2, "model": "/models/small"}
    assert flags(draft.sglang)["--speculative-algorithm"] == "STANDALONE"
    other = settings("x", "somekind", "/x", Tree.chain(2), "org/t")
    assert other.vllm is None and other.sglang is None and other.notes
    text = markdown([medusa, lookup])
    assert "## medusa" in text and "vllm serve" in text and "- SGLang serves no medusa drafter" in text


def test_paths_with_spaces_stay_one_argument():
    s = settings("eagle3", "eagle3", "/my runs/eagle3", Tree.chain(2), "/my models/t", out_dir="/my exports")
    assert shlex.split(s.vllm)[2] == "/my models/t" and vllm_config(s.vllm)["model"] == "/my exports/eagle3-vllm"
    assert flags(s.sglang)["--speculative-draft-model-path"] == "/my exports/eagle3-sglang"
    assert shlex.split(s.exports[0])[2] == "/my runs/eagle3"
