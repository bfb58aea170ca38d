"""EAGLE-3 drafter: the training-time-test unroll equals sequential drafting, the token-only loss and its
mask, lossless decoding (greedy and sampled, static and dynamic trees) with a reduced draft vocabulary,
the drafter's cache in sync with what the target accepts, checkpoints in the upstream layout, and the
draft vocabulary map."""

import copy
import importlib
import json

import pytest
import torch
from transformers import DynamicCache

from treespec import Tree, generate
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads.drafting.vocab import token_counts
from treespec.heads.eagle3.drafter import Eagle3, rank_accuracy
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map, default_aux_layers
from treespec.heads.eagle3.objective import eagle3_loss
from treespec.heads.training.target_states import target_states
from treespec.heads.training.unroll import unrolled
from treespec.sampling import Sampling
from treespec.walker import row_by_row

from tests.helpers import (
    VOCAB,
    accept_deepest,
    chi2_pvalue,
    exact_distribution,
    hf_greedy,
    random_eagle3,
    record_proposals,
    sampled_counts,
    scratch_proposal,
    tiny_llama,
)

UPSTREAM_KEYS = {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                 "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                 "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                 "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
                 "d2t", "t2d"}
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 4, 3)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=0)  # 4 layers: distinct aux layers (1, 2, 3)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


def test_model_layout(target):
    model = random_eagle3(target, draft_vocab=24)
    assert model.aux_layers == (1, 2, 3) and Eagle3(model).feature_layers == (1, 2, 3)
    assert set(model.state_dict()) == UPSTREAM_KEYS
    sd = model.state_dict()
    assert sd["fc.weight"].shape == (32, 3 * 32) and sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert sd["lm_head.weight"].shape == (24, 32) and sd["d2t"].dtype == torch.int64 and sd["t2d"].shape == (64,)
    assert default_aux_layers(32) == (2, 16, 29) and default_aux_layers(7) == (2, 3, 4)
    assert default_aux_layers(4) == (1, 2, 3) and default_aux_layers(2) == (1, 1, 1)
    assert Eagle3Model(target, aux_layers=(0, -2, -1)).aux_layers == (0, 3, 4)
    with pytest.raises(ValueError, match="must index the target's 5 hidden states"):
        Eagle3Model(target, aux_layers=(1, 2, 7))


# -- (a) training-time test: the unrolled step i is sequential drafting ------------------------------------
def test_unrolled_steps_equal_sequential_drafting(target):
    model = random_eagle3(target, draft_vocab=40, seed=1)
    batch = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    steps = 3
    with torch.no_grad():
        features, _ = target_states(target, batch, model.aux_layers)
        fused = model.fuse(features[:, :-1])  # [b, n, H]
        outs = dict(unrolled(model, batch, fused, steps, by_root=True))
        n = batch.shape[1] - 1
        assert [o.shape[1] for o in outs.values()] == [n - i for i in range(steps + 1)]
        for b in range(2):
            for root in range(n):
                # sequential drafting: the committed entries 0..root, then one token at a time fed its parent's output
                cache = DynamicCache(config=model.layer_config)
                out = model(batch[b : b + 1, 1 : root + 2], fused[b : b + 1, : root + 1], cache=cache)[:, -1:]
                for i in range(steps + 1):
                    if root + 1 + i > n:
                        break
                    if i:
                        out = model(batch[b : b + 1, root + 1 + i : root + 2 + i], out, cache=cache)
                    assert torch.allclose(outs[i][b, root], out[0, -1], atol=1e-5), (b, root, i)


# -- (b) the loss: forward KL to the restricted target, argmax outside the draft vocabulary masked -----------
def test_loss_equals_hand_computed_kl_and_masks_positions(target):
    batch = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        target_logits = target(input_ids=batch).logits[0].double()  # [S, V]
    argmax = target_logits.argmax(-1)
    # a draft vocabulary of 20 tokens holding the target's argmax at positions 1, 3, 5, 7 only
    keep = {int(argmax[p]) for p in (1, 3, 5, 7)}
    others = [t for t in range(64) if t not in set(argmax.tolist())]
    counts = torch.zeros(64)
    counts[sorted(keep) + others[: 20 - len(keep)]] = 1
    d2t, t2d = build_vocab_map(counts, 20)
    model = Eagle3Model(target, vocab_map=(d2t, t2d))
    draft_ids = (torch.arange(20) + d2t).tolist()

    loss, metrics = eagle3_loss(target, model, batch, unroll_steps=0)
    with torch.no_grad():
        hidden = target(input_ids=batch, output_hidden_states=True).hidden_states
        fused = model.fc(torch.cat([hidden[i] for i in model.aux_layers], -1))
        draft_logits = model.lm_head(model.norm(model(batch[:, 1:], fused[:, :-1])))[0].double()  # [S - 1, 20]
    kls = []
    for j in range(batch.shape[1] - 1):  # entry j predicts the token after position j + 1
        if int(argmax[j + 1]) not in draft_ids:
            continue
        p = torch.softmax(target_logits[j + 1, draft_ids], -1)
        q = torch.softmax(draft_logits[j], -1)
        kls.append(sum(float(p[v] * (p[v].log() - q[v].log())) for v in range(20)))
    assert 4 <= len(kls) < batch.shape[1] - 1  # some positions are masked out
    assert metrics["kept_fraction"] == pytest.approx(len(kls) / (batch.shape[1] - 1))
    assert loss.item() == pytest.approx(sum(kls) / len(kls), rel=1e-4)

    # unrolled: step i weighted decay ** i
    loss, metrics = eagle3_loss(target, model, batch, unroll_steps=2, decay=0.5)
    assert loss.item() == pytest.approx(metrics["kl0"] + 0.5 * metrics["kl1"] + 0.25 * metrics["kl2"], rel=1e-5)


def test_training_lowers_the_loss(target):
    target = copy.deepcopy(target).requires_grad_(False)  # frozen, as in training
    model = random_eagle3(target, draft_vocab=32).train()
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss, _ = eagle3_loss(target, model, batch, unroll_steps=2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.parameters()) and len(list(model.parameters())) == 13


# -- (c) greedy: token for token what transformers' greedy decoding gives ------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("draft_vocab", [24, 64])
def test_greedy_equals_vanilla(target, prompt, tree_name, draft_vocab):
    model = random_eagle3(target, draft_vocab=draft_vocab)
    out = generate(target, prompt, drafter=Eagle3(model), tree=TREES[tree_name], max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    assert sum(out.accept_lengths) == 24 - 1


@pytest.mark.parametrize("layer", ["llama", "target"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures(prompt, arch, layer):
    """layer="target" builds the layer from the target's own classes: Qwen2's q/k/v biases, Qwen3's q/k norms;
    the default, layer="llama", Llama's classes with the target's sizes (no biases, no q/k norms), as upstream."""
    import transformers

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, initializer_range=0.2, attn_implementation="sdpa", bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    target = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    model = random_eagle3(target, draft_vocab=24, layer=layer)
    extra = {"qwen2": "midlayer.self_attn.q_proj.bias", "qwen3": "midlayer.self_attn.q_norm.weight"}[arch]
    assert (extra in model.state_dict()) == (layer == "target")
    assert model.state_dict()["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert type(model.midlayer.self_attn).__name__ == ("LlamaAttention" if layer == "llama" else f"{name}Attention")
    out = generate(target, prompt, drafter=Eagle3(model), tree=DynamicTree(8, 4, 3), max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 16))


def test_default_tree_and_draft_vocabulary_smaller_than_top_k(target, prompt):
    model = random_eagle3(target, draft_vocab=2)  # top-3 children: the third is outside the draft vocabulary
    for tree in (None, Tree.full(3, 2), DynamicTree(8, 3, 3)):
        out = generate(target, prompt, drafter=Eagle3(model), tree=tree, max_new_tokens=12)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))
    assert Eagle3(model).default_tree == DynamicTree(16, 5, 4)




@pytest.mark.parametrize("tree", [Tree.full(2, 2), DynamicTree(6, 3, 2)], ids=["full", "dynamic"])
def test_proposals_match_recomputation(target, prompt, tree, monkeypatch):
    """Each step's proposal equals one recomputed from scratch (no cache) over the committed sequence."""
    model = random_eagle3(target, draft_vocab=24, seed=2)
    drafter = Eagle3(model)
    seen = record_proposals(drafter)
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_deepest))
    out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=16)
    assert out.mean_accept_length > 2.5 and len(seen) > 3
    with torch.no_grad():
        for committed, step_tree, proposal in seen:
            hidden = target(input_ids=committed[:, :-1], output_hidden_states=True).hidden_states
            fused = model.fuse(torch.cat([hidden[i] for i in model.aux_layers], -1))  # [1, L - 1, H]

            def logits_at(path, fused=fused, committed=committed):
                ids, feats = committed[:, 1:], fused
                for token in path:  # a node pairs its token with its parent's output
                    out = model(ids, feats)[:, -1:]
                    ids, feats = torch.cat([ids, torch.tensor([[token]])], 1), torch.cat([feats, out], 1)
                return model.logits(model(ids, feats)[0, -1])

            got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
            assert got == scratch_proposal(logits_at, step_tree)


# -- (d) sampling: exactly the target's distribution, with a 3-of-4 draft vocabulary ----------------------
@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)


@pytest.mark.parametrize("case", ["static-sampled", "dynamic"])
def test_sampling_is_lossless_with_reduced_vocabulary(small, case):
    torch.manual_seed(0)
    model = Eagle3Model(small, vocab_map=build_vocab_map(torch.tensor([0, 5, 3, 9]), 3)).eval()  # drops token 0
    assert model.draft_ids.tolist() == [1, 2, 3]
    # sampled candidates (SpecInfer's rule, q_draft zero outside the draft vocabulary) on a static tree, and
    # top-k candidates (EAGLE-2's sibling rule) on a dynamic one; 1,200 runs catch a q_draft off by 0.15
    candidates, tree = ("sample", Tree.full(2, 2)) if case == "static-sampled" else ("topk", DynamicTree(4, 2, 2))
    sampling = Sampling(1.0)
    counts = sampled_counts(small, Eagle3(model, candidates=candidates), tree, sampling, runs=1200)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_sampled_candidates_stay_in_the_draft_vocabulary(target, prompt):
    model = random_eagle3(target, draft_vocab=10)
    drafter = Eagle3(model, candidates="sample")
    drafter.reset()
    with torch.no_grad():
        features, _ = target_states(target, prompt, model.aux_layers)
    drafter.prefill(prompt, features)
    committed = torch.cat([prompt, torch.tensor([[5]])], 1)
    proposal = drafter.propose(Committed(committed, [committed.shape[1]]), features[:, -1], Tree.full(3, 2),
                               Sampling(1.0), torch.Generator().manual_seed(0)).row(0)
    outside = ~model.t2d
    assert model.t2d[proposal.tokens].all()
    assert (proposal.q_draft[:, outside] == 0).all() and torch.allclose(proposal.q_draft[0].sum(), torch.tensor(1.0))


# -- (e) checkpoints ------------------------------------------------------------------------------------------
def test_save_load_round_trip_and_mismatches_are_refused(target, prompt, tmp_path):
    model = random_eagle3(target, draft_vocab=24, seed=3)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3.safetensors", "eagle3_config.json"]
    config = json.loads((tmp_path / "eagle3_config.json").read_text())
    assert config["draft_vocab_size"] == 24 and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    loaded = Eagle3Model.from_pretrained(tmp_path, target)
    saved, back = model.state_dict(), loaded.state_dict()
    assert set(back) == UPSTREAM_KEYS and all(torch.equal(saved[k], back[k]) for k in saved)

    runs = [generate(target, prompt, drafter=Eagle3(m), tree=DynamicTree(8, 4, 3), max_new_tokens=16,
                     temperature=1.0, generator=torch.Generator().manual_seed(0)) for m in (model, loaded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and runs[0].accept_lengths == runs[1].accept_lengths
    for m in (model, loaded):  # identical proposals
        d = Eagle3(m)
        d.reset()
        with torch.no_grad():
            features, _ = target_states(target, prompt, m.aux_layers)
        d.prefill(prompt, features)
        committed = torch.cat([prompt, torch.tensor([[7]])], 1)
        runs.append(d.propose(Committed(committed, [committed.shape[1]]), features[:, -1], Tree.full(2, 3),
                              Sampling()))
    assert torch.equal(runs[2].tokens, runs[3].tokens)

    with pytest.raises(ValueError, match=r"hidden_size 32 \(drafter\) vs 48 \(target\)"):
        Eagle3Model.from_pretrained(tmp_path, tiny_llama(hidden=48, layers=4, seed=1))
    with pytest.raises(ValueError, match=r"vocab_size 64 \(drafter\) vs 80 \(target\)"):
        Eagle3Model.from_pretrained(tmp_path, tiny_llama(vocab=80, layers=4, seed=1))
    with pytest.raises(ValueError, match=r"num_hidden_layers 4 \(drafter\) vs 2 \(target\).*aux layers \[3\]"):
        Eagle3Model.from_pretrained(tmp_path, tiny_llama(layers=2, seed=1))
    with pytest.raises(ValueError, match="EAGLE-3 drafter was trained for another target"):
        generate(tiny_llama(hidden=48, layers=4), prompt, drafter=Eagle3(model), max_new_tokens=4)


# -- (f) the draft vocabulary ---------------------------------------------------------------------------------
def test_build_vocab_map():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 2, 5])  # ties: 2 and 5 (9), then 0, 3, 7 (5)
    d2t, t2d = build_vocab_map(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 5] and d2t.dtype == torch.int64
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    d2t, t2d = build_vocab_map(counts, 8)
    assert d2t.tolist() == [0] * 8 and t2d.all()  # the full vocabulary is the identity
    for bad in (0, 9):
        with pytest.raises(ValueError, match="draft vocabulary size must be in 1..8"):
            build_vocab_map(counts, bad)
    tokens = torch.tensor([[3, 3, 1], [0, 3, 7]])
    assert token_counts(tokens, 8).tolist() == [1, 1, 0, 3, 0, 0, 0, 1]
    assert token_counts(tokens, 8, mask=tokens != 3).tolist() == [1, 1, 0, 0, 0, 0, 0, 1]


def test_rank_accuracy(target):
    model = random_eagle3(target, draft_vocab=6, seed=4)
    windows = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    acc = rank_accuracy(target, model, windows, depth=3, top_k=8, batch_size=2)
    assert len(acc) == 3 and all(len(row) == 8 and sum(row) <= 1 + 1e-6 for row in acc)
    # depth 1 recomputed: the drafter's rank-r target id (ranks 6, 7 lie outside its 6-token vocabulary) is
    # the target's argmax
    with torch.no_grad():
        features, target_logits = target_states(target, windows, model.aux_layers)
        top = model.logits(model(windows[:, 1:], model.fuse(features[:, :-1]))).topk(8).indices
        expected = (top == target_logits[:, 1:].argmax(-1, keepdim=True)).float().mean((0, 1))
    assert model.t2d[top[..., :6]].all() and not model.t2d[top[..., 6:]].any()
    assert torch.allclose(torch.tensor(acc[0]), expected, atol=1e-6)


# -- the training recipe ----------------------------------------------------------------------------------------
def test_recipe_trains_exports_and_drafts(target, prompt, tmp_path):
    from treespec.heads.eagle3.objective import recipe

    from tests.helpers import compose_cfg

    cfg = compose_cfg("train_heads", ["experiment=reference_eagle3", "drafter.draft_vocab_size=16",
                                      "drafter.unroll_steps=2", "drafter.accuracy_depth=3"])
    stream = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(2))
    r = recipe(cfg, target, train_tokens=stream)
    assert r.module.draft_vocab_size == 16 and r.module.aux_layers == (1, 2, 3)
    assert torch.equal(r.module.t2d, build_vocab_map(token_counts(stream, 64), 16)[1])
    windows = stream[:99].view(3, 33)
    loss, metrics = r.loss(windows)
    assert loss.requires_grad and {"kl0", "kl1", "kl2", "top1_2", "kept_fraction"} <= metrics.keys()
    assert "eagle3_kl2" in r.evaluate(windows)
    metrics, acc = r.export(windows, tmp_path)
    assert len(acc) == 3 and json.loads((tmp_path / "head_accuracy.json").read_text()) == acc
    drafter = Eagle3(Eagle3Model.from_pretrained(tmp_path, target))
    out = generate(target, prompt, drafter=drafter, max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 8)) and isinstance(r.drafter(), Eagle3)
