"""The compare command a drafter run prints at its end (train/training/run_summary.py): it parses as
scripts/compare_trees.py's overrides, its workload resolves to exactly the conversations a chat run held out for
validation (never one it trained on), and its trees sit around the best ones the run's accuracies and cost model
predict."""

import shlex

import pytest
from omegaconf import OmegaConf

from treespec.planning.autotree import CostModel, chains_only, choose_tree
from treespec.planning.tree_spec import check_tree_spec
from treespec.train.compare import job_config as compare
from treespec.train.compare.configurations import expand_specs
from treespec.train.compare.templates import PromptTemplate
from treespec.train.compare.workload import load_workload
from treespec.train.training import run_summary
from treespec.train.training.chat import prepare_chat
from treespec.train.training.conversations import load_rows

from tests.helpers import chat_tokenizer, compose_cfg, conversations, write_jsonl

COSTS = CostModel({1: 1.0, 2: 1.0, 4: 1.01, 8: 1.03, 16: 1.1, 32: 1.3, 64: 1.7, 128: 2.5}, draft_cost_per_depth=0.02)
GOOD = [[0.8, 0.1, 0.04]] * 8    # acc[d][r]: a drafter that mostly agrees with the target
USELESS = [[0.01, 0.005]] * 8


def printed_config(command: str):
    """The compare config the printed command composes (as scripts/compare_trees.py would)."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "scripts/compare_trees.py"], argv
    return compose_cfg("compare", ["logger=none", *argv[2:]])


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.mark.parametrize("kind,system_prompt", [("jsonl", None), ("parquet", "be brief, friend: 'ok'")])
def test_the_printed_command_times_the_runs_held_out_conversations(tmp_path, tok, kind, system_prompt):
    rows = conversations(60, seed=7)
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    if kind == "parquet":  # another source kind: read through the datasets library, as training reads it
        load_rows(str(source), cache_dir=tmp_path / "hf").to_parquet(str(tmp_path / "chat.parquet"))
        source = tmp_path / "chat.parquet"
    overrides = ["data=chat", f"data.chat.source={source}", "trainer.seq_len=96", "data.chat.val_fraction=0.25"]
    if system_prompt:
        overrides.append(f"data.chat.system_prompt={run_summary.hydra_value(system_prompt)}")
    train_cfg = compose_cfg("train_heads", overrides)
    chat = prepare_chat(train_cfg.data.chat, tok, tmp_path / "cache", progress=False)
    assert 5 <= len(chat.val) <= 24 and chat.val_by_hash

    workload, note = run_summary.training_workload(train_cfg.data, {"data_val_conversations": len(chat.val)})
    trees, _ = run_summary.suggested_trees(GOOD, COSTS)
    command = run_summary.compare_command("eagle3", tmp_path / "final", str(tmp_path / "target"), workload, trees)
    cfg = printed_config(command)
    compare.check_workload(cfg)
    assert OmegaConf.to_container(cfg.trees) == trees and cfg.drafters == ["eagle3"]
    assert cfg.workload.system_prompt == system_prompt and "held out" in note

    w = load_workload(cfg.workload, prompts=cfg.prompts)
    items = w.timed + w.held_out
    assert len(items) == len(chat.val) and w.held_out and "held out for validation" in w.source
    template = PromptTemplate(tok, cfg.workload.template, cfg.workload.system_prompt)
    val_texts = [tok.decode(chat.val.sample(i)[0].tolist()) for i in range(len(chat.val))]
    train_texts = [tok.decode(chat.train.sample(i)[0].tolist()) for i in range(len(chat.train))]
    for item in items:  # what the comparison asks is the start of one held-out conversation, of no trained one
        asked = template.renderer.render(template.messages(item, 1, []))
        assert sum(t.startswith(asked) for t in val_texts) == 1, asked
        assert not any(t.startswith(asked) for t in train_texts), asked

    # the negative control: the same file without the selection holds conversations the run trained on
    plain = OmegaConf.merge(cfg.workload, {"chat_validation": None, "prompts": None})
    everything = load_workload(plain, prompts=None)
    asked = [template.renderer.render(template.messages(i, 1, [])) for i in everything.timed + everything.held_out]
    assert any(t.startswith(a) for a in asked for t in train_texts)


def test_a_stdlib_run_compares_on_the_held_out_code_prompts_and_a_bad_selection_is_refused(tmp_path):
    stdlib = compose_cfg("train_heads", [])
    workload, note = run_summary.training_workload(stdlib.data, {})
    assert workload == ["workload=reference"] and "held-out code prompts" in note
    cfg = printed_config(run_summary.compare_command("medusa", tmp_path / "final", "reference:target", workload))
    assert cfg.workload.source == "reference" and cfg.target == "reference:target"
    with pytest.raises(ValueError, match="chat_validation.*not workload=reference"):
        compare.check_workload(compose_cfg("compare", ["+workload.chat_validation=0.02"]))
    with pytest.raises(ValueError, match=r"chat_validation=1.5 must be the training run's data.chat.val_fraction"):
        compare.check_workload(compose_cfg("compare", ["workload=jsonl", "workload.path=x.jsonl",
                                                       "workload.chat_validation=1.5"]))
    source = write_jsonl(tmp_path / "other.jsonl", conversations(4))
    with pytest.raises(ValueError, match="no conversation of it is in the validation split"):
        load_workload(compose_cfg("compare", ["workload=jsonl", f"workload.path={source}",
                                              "workload.chat_validation=0.001"]).workload)


def test_suggested_trees_surround_the_best_predicted_chain_and_tree():
    trees, line = run_summary.suggested_trees(GOOD, COSTS)
    chain, _ = choose_tree(chains_only(GOOD), COSTS)
    tree, _ = choose_tree(GOOD, COSTS)
    gamma, nodes = chain.tree.depth, len(tree.tree)
    assert gamma >= 3 and nodes >= 4  # a drafter this good is worth deep chains and real trees here
    assert trees == [{"kind": "chain", "depth": [gamma - 2, gamma, gamma + 2]},
                     {"kind": "accuracy", "nodes": [nodes // 2, nodes, 2 * nodes]}, {"kind": "auto"}]
    assert f"chain γ={gamma}" in line and f"accuracy tree of {nodes} nodes" in line
    for spec in expand_specs(trees):  # as the comparison expands them: each a valid tree spec
        check_tree_spec(spec)
    # a drafter predicted never to pay: the shortest chains and small trees, still measured
    trees, line = run_summary.suggested_trees(USELESS, COSTS)
    assert trees[:2] == [{"kind": "chain", "depth": [1, 2, 3]}, {"kind": "accuracy", "nodes": [4, 8]}]
    assert "chain γ=0" in line


def test_hydra_values_are_quoted_only_when_they_must_be():
    assert run_summary.hydra_value("/data/chat.jsonl") == "/data/chat.jsonl"
    assert run_summary.hydra_value("reference:target") == "'reference:target'"
    assert run_summary.hydra_value("it's a, b") == "'it\\'s a, b'"
    assert run_summary.hydra_value("null") == "'null'" and run_summary.hydra_value("42") == "'42'"
