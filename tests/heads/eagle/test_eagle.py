"""EAGLE drafter and EAGLE-2 dynamic trees: lossless decoding (greedy and sampled), proposals equal to a
from-scratch recomputation step after step (the drafter's cache stays in sync with what the target
accepts), dynamic-tree properties, refused mismatched weights, and the hydra training entry."""

import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel
from treespec.heads.eagle import Eagle, EagleModel
from treespec.planning.tree_spec import build_tree
from treespec.reference import load_model
from treespec.sampling import Sampling
from treespec.train.training.data import TokenBatches
from treespec.walker import row_by_row

from tests.helpers import (
    RUNS,
    VOCAB,
    accept_deepest,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    perturbed,
    random_eagle,
    random_eagle3,
    record_proposals,
    sampled_counts,
    scratch_logits,
    scratch_proposal,
    tiny_llama,
)

TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 4, 3)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


# -- greedy: token for token what transformers' greedy decoding gives ------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("fused", [False, True])
def test_eagle_greedy_equals_vanilla(target, prompt, tree_name, fused):
    model = random_eagle(target, (1, 1, -1) if fused else (-1,))
    out = generate(target, prompt, drafter=Eagle(model), tree=TREES[tree_name], max_new_tokens=30)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 30))
    assert sum(out.accept_lengths) == 30 - 1


@pytest.mark.parametrize("draft_name", ["self", "perturbed"])
def test_draft_model_dynamic_tree_greedy_equals_vanilla(target, prompt, draft_name):
    draft = target if draft_name == "self" else perturbed(target)
    for tree in (DynamicTree(8, 4, 3), DynamicTree(1, 3, 2), DynamicTree(40, 6, 4)):
        out = generate(target, prompt, drafter=DraftModel(draft), tree=tree, max_new_tokens=30)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 30))
    if draft_name == "self":  # a perfect draft with a chain-shaped budget: every draft accepted
        out = generate(target, prompt, drafter=DraftModel(draft), tree=DynamicTree(3, 3, 1), max_new_tokens=30)
        assert out.accept_lengths[:-1] == [4] * (len(out.accept_lengths) - 1)


def test_default_tree_and_short_budgets(target, prompt):
    model = random_eagle(target)
    for max_new_tokens in (1, 2, 4):  # the dynamic tree is truncated as few tokens remain
        out = generate(target, prompt, drafter=Eagle(model), max_new_tokens=max_new_tokens)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, max_new_tokens))
    with pytest.raises(ValueError, match="candidates='sample' needs a static Tree"):
        generate(target, prompt, drafter=DraftModel(target, candidates="sample"), tree=DynamicTree(4, 2, 2),
                 max_new_tokens=4, temperature=1.0)


# -- the drafter's cache stays in sync: each proposal equals a recomputation from scratch ---------------


@pytest.mark.parametrize("kind", ["draft", "eagle", "eagle-fused"])
@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2), DynamicTree(10, 4, 2)], ids=["chain", "full", "dyn"])
def test_proposals_match_recomputation(target, prompt, kind, tree, monkeypatch):
    import importlib

    drafter = {"draft": lambda: DraftModel(perturbed(target, 0.3)), "eagle": lambda: Eagle(random_eagle(target)),
               "eagle-fused": lambda: Eagle(random_eagle(target, (0, 1, -1)))}[kind]()
    seen = record_proposals(drafter)
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_deepest))
    out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=24)
    assert out.mean_accept_length > 2.5 and len(seen) > 3
    with torch.no_grad():
        for committed, step_tree, proposal in seen:
            got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
            assert got == scratch_proposal(scratch_logits(drafter, target, committed), step_tree)


# -- sampling: the output distribution is exactly the target's ------------------------------------------
@pytest.mark.parametrize("tree", [Tree.full(2, 2), DynamicTree(5, 2, 2)], ids=["static", "dynamic"])
def test_eagle_sampling_is_lossless(tree):
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    sampling = Sampling(1.0)
    counts = sampled_counts(small, Eagle(random_eagle(small)), tree, sampling)
    assert counts.sum() == RUNS
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


# -- dynamic trees ------------------------------------------------------------------------------------
def random_growth(rng, top_k, depth):
    """Parents, ranks and cumulative scores grown as the drafter grows them, with many tied scores."""
    parents, ranks, scores, frontier = [-1], [0], [0.0], [0]
    for _ in range(depth):
        children = []
        for parent in frontier:
            log_q = sorted((-rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(top_k)), reverse=True)
            for rank, lq in enumerate(log_q):
                parents.append(parent)
                ranks.append(rank)
                scores.append(scores[parent] + lq)
                children.append(len(parents) - 1)
        frontier = sorted(children, key=lambda i: (-scores[i], i))[:top_k]
    return parents, ranks, scores


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_tree_is_connected_and_within_budget(seed):
    rng = random.Random(seed)
    policy = DynamicTree(rng.randint(1, 20), rng.randint(1, 5), rng.randint(1, 4))
    parents, ranks, scores = random_growth(rng, policy.top_k, policy.depth)
    tree, grown = policy.select(parents, ranks, scores)  # Tree() itself refuses a path without its parent
    assert 0 < len(tree) <= min(policy.total_tokens, len(policy)) and tree.depth <= policy.depth
    assert grown[0] == 0 and len(set(grown)) == tree.num_nodes
    for i in range(1, tree.num_nodes):
        assert grown[int(tree.parents[i])] == parents[grown[i]] and int(tree.ranks[i]) == ranks[grown[i]]
        ranks_kept = sorted(int(tree.ranks[c]) for c in tree.children[int(tree.parents[i])])
        assert ranks_kept == list(range(len(ranks_kept)))  # siblings kept best rank first
    best = sorted(scores[1:], reverse=True)[: len(tree)]
    assert sorted((scores[g] for g in grown[1:]), reverse=True) == best  # the globally best nodes


def test_dynamic_tree_policy():
    policy = build_tree({"kind": "dynamic", "total_tokens": 10, "depth": 4, "top_k": 3})
    assert policy == DynamicTree(10, 4, 3) and len(policy) == 10 and len(DynamicTree(60, 2, 3)) == 3 + 9
    assert policy.truncate(2) == DynamicTree(10, 2, 3) and policy.truncate(9) is policy
    assert policy.truncate(0) == Tree.chain(0)
    with pytest.raises(ValueError, match="top_k >= 1"):
        build_tree({"kind": "dynamic", "total_tokens": 10, "depth": 4, "top_k": 0})
    with pytest.raises(ValueError, match="lacks top_k"):
        build_tree({"kind": "dynamic", "total_tokens": 10, "depth": 4})
    with pytest.raises(ValueError, match="has candidates but no drafter"):
        generate(tiny_llama(), torch.tensor([[1, 2]]), tree=policy, max_new_tokens=3)


# -- weights ------------------------------------------------------------------------------------------
def test_eagle_weights_round_trip_and_mismatches_are_refused(target, prompt, tmp_path):
    model = random_eagle(target, (1, 1, -1))
    assert not any(k.startswith(("embed", "lm_head")) or "embed_tokens" in k for k in model.state_dict())
    model.save_pretrained(tmp_path)
    loaded = EagleModel.from_pretrained(tmp_path, target)
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    with pytest.raises(ValueError, match=r"hidden_size 32 \(drafter\) vs 48 \(target\)"):
        EagleModel.from_pretrained(tmp_path, tiny_llama(hidden=48, seed=1))
    with pytest.raises(ValueError, match=r"vocab_size 64 \(drafter\) vs 80 \(target\)"):
        EagleModel.from_pretrained(tmp_path, tiny_llama(vocab=80, seed=1))
    with pytest.raises(ValueError, match=r"num_hidden_layers 2 \(drafter\) vs 3 \(target\)"):
        EagleModel.from_pretrained(tmp_path, tiny_llama(layers=3, seed=1))
    with pytest.raises(ValueError, match="EAGLE drafter was trained for another target"):
        generate(tiny_llama(hidden=48), prompt, drafter=Eagle(model), max_new_tokens=4)
    with pytest.raises(ValueError, match="feature_layers .* must index the target's 3 hidden states"):
        EagleModel(target, feature_layers=(1, 5, -1))


# -- training -----------------------------------------------------------------------------------------
def test_unrolled_training_step_sees_what_drafting_sees(target):
    """Training-time test: unrolled step 1 at entry j equals drafting depth 1 from the root at entry j − 1."""
    from treespec.heads.eagle.objective import eagle_loss
    from treespec.heads.training.target_states import target_hidden as target_states

    model = random_eagle(target)
    batch = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    captured = []
    forward = model.forward
    model.forward = lambda *a, **k: captured.append(forward(*a, **k)) or captured[-1]
    eagle_loss(target, model, batch, unroll_steps=1)
    step1 = captured[1]  # [1, n, h]
    inputs, _ = target_states(target, batch, model.feature_layers)
    for j in (3, 7):  # root entry j − 1, then the node for token j + 1 fed the root's own output
        g = forward(batch[:, 1:j + 1], inputs[:, :j])  # [1, j, h], entries 0..j-1 with target features
        node = forward(batch[:, 1:j + 2], torch.cat([inputs[:, :j], g[:, -1:]], 1))  # [1, j + 1, h]
        assert torch.allclose(step1[0, j], node[0, -1], atol=1e-5)


def test_depth_accuracy_equals_sequential_drafting(target):
    """depth_rank_accuracy's depth-d ranks are those of drafting d deep from each root over the drafter's own
    features along the window's tokens, recomputed here one sequential forward per node; and from a first root on."""
    from treespec.heads.eagle.drafter import rank_accuracy as depth_rank_accuracy
    from treespec.heads.training.target_states import target_hidden as target_states

    model = random_eagle(target, seed=1)
    windows = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    depth, top_k = 3, 4
    for first_root in (0, 4):
        acc = depth_rank_accuracy(target, model, windows, depth=depth, top_k=top_k, batch_size=1,
                                  first_root=first_root)
        hits, counts = torch.zeros(depth, top_k), torch.zeros(depth)
        with torch.no_grad():
            for w in windows.split(1):
                inputs, last = target_states(target, w, model.feature_layers)
                truth = model.logits(last[0, 1:]).argmax(-1)  # [n]: the target's greedy token after entry j's token
                tokens, n = w[:, 1:], w.shape[1] - 1
                for root in range(max(0, first_root - 1), n):  # entry root guesses token root + 2 at depth 1
                    features = inputs[:, : root + 1]  # entries 0..root carry target features
                    for d in range(min(depth, n - root)):
                        g = model(tokens[:, : root + 1 + d], features)[:, -1:]  # [1, 1, h] at entry root + d
                        ranks = model.logits(g[0, 0]).topk(top_k).indices
                        hits[d] += (ranks == truth[root + d]).float()
                        counts[d] += 1
                        features = torch.cat([features, g], dim=1)  # the next node is fed this output
        expected = hits / counts.clamp(min=1)[:, None]
        assert torch.allclose(torch.tensor(acc), expected, atol=1e-6), (first_root, acc, expected)
        assert all(sum(row) <= 1 + 1e-6 for row in acc)


def test_training_entry_lowers_loss_and_resumes(tmp_path, tiny_trained_target):
    from treespec.heads.eagle.objective import eagle_loss
    from treespec.train.training import drafter_job as heads_training

    target_dir, cache = tiny_trained_target
    common = ["debug=tiny_heads", "drafter=eagle", "drafter.fusion=true", f"target={target_dir}", cache,
              "optim.lr=1e-2", "logger=none", "tree=dynamic", "tree.total_tokens=6", "tree.depth=3",
              "tree.top_k=2", "eval.expected_tau=null"]  # expected τ: test_train_metrics.py, resumed: test_medusa.py

    # interrupted after 15 steps, then resumed: the same drafter as one uninterrupted run
    heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "trainer.stop_after=15"]))
    resumed = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "resume=true"]))
    whole = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'b'}"]))
    assert whole["steps"] == resumed["steps"] == 60
    a, b = (load_file(tmp_path / r / "final" / "eagle.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    accuracy = json.loads((tmp_path / "b" / "final" / "head_accuracy.json").read_text())
    assert len(accuracy) == 8 and whole["depth3_top1"] == pytest.approx(accuracy[2][0])
    curve = json.loads((tmp_path / "b" / "final" / "cost_curve.json").read_text())
    assert curve["draft_cost_per_depth"] > 0  # the drafter's own cost, so auto chooses as the comparison does
    assert whole["eval_tree_nodes"] <= 6 and whole["eval_mean_accept_length"] > 1.0

    # the loss on a fixed batch of the self-distilled training data went down
    target, _ = load_model(str(target_dir))
    trained = EagleModel.from_pretrained(tmp_path / "b" / "final", target)
    torch.manual_seed(0)
    untrained = EagleModel(target, feature_layers=trained.feature_layers)
    batch = TokenBatches(load_file(next((tmp_path / "cache").glob("distill-*.safetensors")))["tokens"], 32, 8).batch(0)
    with torch.no_grad():
        before = eagle_loss(target, untrained, batch, unroll_steps=1)[0]
        after = eagle_loss(target, trained, batch, unroll_steps=1)[0]
    assert after < 0.7 * before

    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    hist = [r["histogram"]["eval/accept_length"] for r in rows if "histogram" in r]
    assert hist and sum(hist[0]) / len(hist[0]) == pytest.approx(whole["eval_mean_accept_length"])


def test_hass_topk_distillation_term():
    """HASS's top-K distillation: −Σ_{top-K of p} p log q, computed by hand; K ≥ V is the full cross-entropy;
    switched on, it adds exactly its weighted mean to EAGLE's and EAGLE-3's losses (0 weight: unchanged)."""
    from treespec.heads.eagle.objective import eagle_loss
    from treespec.heads.eagle3.objective import eagle3_loss
    from treespec.heads.training.objective import topk_distillation

    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    log_q = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert torch.allclose(topk_distillation(p, log_q, 2), -(0.5 * log_q[0, 0] + 0.3 * log_q[0, 1]))
    assert torch.allclose(topk_distillation(p, log_q, 9), -(p * log_q).sum(-1))
    target = tiny_llama(seed=0)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for loss, model in ((eagle_loss, random_eagle(target)), (eagle3_loss, random_eagle3(target))):
        plain = loss(target, model, batch, unroll_steps=1)[0]
        assert torch.equal(loss(target, model, batch, unroll_steps=1, topk_distill=4, topk_weight=0.0)[0], plain)
        assert loss(target, model, batch, unroll_steps=1, topk_distill=4)[0] > plain


def test_lk_losses_replace_the_token_term(target):
    """drafter.loss=lk / lk_alpha: the token term is the LK loss over the full vocabulary, per unrolled step: η = 0
    is the KL (the cross-entropy less the target's entropy), η → ∞ the TV term 1 − α, lk_alpha −log α (α:
    ``alpha_0``, in [0, 1] whatever the loss); the feature term is unchanged, gradients are finite; a loss it cannot
    train with is refused before any model loads, naming the key."""
    from treespec.heads.eagle.objective import eagle_loss, training_unroll
    from treespec.train.training import drafter_job

    model = random_eagle(target)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens_only = {"unroll_steps": 0, "feature_weight": 0.0, "token_weight": 1.0}
    kl, metrics = eagle_loss(target, model, batch, **tokens_only)
    alpha = metrics["alpha_0"]
    assert 0 < alpha < 1 and kl.item() == pytest.approx(metrics["ce0"])
    with torch.no_grad():
        _, target_logits, _ = training_unroll(target, model, batch, steps=0)
        log_p = torch.log_softmax(target_logits, -1)
        entropy = -(log_p.exp() * log_p).sum(-1).mean()
    for loss, eta, expected in (("lk", 0.0, metrics["ce0"] - entropy.item()), ("lk", 1e6, 1 - alpha),
                                ("lk_alpha", 3.0, -math.log(alpha))):
        value, got = eagle_loss(target, model, batch, **tokens_only, loss=loss, lk_eta=eta)
        assert value.item() == pytest.approx(expected, rel=1e-4) and got["alpha_0"] == pytest.approx(alpha)
    plain, metrics = eagle_loss(target, model, batch, unroll_steps=1)
    lk, got = eagle_loss(target, model, batch, unroll_steps=1, loss="lk")
    assert got["feature_loss1"] == metrics["feature_loss1"] and lk.item() != plain.item()
    model.zero_grad()
    lk.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="drafter.loss must be one of kl, lk, lk_alpha, got 'ce'"):
        drafter_job.check_config(compose_cfg("train_heads", ["drafter=eagle", "target=/no/such", "drafter.loss=ce"]))
