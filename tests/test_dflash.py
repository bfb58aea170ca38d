"""DFlash (block diffusion drafting, heads/dflash/) and trees over a block (treespec/block_tree.py): the layout and
its target layers, the drafter's context cache in sync with what the target accepts (one row and a ragged batch),
lossless decoding (greedy on the architecture matrix and a ragged batch, chains, static and DDTree trees; sampled
by chi-square, with a negative control), one host read per step, bad input named, the training objective (its
block-sparse pass equals decoding from each anchor; the loss falls), the recipe and exact resume, z-lab's layout
read and written (a hand-built checkpoint against a hand-written forward of the published math)."""

import importlib
import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate
from treespec.block_tree import best_paths
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DFlash, DFlashModel, load, registry
from treespec.heads.checkpoints import export
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.dflash.drafter import rank_accuracy
from treespec.heads.dflash.network import default_target_layers
from treespec.heads.dflash.objective import dflash_loss
from treespec.heads.training.target_states import target_states
from treespec.host_reads import reads_per_step
from treespec.sampling import Sampling
from treespec.train.checks.architectures import FAMILIES, build, expect_greedy, use_attention
from treespec.train.checks.architectures import prompt as matrix_prompt
from treespec.walker import row_by_row

from .helpers import (
    VOCAB,
    accept_everything,
    block_proposal,
    chi2_pvalue,
    compose_cfg,
    conversations,
    exact_distribution,
    expect_batched_greedy,
    heads_cfg,
    hf_greedy,
    norm_w,
    proposed_while_accepting,
    rnd,
    sampled_counts,
    tiny_chat_target,
    tiny_llama,
    write_checkpoint,
    write_jsonl,
)

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 3)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=0).requires_grad_(False)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


def random_dflash(target, seed=0, **options):
    torch.manual_seed(seed)
    return DFlashModel(target, **{"block_size": 4, **options}).eval()


@pytest.fixture(scope="module")
def trained(target, prompt):
    """A block-4 drafter overfit on the target's own greedy continuations (the test prompt's among them): it is often
    right, so rows accept different lengths."""
    g = torch.Generator().manual_seed(0)
    data = hf_greedy(target, torch.cat([prompt, torch.randint(0, 64, (15, 9), generator=g)]), 24)
    model = random_dflash(target).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss, _ = dflash_loss(target, model, data, anchors=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


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
@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)


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


# -- training -------------------------------------------------------------------------------------------------------
def test_anchored_blocks_equal_decoding_from_each_anchor(target):
    """The block-sparse training pass: each anchor's block equals the drafter's pass from that root with the
    context before it, in one row and with packed conversations."""
    model = random_dflash(target, seed=1, num_layers=2)
    windows = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(0))
    features, _ = target_states(target, windows, model.feature_layers)
    anchors = torch.tensor([[1, 5, 9, 12], [3, 4, 10, 13]])
    positions = torch.tensor([list(range(6)) + list(range(8))] * 2)  # two conversations per row: 6 + 8 tokens
    from treespec.heads.training.segments import segment_ids

    segments = segment_ids(positions)
    with torch.no_grad():
        plain = model.anchored(windows, features, anchors)
        packed = model.anchored(windows, features, anchors, positions, segments)
        for b, i in itertools.product(range(2), range(4)):
            a = int(anchors[b, i])
            alone = model(model.block_ids(windows[b, a : a + 1]), features[b : b + 1, :a],
                          torch.arange(a, a + 4)[None], torch.arange(a)[None])
            torch.testing.assert_close(plain[b, i], alone[0], atol=1e-5, rtol=0)
            start = 0 if a < 6 else 6  # its own conversation only, at its own positions
            alone = model(model.block_ids(windows[b, a : a + 1]), features[b : b + 1, start:a],
                          torch.arange(a - start, a - start + 4)[None], torch.arange(a - start)[None])
            torch.testing.assert_close(packed[b, i], alone[0], atol=1e-5, rtol=0)


def test_training_lowers_the_loss(target):
    model = random_dflash(target).train()
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        torch.manual_seed(step)
        loss, metrics = dflash_loss(target, model, batch, anchors=8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert {"kl1", "kl3", "top1_1", "top1_3", "tau", "anchors"} <= metrics.keys() and metrics["anchors"] == 8
    assert all(p.grad is not None for p in model.parameters())
    ce, _ = dflash_loss(target, model, batch, anchors=8, loss="ce")
    assert ce.item() > 0


def test_loss_masks_and_weights(target):
    """The loss is the decay-weighted KL over the scored positions of the anchors the loss mask allows."""
    model = random_dflash(target, seed=3)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [6, 8]] = True  # trained tokens: anchors 5 and 7 (the next token trained), positions scored where trained
    loss, metrics = dflash_loss(target, model, {"input_ids": ids, "loss_mask": mask}, anchors=4, position_decay=0.5)
    assert metrics["anchors"] == 2
    with torch.no_grad():
        features, logits = target_states(target, ids, model.feature_layers)
        log_p = torch.log_softmax(logits[0].float(), -1)
        terms = []  # (weight, KL) of each scored prediction: anchor a's position k predicts token a + k
        for a, k in ((5, 1), (5, 3), (7, 1)):
            out = model(model.block_ids(ids[0, a : a + 1]), features[:, :a], torch.arange(a, a + 4)[None],
                        torch.arange(a)[None])
            log_q = torch.log_softmax(model.logits(out[0, k]).float(), -1)
            terms.append((0.5 ** (k - 1), float((log_p[a + k - 1].exp() * (log_p[a + k - 1] - log_q)).sum())))
    assert loss.item() == pytest.approx(sum(w * kl for w, kl in terms) / sum(w for w, _ in terms), rel=1e-4)
    assert metrics["kl3"] == pytest.approx(terms[1][1], rel=1e-4) and "kl2" not in metrics


def test_rank_accuracy(target, trained):
    windows = hf_greedy(target, torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(9)), 8)
    acc = rank_accuracy(target, trained, windows, top_k=5, batch_size=2)
    assert len(acc) == 3 and all(len(row) == 5 and sum(row) <= 1 + 1e-6 for row in acc)
    with torch.no_grad():  # depth 1 from every root 1..S − 2, recomputed one block at a time
        features, logits = target_states(target, windows, trained.feature_layers)
        hits = []
        for b, a in itertools.product(range(3), range(1, windows.shape[1] - 1)):
            out = trained(trained.block_ids(windows[b, a : a + 1]), features[b : b + 1, :a],
                          torch.arange(a, a + 4)[None], torch.arange(a)[None])
            hits.append(int(trained.logits(out[0, 1]).argmax() == logits[b, a].argmax()))
    assert acc[0][0] == pytest.approx(sum(hits) / len(hits))


def test_recipe_trains_exports_and_drafts(target, prompt, tmp_path):
    cfg = compose_cfg("train_heads", ["drafter=dflash", "drafter.block_size=4", "drafter.accuracy_depth=3",
                                      "drafter.anchors=8", "drafter.num_layers=2"])
    r = registry.get("dflash").recipe(cfg, target)
    assert r.module.block_size == 4 and r.module.target_layer_ids == (0, 3)
    assert registry.get("dflash").target_layers(cfg.drafter, 4) == (1, 4)
    windows = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2))
    loss, metrics = r.loss(windows)
    assert loss.requires_grad and {"kl1", "top1_3", "tau"} <= metrics.keys()
    assert r.evaluate(windows) == r.evaluate(windows) and "dflash_tau" in r.evaluate(windows)
    metrics, acc = r.export(windows, tmp_path)
    assert len(acc) == 3 and json.loads((tmp_path / "head_accuracy.json").read_text()) == acc
    drafter = load(tmp_path, target)
    assert isinstance(drafter, DFlash) and isinstance(r.drafter(), DFlash)
    out = generate(target, prompt, drafter=drafter, max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 8))
    for override, message in (("drafter.block_size=1", "drafter.block_size must be an integer >= 2"),
                              ("drafter.loss=mse", "drafter.loss must be one of"),
                              ("drafter.position_decay=0", r"drafter.position_decay must be a number in \(0, 1\]")):
        from treespec.train.training import drafter_job

        with pytest.raises(ValueError, match=message):
            drafter_job.check_config(compose_cfg("train_heads", ["drafter=dflash", "target=/no/such", override]))


def test_stopped_run_resumes_exactly(tmp_path):
    """train_heads drafter=dflash on chat data: stopped at step 2 and resumed to step 3 equals a run to step 3."""
    from treespec.train.training import drafter_job

    target_dir = tiny_chat_target(tmp_path / "target")
    source = write_jsonl(tmp_path / "chat.jsonl", conversations(24))
    common = ["drafter.block_size=4", "drafter.anchors=4", "trainer.max_steps=4", "trainer.ckpt_every=1",
              "eval.expected_tau=null"]
    drafter_job.run(heads_cfg(tmp_path / "a", target_dir, source, *common, "trainer.stop_after=2", drafter="dflash"))
    drafter_job.run(heads_cfg(tmp_path / "a", target_dir, source, *common, "trainer.stop_after=1", "resume=true",
                              drafter="dflash"))
    drafter_job.run(heads_cfg(tmp_path / "b", target_dir, source, *common, "trainer.stop_after=3", drafter="dflash"))
    a, b = (load_file(tmp_path / r / "ckpt-3" / "state.safetensors") for r in "ab")
    weights = [k for k in a if k.startswith("model.")]
    assert weights and all(torch.equal(a[k], b[k]) for k in weights)


def test_training_from_stored_features_equals_online(tmp_path, monkeypatch):
    """scripts/prepare_features.py's features (the drafter's target layers and the last one) train the same drafter
    as the online target, whose decoder layers then never run."""
    from treespec.reference import load_model
    from treespec.train.training import drafter_job

    target_dir = tiny_chat_target(tmp_path / "target")
    source = write_jsonl(tmp_path / "chat.jsonl", conversations(24))
    common = ["drafter.block_size=4", "drafter.anchors=4", "drafter.num_layers=2", "trainer.max_steps=4",
              "trainer.stop_after=3", "trainer.eval_every=2", "eval.expected_tau=null"]
    features = f"data.features={tmp_path / 'feats'}"
    index = drafter_job.prepare_features(heads_cfg(tmp_path / "unused", target_dir, source, features, *common,
                                                   drafter="dflash"))
    assert index["layers"] == [1, 3]  # two draft layers over a 3-layer target: outputs 0 and 2, and the last
    drafter_job.run(heads_cfg(tmp_path / "online", target_dir, source, *common, drafter="dflash"))

    def refuse(*args, **kwargs):
        raise AssertionError("a decoder layer of the target ran")

    def refusing_layers(spec):  # the target's weights as they were (features are keyed by them), its layers refused
        target, tokenizer = load_model(spec)
        for layer in target.model.layers:
            layer.forward = refuse
        return target, tokenizer

    monkeypatch.setattr(drafter_job, "load_model", refusing_layers)
    drafter_job.run(heads_cfg(tmp_path / "offline", target_dir, source, features, *common, drafter="dflash"))
    online, offline = (load_file(tmp_path / r / "ckpt-3" / "state.safetensors") for r in ("online", "offline"))
    for name in (k for k in online if k.startswith("model.")):
        torch.testing.assert_close(offline[name], online[name], atol=1e-5, rtol=0, msg=name)


# -- z-lab's layout --------------------------------------------------------------------------------------------------
def zlab_checkpoint(folder, g, *, prefix="", **config_changes):
    """A random DFlash checkpoint written as z-lab publishes one, by hand: 2 layers of 4 heads (2 KV heads, head_dim
    8, MLP 48) over target layers 0 and 2, block 4, mask token 61."""
    h, heads, kv, d, inter = 32, 4, 2, 8, 48
    tensors = {"fc.weight": rnd(g, h, 2 * h), "hidden_norm.weight": norm_w(g, h), "norm.weight": norm_w(g, h)}
    shapes = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
              "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    norms = {"self_attn.q_norm": d, "self_attn.k_norm": d, "input_layernorm": h, "post_attention_layernorm": h}
    for i in range(2):
        tensors.update({f"layers.{i}.{name}.weight": rnd(g, *shape) for name, shape in shapes.items()})
        tensors.update({f"layers.{i}.{name}.weight": norm_w(g, n) for name, n in norms.items()})
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
              "num_hidden_layers": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 256, "vocab_size": 64, "block_size": 4, "num_target_layers": 4,
              "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 61}, **config_changes}
    write_checkpoint(folder, config, {prefix + k: v for k, v in tensors.items()}, "model.safetensors")
    return tensors, config


def zlab_logits(tensors, config, target, committed) -> torch.Tensor:
    """The published computation, written out: context = hidden_norm(fc(cat of hidden_states[id + 1])) for the
    tokens before the root; per layer, queries from the normed block, keys/values from the context (not normed by
    the layer) and the normed block, per-head q/k norms, RoPE, attention without a mask; norm; the target's
    lm_head on block positions 1.. → [block_size − 1, V]."""
    def rms(x, w, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, positions):  # x [n, heads, d]
        d = x.shape[-1]
        freqs = positions[:, None].double() / config["rope_theta"] ** (torch.arange(0, d, 2).double() / d)
        angles = torch.cat([freqs, freqs], -1)[:, None].float()
        return x * angles.cos() + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * angles.sin()

    t = {k: v.float() for k, v in tensors.items()}
    ids, size, heads, kv, d = config["dflash_config"]["target_layer_ids"], config["block_size"], 4, 2, 8
    n = committed.shape[1] - 1
    with torch.no_grad():
        hidden = target(input_ids=committed[:, :-1], output_hidden_states=True).hidden_states
        context = rms(torch.cat([hidden[i + 1][0] for i in ids], -1) @ t["fc.weight"].T, t["hidden_norm.weight"])
        block = torch.tensor([int(committed[0, -1])] + [config["dflash_config"]["mask_token_id"]] * (size - 1))
        x = target.get_input_embeddings()(block)
        pos_block, pos_all = torch.arange(n, n + size), torch.arange(n + size)
        for i in range(config["num_hidden_layers"]):
            p = f"layers.{i}."
            normed = rms(x, t[p + "input_layernorm.weight"])
            q = (normed @ t[p + "self_attn.q_proj.weight"].T).view(size, heads, d)
            q = rope(rms(q, t[p + "self_attn.q_norm.weight"]), pos_block)
            both = torch.cat([context, normed])
            k = (both @ t[p + "self_attn.k_proj.weight"].T).view(-1, kv, d)
            k = rope(rms(k, t[p + "self_attn.k_norm.weight"]), pos_all)
            v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, kv, d)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
            x = x + torch.einsum("hqk,khd->qhd", weights, v).reshape(size, -1) @ t[p + "self_attn.o_proj.weight"].T
            mlp_in = rms(x, t[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(mlp_in @ t[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (mlp_in @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        return target.get_output_embeddings()(rms(x, t["norm.weight"]))[1:]


def test_zlab_checkpoint_loads_and_computes_the_published_math(target, prompt, tmp_path):
    g = torch.Generator().manual_seed(0)
    for prefix in ("", "model."):
        folder = tmp_path / f"zlab{prefix}"
        tensors, config = zlab_checkpoint(folder, g, prefix=prefix)
        assert registry.detect(folder).format == "dflash"
        drafter = load(folder, target)
        model = drafter.model
        assert (model.block_size, model.target_layer_ids, model.mask_token_id, model.num_layers) == (4, (0, 2), 61, 2)
        assert model.layer_config.num_attention_heads == 4 and model.layer_config.rope_parameters["rope_theta"] == 1e6
        committed = torch.cat([prompt, torch.tensor([[7]])], 1)
        n = prompt.shape[1]
        with torch.no_grad():
            features, _ = target_states(target, prompt, model.feature_layers)
            ours = model.logits(model(model.block_ids(torch.tensor([7])), features, torch.arange(n, n + 4)[None],
                                      torch.arange(n)[None])[0, 1:])
        torch.testing.assert_close(ours, zlab_logits(tensors, config, target, committed), atol=1e-4, rtol=1e-4)
        out = generate(target, prompt, drafter=drafter, tree=DynamicTree(8, 3, 2), max_new_tokens=12)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))


@pytest.mark.parametrize("change, message", [
    ({"num_target_layers": 36}, "made for a target of 36 layers \\(num_target_layers\\), the target has 4"),
    ({"vocab_size": 151936}, "vocabulary of 151936 tokens"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "no mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [0, 4], "mask_token_id": 61}}, r"ids in 0..3"),
    ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 61}}, r"projects 2 target states"),
    ({"num_hidden_layers": 3}, "num_hidden_layers 3 .config.json. but the tensors hold 2 layers"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "sliding-window draft layers"),
])
def test_zlab_checkpoint_for_another_target_is_refused(target, tmp_path, change, message):
    zlab_checkpoint(tmp_path, torch.Generator().manual_seed(0), **change)
    with pytest.raises(ValueError, match=message):
        load(tmp_path, target)


def test_export_round_trip(target, prompt, trained, tmp_path):
    for to in ("sglang", "vllm"):
        folder = export(DFlash(trained), target, tmp_path / to, to=to)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
        assert config["dflash_config"] == {"target_layer_ids": [2], "mask_token_id": 63, "block_size": 4}
        assert config["num_target_layers"] == 4 and config["num_hidden_layers"] == 1
        back = load(folder, target).model
        assert sorted(load_file(folder / "model.safetensors")) == sorted(trained.state_dict())
        n = prompt.shape[1]
        with torch.no_grad():
            features, _ = target_states(target, prompt, trained.feature_layers)
            a, b = (m.logits(m(m.block_ids(prompt[:, -1]), features, torch.arange(n, n + 4)[None],
                               torch.arange(n)[None])) for m in (trained, back))
        assert torch.equal(a, b)
    for to in ("speculators", "eagle", "medusa"):
        with pytest.raises(Refused, match="has no DFlash drafter"):
            export(DFlash(trained), target, tmp_path / to, to=to)
