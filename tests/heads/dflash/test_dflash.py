"""DFlash (block diffusion drafting, heads/dflash/) and trees over a block (treespec/block_tree.py): the layout and
its target layers, the drafter's context cache in sync with what the target accepts (one row and a ragged batch),
lossless decoding (greedy on the architecture matrix and a ragged batch, chains, static and DDTree trees; sampled
by chi-square, with a negative control), one host read per step, bad input named. Its training:
tests/heads/dflash/test_dflash_training.py; z-lab's layout read and written:
tests/heads/dflash/test_dflash_upstream.py."""

import importlib
import itertools
import json
import math
import runpy
from pathlib import Path

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.block_tree import best_paths
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DFlash, DFlashModel, registry
from treespec.heads.dflash.network import default_target_layers
from treespec.heads.training.target_states import target_states
from treespec.host_reads import reads_per_step
from treespec.sampling import Sampling
from treespec.train.checks.architectures import FAMILIES, build, expect_greedy, use_attention
from treespec.train.checks.architectures import prompt as matrix_prompt
from treespec.walker import row_by_row

from tests.helpers import (
    VOCAB,
    accept_everything,
    block_proposal,
    chi2_pvalue,
    exact_distribution,
    expect_batched_greedy,
    hf_greedy,
    proposed_while_accepting,
    random_dflash,
    sampled_counts,
    tiny_llama,
)

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 3)}


def test_layout_and_target_layers(target):
    model = random_dflash(target, num_layers=2)
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{k}" for i in (0, 1) for k in LAYER_KEYS}
    assert set(model.state_dict()) == keys
    assert model.target_layer_ids == (0, 3) and model.feature_layers == (1, 4)  # L < 4: spread over 0..L − 1
    assert DFlash(model).feature_layers == (1, 4) and DFlash(model).default_tree == Tree.chain(3)
    assert model.state_dict()["fc.weight"].shape == (32, 64) and model.mask_token_id == 63
    # z-lab's build_target_layer_ids: evenly between layer 1 and L − 3, one draft layer L // 2
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33) and default_target_layers(32, 1) == (16,)
    assert default_target_layers(28, 3) == (1, 13, 25)
    assert random_dflash(target, target_layer_ids=[1, 2, 3]).feature_layers == (2, 3, 4)


# -- the drafter's cache in sync: each proposal equals one recomputed with no cache --------------------------------
def scratch_tokens(model, target, committed, tree) -> dict:
    """{rank path: token} grown from the block recomputed from scratch: the context is the target's features of
    every committed token before the root, the block [root, mask, ...] at the root's position on."""
    n = committed.shape[1] - 1
    with torch.no_grad():
        features, _ = target_states(target, committed[:, :-1], model.feature_layers)
        out = model(model.block_ids(committed[:, -1]), features, torch.arange(n, n + model.block_size)[None],
                    torch.arange(n)[None])
        log_q = torch.log_softmax(model.logits(out[0, 1:]).float(), -1)  # [size − 1, V]
    return block_proposal(log_q, tree)


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("rows", ["one", "ragged"])
def test_proposals_match_recomputation(target, prompt, tree_name, rows, monkeypatch):
    model = random_dflash(target, seed=2)
    for committed, step_tree, proposal in proposed_while_accepting(target, prompt, DFlash(model), TREES[tree_name],
                                                                   rows, monkeypatch):
        got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
        assert got == scratch_tokens(model, target, committed, step_tree)


def test_context_held_over_skipped_steps_equals_context_added_each_step(target):
    """accept() holds its features until the next propose (or keep_rows) adds them in one call: after steps a
    fallback skipped, ragged rows and a finished row, the block is the one a drafter that added each step's at once
    proposes (the same tokens; its states to rounding: a projection over more rows may sum in another order)."""
    model = random_dflash(target, seed=2)
    lazy, eager = DFlash(model), DFlash(model)
    g = torch.Generator().manual_seed(0)
    width = len(model.feature_layers) * target.config.hidden_size
    prompt_features = torch.randn(2, 5, width, generator=g)
    for d in (lazy, eager):
        d.reset()
        d.prefill(torch.zeros(2, 5, dtype=torch.long), prompt_features)
    lengths = [6, 6]  # the prompt's 5 and the first root
    for step, paths in enumerate(([[1]], [[1, 2, 3]], [[]]), start=1):
        accepted = [torch.tensor(paths[0]), torch.tensor(paths[0][: step % 2 + 1])]  # rows accept differently
        features = torch.randn(2, 4, width, generator=g)
        for d in (lazy, eager):
            d.accept(accepted, features)
        eager._add_held()
        lengths = [n + len(a) + 1 for n, a in zip(lengths, accepted, strict=True)]
    assert len(lazy._held) == 3 and not eager._held
    tokens = torch.randint(0, 64, (2, max(lengths)), generator=g)
    committed = Committed(tokens, lengths)
    first = [d.propose(committed, None, Tree.chain(3), Sampling(0.0)) for d in (lazy, eager)]
    assert torch.equal(first[0].tokens, first[1].tokens) and not lazy._held
    for d in (lazy, eager):  # a step held, then row 0 finishes: keep_rows adds it before selecting
        d.accept([torch.tensor([5]), torch.tensor([])], torch.randn(2, 2, width, generator=torch.Generator()))
        d.keep_rows(torch.tensor([1]))
    kept = Committed(tokens[1:], [lengths[1] + 1])
    blocks = [d._block(kept.tokens[:, lengths[1]]) for d in (lazy, eager)]
    torch.testing.assert_close(blocks[0], blocks[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lazy._block(tokens[:1, 0]), eager._block(tokens[:1, 0]), rtol=1e-5, atol=1e-5)


# -- lossless: greedy ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_equals_vanilla(target, prompt, trained, tree_name):
    out = generate(target, prompt, drafter=DFlash(trained), tree=TREES[tree_name], max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    assert sum(out.accept_lengths) == 24 - 1 and out.mean_accept_length > 1.2


@pytest.mark.parametrize("tree_name", list(TREES))
def test_ragged_batch_equals_transformers_batched_greedy(target, trained, tree_name):
    expect_batched_greedy(target, DFlash(trained, candidates="sample"), TREES[tree_name])  # greedy: top-k ranks


@pytest.mark.parametrize("tree_name", ["chain", "full"])
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_architecture_matrix(name, tree_name):
    """A random DFlash on each family of the matrix (its features, embeddings and lm_head; Qwen3 layers whatever the
    family), greedy equal to transformers."""
    target = use_attention(build(name), "eager", next(f for f in FAMILIES if f.name == name))
    torch.manual_seed(0)
    drafter = DFlash(DFlashModel(target, block_size=4).eval())
    expect_greedy(target, matrix_prompt(), drafter, TREES[tree_name])


def test_default_tree_draft_vocabulary_and_depths(target, prompt, trained):
    vocab = registry.get("dflash").make(trained, draft_vocab=None)
    assert vocab.default_tree == Tree.chain(3) and vocab.max_tree_depth == 3
    from treespec.heads.drafting.vocab import DraftVocab

    fr = DFlash(trained, draft_vocab=DraftVocab(torch.arange(0, 64, 2), 64))  # FR-Spec: even ids only
    for tree in (None, DynamicTree(32, 7, 2)):  # a budget deeper than the block is grown over the block
        out = generate(target, prompt, drafter=fr, tree=tree, max_new_tokens=12)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))
    with pytest.raises(ValueError, match="deeper than the 3 levels DFlash can fill"):
        generate(target, prompt, drafter=DFlash(trained), tree=Tree.chain(4), max_new_tokens=8)


def test_in_a_combination_and_timed(target, prompt, trained):
    """Beside another drafter in a Combined (accepted paths holding the other's tokens), and its kind's cost: one
    call per proposal."""
    from treespec.heads import Combined, SuffixDecoding

    combined = Combined([SuffixDecoding(), DFlash(trained)])
    for tree in (Tree.full(2, 3), DynamicTree(8, 3, 2)):
        out = generate(target, prompt, drafter=combined, tree=tree, max_new_tokens=20)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 20))
    fixed, per_depth = registry.get("dflash").cost(DFlash(trained))
    assert fixed > 0 and per_depth == 0


# -- lossless: sampling ---------------------------------------------------------------------------------------------
SAMPLED = {"sampled-tree": ("sample", Tree.full(2, 2)), "without-replacement": ("without_replacement", Tree.full(3, 2)),
           "ddtree-topk": ("topk", DynamicTree(5, 2, 2)), "chain-topk": ("topk", Tree.chain(2)),
           "traversal-sampled-tree": ("sample", Tree.full(2, 2), "traversal")}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampling_is_lossless(small, case):
    candidates, tree, *acceptance = SAMPLED[case]
    drafter = DFlash(random_dflash(small, block_size=3), candidates=candidates)
    sampling = Sampling(1.0)
    counts = sampled_counts(small, drafter, tree, sampling, acceptance=(acceptance or ["rejection"])[0])
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_sampling_from_a_training_vocabulary_is_lossless(small):
    """A block trained over part of the vocabulary (drafter.train_vocab) drafts from it by default: q is zero outside,
    and the output is still distributed as the target's."""
    from treespec.heads.drafting.vocab import DraftVocab

    model = random_dflash(small, block_size=3)
    model.set_vocab(DraftVocab(torch.arange(0, VOCAB, 2), VOCAB))
    drafter = DFlash(model, candidates="sample")
    assert drafter._head.vocab is model.vocab
    sampling = Sampling(1.0)
    counts = sampled_counts(small, drafter, Tree.full(2, 2), sampling)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_wrong_acceptance_is_detected(small, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(small, DFlash(random_dflash(small, block_size=3)), Tree.chain(2), sampling)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) < 1e-3


def test_sampled_candidates_carry_their_depths_distribution(target, prompt):
    model = random_dflash(target)
    drafter = DFlash(model, candidates="sample")
    features, _ = target_states(target, prompt, model.feature_layers)
    drafter.prefill(prompt, features)
    committed = torch.cat([prompt, torch.tensor([[5]])], 1)
    tree = Tree.full(2, 2)
    proposal = drafter.propose(Committed(committed, [committed.shape[1]]), features[:, -1], tree, Sampling(1.0),
                               torch.Generator().manual_seed(0)).row(0)
    n = prompt.shape[1]
    with torch.no_grad():
        out = model(model.block_ids(torch.tensor([5])), features, torch.arange(n, n + 4)[None], torch.arange(n)[None])
        q = torch.softmax(model.logits(out[0, 1:]).float(), -1)  # [3, V]
    for node in range(tree.num_nodes):
        if tree.children[node]:  # node at depth d: its children were drawn from depth d + 1's distribution
            torch.testing.assert_close(proposal.q_draft[node], q[tree.depth_list[node]], atol=1e-5, rtol=0)
        else:
            assert not proposal.q_draft[node].any()


# -- host reads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("rows", [1, 3])
def test_one_host_read_per_step(target, tree_name, rows):
    ids = torch.randint(0, 16, (rows, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0
    bound = 2 if tree_name == "dynamic" else 1  # a dynamic tree's shape is read once, after the block
    for temperature, candidates in ((0.0, "topk"), (1.0, "topk" if tree_name == "dynamic" else "sample")):
        reads = reads_per_step(target, ids, drafter=DFlash(random_dflash(target), candidates=candidates),
                               tree=TREES[tree_name], max_new_tokens=12, temperature=temperature,
                               generator=torch.Generator().manual_seed(0), attention_mask=mask if rows > 1 else None)
        assert reads["device"] <= bound, (temperature, reads)


# -- DDTree: the best tree over a block --------------------------------------------------------------------------------
def test_best_paths_are_the_best_nodes_and_a_tree():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        depth, k = 1 + trial % 4, 1 + trial % 3
        log_q = torch.log_softmax(torch.randn(depth, 6, generator=g) * 2, -1).topk(k).values.tolist()
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
        score = {p: sum(log_q[i][r] for i, r in enumerate(p)) for p in paths}
        for budget in (1, 3, 7, 100):
            kept = best_paths(log_q, budget)
            assert kept == sorted(paths, key=lambda p: (-score[p], p))[:budget]
            Tree(kept)  # parents and better-ranked siblings kept
    assert best_paths([[0.0, -math.inf]], 5) == [(0,)]  # a token without mass is never proposed


# -- bad input ----------------------------------------------------------------------------------------------------
def test_bad_input_is_named(target, tmp_path):
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
            DFlashModel(target, block_size=bad)
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 4\] must be decoder-layer outputs of the 4-layer "
                                         r"target: ids in 0..3"):
        DFlashModel(target, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match="mask_token_id 64 is not a token"):
        DFlashModel(target, mask_token_id=64)
    model = random_dflash(target, target_layer_ids=[3])
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size 32 \(drafter\) vs 48 \(target\)"):
        DFlashModel.from_pretrained(tmp_path, tiny_llama(hidden=48, layers=4, seed=1))
    with pytest.raises(ValueError, match=r"num_hidden_layers 4 \(drafter\) vs 2 \(target\).*target layers \[3\]"):
        DFlashModel.from_pretrained(tmp_path, tiny_llama(layers=2, seed=1))
    with pytest.raises(ValueError, match="DFlash drafter was trained for another target"):
        generate(tiny_llama(vocab=80, layers=4), torch.tensor([[1, 2]]), drafter=DFlash(model), max_new_tokens=4)
    with pytest.raises(ValueError, match="grows deterministic top-k candidates"):
        generate(target, torch.tensor([[1, 2]]), drafter=DFlash(model, candidates="sample"), tree=DynamicTree(4, 2, 2),
                 max_new_tokens=4, temperature=1.0)


def test_target_layer_ids_from_a_hydra_override_are_accepted():
    # `drafter.target_layer_ids=[1,14,26]` on the command line arrives as an omegaconf ListConfig, not a list: it was
    # refused as "not a list" before any model loaded
    from omegaconf import OmegaConf

    from treespec.heads.dflash.objective import target_layers

    d = OmegaConf.create({"target_layer_ids": [1, 14, 26], "num_layers": 1})
    assert target_layers(d, 30) == (2, 15, 27)  # hidden_states indices: what stored features must hold
    with pytest.raises(ValueError, match=r"ids in 0..29"):
        target_layers(OmegaConf.create({"target_layer_ids": [1, 30], "num_layers": 1}), 30)


def test_a_checkpoint_config_or_argument_of_the_wrong_type_is_named(target, tmp_path):
    # each failed inside a check (a TypeError in fits, an AttributeError, int() of ','), or read a string's letters
    with pytest.raises(ValueError, match=r"target_layer_ids must be a list of decoder-layer ids \(0..3\), got '0,1'"):
        DFlashModel(target, target_layer_ids="0,1")
    with pytest.raises(ValueError, match=r"DFlash layer must be a dict of layer values .* got 'x'"):
        DFlashModel(target, layer="x")
    random_dflash(target).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "dflash_config.json").read_text())
    for key, value, message in (("target_layer_ids", "abc", r"target_layer_ids='abc' \(not a list of layer ids\)"),
                                ("target_layer_ids", None, r"target_layer_ids=None"),
                                ("architecture", "x", r"architecture='x' \(not a dict\)"),
                                ("layer", "abc", r"layer='abc' \(not a dict\)")):
        (tmp_path / "dflash_config.json").write_text(json.dumps({**saved, key: value}))
        with pytest.raises(ValueError, match=r"DFlash config .*dflash_config.json: " + message):
            DFlashModel.from_pretrained(tmp_path, target)
    # a drafter's own default tree is named as such at generate's door, not as a tree= never given
    with pytest.raises(ValueError, match=r"DFlash's default_tree must be a Tree, .* got str: 'x'"):
        generate(target, torch.tensor([[1, 2]]), drafter=DFlash(random_dflash(target), default_tree="x"),
                 max_new_tokens=4)
    with pytest.raises(ValueError, match=r"DFlash's default_tree Tree\(nodes=9.* is deeper than the 3 levels"):
        generate(target, torch.tensor([[1, 2]]), drafter=DFlash(random_dflash(target), default_tree=Tree.chain(9)),
                 max_new_tokens=4)


def test_speed_checks_times_a_block_against_a_depth():
    """``scripts/speed_checks.py``'s section 3 (a DFlash block of 8 against an EAGLE-3 depth) on the reference target:
    every step timed, the ratios its table prints are the block's time over the one-node depth's."""
    script = runpy.run_path(str(Path(__file__).resolve().parents[3] / "scripts" / "speed_checks.py"))
    out = script["block_costs"](reference.load("target")[0], rounds=1)
    assert set(out["block"]) == {"full", "fr2048"} and set(out["depth"]) == {1, 4}
    assert all(t > 0 for t in (*out["block"].values(), *out["depth"].values()))
    for vocab, ratio in out["ratio"].items():
        assert ratio == pytest.approx(out["block"][vocab] / out["depth"][1])
