"""From a comparison's winner to serving settings (train/compare/serving.py): each kind's vLLM and SGLang lines,
trees a stack cannot represent rounded and said so, treespec's own names turned into folders a stack loads."""

import json
import shlex
from types import SimpleNamespace

import pytest

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import registry
from treespec.reference import resolve
from treespec.train.compare.categories import make_line
from treespec.train.compare.entries import entry_record, made, max_depth_of
from treespec.train.compare.serving import markdown, run_settings, settings

from tests.helpers import compose_cfg


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


def comparison_run(folder, label: str, entry: dict, tree_spec: dict, tree: str):
    """A comparison run's folder whose only drafter, ``label`` (its ``drafter_entries`` record ``entry``), won with
    ``tree_spec``: the results.json serve_settings reads."""
    records = [{"config": "vanilla", "drafter": "none", "tree": "vanilla", "nodes": 0, "speedup": 1.0, "tau": 1.0},
               {"config": f"{label} | {tree}", "drafter": label, "tree": tree, "nodes": 4, "speedup": 1.8,
                "tau": 2.5, "tree_spec": tree_spec}]
    result = {"format": 3, "stamp": {"target": {"source": "org/target"}}, "settings": {}, "cost_curve": {"1": 0.01},
              "records": records, "drafter_entries": {label: entry}}
    (folder / "results.json").write_text(json.dumps(result))
    return folder


def test_a_checkpoint_loaded_through_auto_is_served_as_the_kind_it_was_detected_as(tmp_path):
    """drafter=upstream's entry is named "auto"; what serves it is the kind its checkpoint turned out to be:
    recorded by the comparison, or (a run from before that was recorded) detected again from its source."""
    chain = {"kind": "chain", "depth": 3}
    recorded = comparison_run(tmp_path, "upstream", {"name": "auto", "source": "/ckpt/e3", "kind": "eagle3"}, chain,
                              "chain γ=3")
    (served,) = run_settings(recorded)
    assert vllm_config(served.vllm) == {"method": "eagle3", "num_speculative_tokens": 3,
                                        "model": "exports/upstream-vllm"}
    assert flags(served.sglang)["--speculative-algorithm"] == "EAGLE3" and served.notes == []
    checkpoint = tmp_path / "e3"
    checkpoint.mkdir()
    (checkpoint / "eagle3_config.json").write_text(json.dumps({"drafter": {}}))  # what detection reads
    older = tmp_path / "older"
    older.mkdir()
    comparison_run(older, "upstream", {"name": "auto", "source": str(checkpoint)}, chain, "chain γ=3")
    assert vllm_config(run_settings(older)[0].vllm)["method"] == "eagle3"
    gone = tmp_path / "gone"
    gone.mkdir()
    comparison_run(gone, "upstream", {"name": "auto", "source": str(tmp_path / "moved")}, chain, "chain γ=3")
    (unread,) = run_settings(gone)
    assert unread.vllm is None and "could not be read to tell which kind it is" in unread.notes[0]


def test_a_dynamic_winner_is_served_with_its_own_numbers():
    """EAGLE-2's dynamic tree is SGLang's own: depth, top-k and tokens (root included) exactly; vLLM takes chains
    only, so it gets the chain of the tree's depth, and the output says so."""
    s = settings("eagle", "eagle", "reference:eagle", DynamicTree(total_tokens=10, depth=4, top_k=3), "org/t")
    assert flags(s.sglang) == {"--model-path": "org/t", "--speculative-algorithm": "EAGLE",
                               "--speculative-draft-model-path": "exports/eagle-sglang",
                               "--speculative-num-steps": "4", "--speculative-eagle-topk": "3",
                               "--speculative-num-draft-tokens": "11"}
    assert vllm_config(s.vllm)["num_speculative_tokens"] == 4
    assert len(s.notes) == 1 and s.notes[0].startswith("vLLM: its speculative config takes chains only")


def test_serve_settings_keeps_a_winner_whose_best_tree_is_dynamic(tmp_path):
    dynamic = {"kind": "dynamic", "total_tokens": 8, "depth": 3, "top_k": 2}
    run = comparison_run(tmp_path, "eagle3", {"name": "eagle3", "source": "runs/heads/eagle3/final"}, dynamic,
                         "dynamic 8")
    (served,) = run_settings(run)
    assert flags(served.sglang)["--speculative-num-draft-tokens"] == "9" and served.vllm
    text = markdown([served])
    assert "## eagle3: dynamic 8" in text and "python -m sglang.launch_server" in text and "chains only" in text


def test_every_kind_the_stacks_serve_says_how():
    """The serving facts are the kinds' own: each one a stack serves gets its method, the others are refused."""
    for kind in registry.KINDS:
        s = settings(kind.name, kind, "/x", Tree.chain(2), "org/t")
        assert (s.vllm is not None) == (kind.vllm_method is not None)
        assert (s.sglang is not None) == (kind.sglang_algorithm is not None)
        assert bool(s.exports) == kind.serving_export


def test_the_comparison_records_the_kind_an_auto_entry_turned_out_to_be():
    cfg = compose_cfg("compare", ["available.upstream.source=/ckpt/e3"])
    assert entry_record(cfg, "upstream", SimpleNamespace(kind="eagle3"))["kind"] == "eagle3"
    assert "kind" not in entry_record(cfg, "eagle", SimpleNamespace(kind="eagle"))  # its name says it already


def test_prompt_lookups_n_gram_sizes_reach_the_drafter_its_record_and_the_stacks():
    """A comparison entry's max_ngram/min_ngram make the drafter, are recorded (and in results.md's code line), and
    the vLLM config serves the sizes it ran with; a kind without settings refuses them by name."""
    cfg = compose_cfg("compare", ["+drafter@available.pl24=prompt_lookup", "available.pl24.max_ngram=4",
                                  "available.pl24.min_ngram=2"])
    _, drafter, _ = made(cfg, "pl24", None)
    assert (drafter.max_ngram, drafter.min_ngram) == (4, 2)
    _, default, _ = made(cfg, "prompt_lookup", None)  # null in conf: the drafter's own defaults
    assert (default.max_ngram, default.min_ngram) == (3, 1) and "settings" not in entry_record(cfg, "prompt_lookup")
    record = entry_record(cfg, "pl24")
    assert record["settings"] == {"max_ngram": 4, "min_ngram": 2}
    assert make_line(record) == "registry.build(\"prompt_lookup\", target, settings={'max_ngram': 4, 'min_ngram': 2})"
    served = settings("pl24", "prompt_lookup", None, Tree.chain(7), "org/t", drafter_settings=record["settings"])
    assert vllm_config(served.vllm) == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4,
                                        "prompt_lookup_min": 2}
    with pytest.raises(ValueError, match="'suffix' takes no settings, got max_ngram"):
        registry.make("suffix", None, settings={"max_ngram": 4})
    with pytest.raises(ValueError, match="'prompt_lookup' takes max_ngram, min_ngram, got alpha"):
        registry.make("prompt_lookup", None, settings={"alpha": 4})


def test_a_part_on_a_tree_of_its_own_does_not_bound_the_step_tree():
    """lookup_dflash: prompt lookup drafts the step's chain (any depth), the block its own 7-node tree; with the block
    on the step's tree too, the block's depth bounds it."""
    cfg = compose_cfg("compare", ["drafters=[lookup_dflash]"])
    parts = [None, SimpleNamespace(block_size=8)]  # prompt lookup has no module; a block of 8 fills depth <= 7
    assert max_depth_of(cfg, "lookup_dflash", parts) is None
    cfg.available.lookup_dflash.part_trees = None
    assert max_depth_of(cfg, "lookup_dflash", parts) == 7
