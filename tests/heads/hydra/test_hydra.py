"""Hydra heads (heads/hydra/): each node's children depend on its own path; lossless greedy on the reference target and
on two more families, sampled output distributed as the target's (chi-square, with a negative control); the prefix
layer's cache equals a forward over the whole sequence, in a ragged batch too; training resumes exactly; export and
load; bad settings and files are refused with the reason."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate, reference
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Hydra, HydraHeads, load, registry
from treespec.heads.checkpoints.export import export
from treespec.heads.hydra.drafter import rank_accuracy
from treespec.heads.training.target_states import target_hidden
from treespec.sampling import Sampling
from treespec.train.checks.architectures import BY_NAME, build, expect_greedy, prompt, use_attention
from treespec.walker import row_by_row

from tests.helpers import (
    PROMPT,
    RUNS,
    VOCAB,
    accept_everything,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    random_hydra,
    sampled_counts,
    tiny_llama,
)

TREES = [Tree.chain(3), Tree.full(2, 3), Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


# -- the heads: path dependence and their start --------------------------------------------------------------------
def test_children_depend_on_the_path_and_untrained_heads_repeat_the_base(target):
    """Two depth-1 siblings get different children from one head (Medusa's would be equal); untrained heads, prefix
    layer included (its gate starts at zero), predict what the base lm_head predicts."""
    heads = random_hydra(target, num_heads=2)
    drafter = Hydra(heads)
    ids = prompt()[:, :12]
    _, hidden = target_hidden(target, ids)
    committed = type("C", (), {"tokens": ids, "lengths": [ids.shape[1]]})()
    tree = Tree.full(2, 2)
    proposal = drafter.propose(committed, hidden[:, -1], tree, Sampling(0.0)).tokens[0]  # nodes 1..6
    assert proposal[2:4].tolist() != proposal[4:6].tolist()  # the two siblings' children

    fresh = HydraHeads(target, num_heads=3, num_layers=2, prefix_attention=True).eval()
    base = fresh.base(hidden)
    assert torch.equal(base, hidden)
    path = fresh.embed(torch.randint(0, 64, (1, ids.shape[1], 3)))
    assert torch.allclose(fresh.project(2, fresh.head_out(2, base, path)), target.get_output_embeddings()(hidden))


# -- greedy: vanilla's tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("tree", TREES, ids=["chain3", "full2x3", "paths7"])
def test_greedy_equals_vanilla(target, tree, prefix):
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    drafter = Hydra(random_hydra(target, prefix_attention=prefix, num_layers=2))
    out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=30)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 30))


def test_a_ragged_batch_equals_its_rows_and_the_prefix_cache_equals_a_full_forward(target, monkeypatch):
    """Left-padded rows that accept different numbers of tokens and leave at different steps: every row is vanilla
    greedy's, and at every proposal the prefix layer's cached base state equals the layer run over the row's whole
    committed sequence at once (what training computes)."""
    heads = random_hydra(target, prefix_attention=True, num_layers=2, seed=3)
    drafter = Hydra(heads)
    seen = []
    propose = Hydra.propose

    def recording(self, committed, feature, tree, sampling, generator=None):
        seen.append(([committed.row(b).clone() for b in range(len(committed.lengths))], self._base.clone()))
        return propose(self, committed, feature, tree, sampling, generator)

    monkeypatch.setattr(Hydra, "propose", recording)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2, 3, 4]), torch.tensor([8, 8, 3])]
    out = generate(target, rows, drafter=drafter, tree=Tree.full(2, 2), max_new_tokens=16)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, -16:], hf_greedy(target, row[None], 16)[0, len(row):])
    assert len(seen) > 3 and len(seen[0][0]) == 3
    with torch.no_grad():
        for tokens, base in seen:
            for b, committed in enumerate(tokens):
                _, hidden = target_hidden(target, committed[None, :-1])  # up to the root's predecessor
                assert torch.allclose(base[b], heads.base(hidden)[0, -1], atol=1e-5)


def test_reference_target_greedy_equals_vanilla():
    """The shipped reference:hydra on two held-out prompts: vanilla greedy's tokens, and it speculates."""
    target, tokenizer = reference.load("target")
    drafter = registry.build("hydra", target, source="reference:hydra")
    taus = []
    for text in reference.prompts()[:2]:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -96:]
        expected = generate(target, ids, max_new_tokens=32).sequences
        for tree in (Tree.chain(3), Tree.full(2, 2)):
            out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=32)
            assert torch.equal(out.sequences, expected), tree
            taus.append(out.mean_accept_length)
    assert sum(taus) / len(taus) > 1.2


@pytest.mark.parametrize("family", ["Qwen3", "Mistral"])  # q/k norms; a sliding window of 8 (20-token prompts)
@pytest.mark.parametrize("prefix", [False, True])
def test_families_greedy_equal_transformers(family, prefix):
    """Random Hydra heads (with prefix attention: a layer of the family's own class) on tiny random models."""
    target = use_attention(build(family), "eager", BY_NAME[family])
    drafter = Hydra(random_hydra(target, num_heads=3, prefix_attention=prefix))
    for tree in (Tree.full(2, 2), Tree.chain(3)):
        expect_greedy(target, prompt(), drafter, tree)


# -- sampling: the target's law, and a control that the test can fail -------------------------------------------
@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


@pytest.mark.parametrize("candidates,runs", [("sample", 600), ("without_replacement", 600),
                                             pytest.param("sample", RUNS, marks=pytest.mark.slow)])
def test_sampling_matches_exact_distribution(small_target, candidates, runs):
    sampling = Sampling(1.0)
    drafter = Hydra(random_hydra(small_target, num_heads=2, scale=2.0), candidates=candidates)
    counts = sampled_counts(small_target, drafter, Tree.full(2, 2), sampling, runs=runs)
    assert counts.sum() == runs
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small_target, monkeypatch):
    """Negative control: the same drafter and tree with every drafted path accepted must fail the test."""
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    drafter = Hydra(random_hydra(small_target, num_heads=2, scale=2.0), candidates="sample")
    counts = sampled_counts(small_target, drafter, Tree.full(2, 2), sampling, runs=600)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


# -- folders: export, load, refusals --------------------------------------------------------------------------------
def test_save_load_round_trip_and_no_upstream_layout(target, tmp_path):
    heads = random_hydra(target, prefix_attention=True, num_layers=2, share=False)
    heads.save_pretrained(tmp_path / "h")
    drafter = load(tmp_path / "h", target)  # detected by its hydra_config.json
    assert isinstance(drafter, Hydra) and registry.detect(tmp_path / "h").kind == "hydra"
    assert all(torch.equal(v, drafter.heads.state_dict()[k]) for k, v in heads.state_dict().items())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    windows = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(4))
    assert rank_accuracy(target, drafter.heads, windows) == rank_accuracy(target, heads, windows)
    out = generate(target, ids, drafter=drafter, tree=Tree.full(2, 2), max_new_tokens=12)
    assert torch.equal(out.sequences, generate(target, ids, drafter=Hydra(heads), tree=Tree.full(2, 2),
                                               max_new_tokens=12).sequences)
    with pytest.raises(ValueError, match="vllm has no layout for Hydra heads"):
        export(drafter, target, tmp_path / "x", to="vllm")


def test_bad_files_and_settings_are_refused(target, tmp_path):
    random_hydra(target).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"Hydra drafter was trained for another target: hidden_size 32 \(drafter\) "
                                         r"vs 48 \(target\)"):
        HydraHeads.from_pretrained(tmp_path, tiny_llama(hidden=48, seed=1))
    config = json.loads((tmp_path / "hydra_config.json").read_text())
    (tmp_path / "hydra_config.json").write_text(json.dumps({**config, "num_layers": "2", "extra": 1}))
    with pytest.raises(ValueError, match=r"Hydra config in .*unknown extra; bad num_layers='2'"):
        HydraHeads.from_pretrained(tmp_path, target)
    with pytest.raises(ValueError, match="Hydra num_heads must be an integer >= 1, got 0"):
        HydraHeads(target, num_heads=0)
    drafter = Hydra(random_hydra(target))
    with pytest.raises(ValueError, match=r"deeper than the 3 levels Hydra can fill"):
        generate(target, PROMPT, drafter=drafter, tree=Tree.chain(4), max_new_tokens=8)
    with pytest.raises(ValueError, match=r"Hydra cannot grow DynamicTree.*give it a static Tree"):
        generate(target, PROMPT, drafter=drafter, tree=DynamicTree(6, 2, 2), max_new_tokens=8)
    with pytest.raises(ValueError, match="candidates must be one of"):
        Hydra(random_hydra(target), candidates="typical")


@pytest.mark.parametrize("override,message", [
    ("drafter.prefix_attention=maybe", "drafter.prefix_attention must be"),
    ("drafter.num_heads=0", "drafter.num_heads"),
    ("drafter.distill=1", "drafter.distill must be"),
])
def test_bad_training_settings_are_refused_before_loading(override, message):
    from treespec.train.training import drafter_job

    with pytest.raises(ValueError, match=message):
        drafter_job.run(compose_cfg("train_heads", ["drafter=hydra", override, "logger=none", "target=/nonexistent"]))


# -- training: every option on, interrupted and resumed to the same weights -----------------------------------------
def test_training_resumes_exactly_and_learns(tmp_path, tiny_trained_target):
    from treespec.train.training import drafter_job

    target_dir, cache = tiny_trained_target
    common = ["debug=tiny_heads", "drafter=hydra", f"target={target_dir}", cache, "drafter.prefix_attention=true",
              "drafter.distill=true", "drafter.num_layers=2", "drafter.num_heads=3", "trainer.max_steps=20",
              "tree=chain", "tree.depth=3", "logger=none", "eval.expected_tau=null"]
    drafter_job.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "trainer.stop_after=8"]))
    resumed = drafter_job.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "resume=true"]))
    whole = drafter_job.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'b'}"]))
    assert whole["steps"] == resumed["steps"] == 20
    a, b = (load_file(tmp_path / r / "final" / "hydra.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("prefix.") for k in a) and not torch.all(a["prefix_gate"] == 0)  # the layer trained

    tuned, _ = reference.load_model(str(target_dir))
    drafter = load(tmp_path / "b" / "final", tuned)
    ids = torch.randint(0, tuned.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    out = generate(tuned, ids, drafter=drafter, tree=Tree.chain(3), max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(tuned, ids, 24))
    assert whole["eval_mean_accept_length"] > 1.0  # trained on the target's greedy continuations: it drafts
