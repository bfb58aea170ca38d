"""The LK losses (heads/training/objective.py; Samarin et al. 2026, arXiv 2602.23881) in EAGLE-3's objective
(heads/eagle3/objective.py): the loss and α by hand, against the restricted target, finite gradients, training that
raises α, and a ``drafter.loss=lk`` run that resumes exactly and refuses what it cannot train with."""

import copy
import json

import pytest
import torch

from treespec.heads.eagle3.objective import eagle3_loss
from treespec.heads.training.target_states import target_states
from treespec.heads.training.unroll import unrolled

from tests.helpers import random_eagle3, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4, seed=0)  # 4 layers: distinct aux layers (1, 2, 3)


def test_acceptance_and_lk_loss_by_hand():
    """α = Σ min(p, q) = 1 − TV; lk = λ·KL + (1 − λ)(1 − ᾱ), λ = exp(−η ᾱ); lk_alpha = −log ᾱ (ᾱ: the positions'
    mean α); both with finite gradients; kl is no LK loss."""
    from treespec.heads.training.objective import acceptance, lk_loss

    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]], dtype=torch.float64)
    logits = torch.log(torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], dtype=torch.float64)).requires_grad_()
    q = torch.softmax(logits, -1)
    alpha = acceptance(p, q)
    assert torch.allclose(alpha, torch.tensor([0.7, 0.1], dtype=torch.float64))
    assert torch.allclose(alpha, 1 - 0.5 * (p - q).abs().sum(-1))
    kl = (p * (p.clamp(min=1e-30).log() - q.log())).sum(-1)
    mean_alpha = torch.tensor(0.4, dtype=torch.float64)
    weight = torch.exp(-3 * mean_alpha)
    assert torch.allclose(lk_loss("lk", kl, alpha, 3.0), weight * kl.mean() + (1 - weight) * (1 - mean_alpha))
    assert torch.allclose(lk_loss("lk_alpha", kl, alpha, 3.0), -mean_alpha.log())
    for loss in ("lk", "lk_alpha"):
        (grad,) = torch.autograd.grad(lk_loss(loss, kl, alpha, 3.0), logits, retain_graph=True)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # no gradient through λ: lk's is that of λ·KL + (1 − λ)(1 − ᾱ) with λ a constant
    constant = torch.exp(-3 * alpha.mean().detach())
    by_hand = constant * kl.mean() + (1 - constant) * (1 - alpha.mean())
    assert torch.allclose(torch.autograd.grad(lk_loss("lk", kl, alpha, 3.0), logits, retain_graph=True)[0],
                          torch.autograd.grad(by_hand, logits, retain_graph=True)[0])
    with pytest.raises(ValueError, match="drafter.loss must be one of lk, lk_alpha, got 'kl'"):
        lk_loss("kl", kl, alpha, 3.0)


def test_lk_loss_equals_hand_computed_on_the_restricted_target(target):
    """EAGLE-3's LK losses on one step, by hand: α against the restricted, renormalised target p_r over the kept
    positions; ``alpha_0`` against the full target (its mass outside the draft vocabulary never accepted); η = 0 is
    KL exactly; gradients are finite; an unknown loss is refused."""
    model = random_eagle3(target, draft_vocab=24, seed=1)
    batch = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        features, target_logits = target_states(target, batch, model.aux_layers)
        draft_logits = model.draft_logits(model(batch[:, 1:], model.fuse(features[:, :-1]))).double()  # [b, S-1, 24]
    logits = target_logits[:, 1:].double()  # entry j predicts the token after position j + 1
    valid = model.t2d[logits.argmax(-1)]
    assert 0 < valid.sum() < valid.numel()
    full = torch.softmax(logits, -1)[valid][:, model.draft_ids]  # [n, 24]: the full target's draft-token mass
    p = full / full.sum(-1, keepdim=True)
    q = torch.softmax(draft_logits[valid], -1)
    kl = (p * (p.log() - q.log())).sum(-1).mean()
    alpha_r, alpha = torch.minimum(p, q).sum(-1).mean(), torch.minimum(full, q).sum(-1).mean()
    assert alpha < alpha_r
    weight = torch.exp(-3 * alpha_r)
    expected = {"kl": kl, "lk": weight * kl + (1 - weight) * (1 - alpha_r), "lk_alpha": -alpha_r.log()}
    for name, value in expected.items():
        loss, metrics = eagle3_loss(target, model, batch, unroll_steps=0, loss=name)
        assert loss.item() == pytest.approx(value.item(), rel=1e-4)
        assert metrics["alpha_0"] == pytest.approx(alpha.item(), rel=1e-4) and metrics["kl0"] == pytest.approx(
            kl.item(), rel=1e-4)
        model.zero_grad()
        eagle3_loss(target, model, batch, unroll_steps=2, loss=name)[0].backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    plain = eagle3_loss(target, model, batch, unroll_steps=2)[0]
    assert eagle3_loss(target, model, batch, unroll_steps=2, loss="lk", lk_eta=0.0)[0].item() == pytest.approx(
        plain.item(), rel=1e-6)
    with pytest.raises(ValueError, match="drafter.loss must be one of kl, lk, lk_alpha, got 'tv'"):
        eagle3_loss(target, model, batch, loss="tv")


@pytest.mark.parametrize("loss", ["lk", "lk_alpha"])
def test_lk_training_raises_acceptance(target, loss):
    target = copy.deepcopy(target).requires_grad_(False)
    model = random_eagle3(target, draft_vocab=32).train()
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    history = []
    for _ in range(20):
        value, metrics = eagle3_loss(target, model, batch, unroll_steps=1, loss=loss)
        opt.zero_grad()
        value.backward()
        opt.step()
        history.append((value.item(), metrics["alpha_0"]))
    assert history[-1][0] < 0.7 * history[0][0] and history[-1][1] > history[0][1] + 0.2


def test_lk_training_run_resumes_exactly_and_refuses_a_bad_loss(tmp_path):
    """train_heads drafter=eagle3 drafter.loss=lk on chat data: stopped at step 2 and resumed to step 3 equals a run
    to step 3; alpha_{i} is logged; a loss or lk_eta it cannot train with is refused naming the key."""
    from treespec.train.training import drafter_job

    from tests.helpers import compose_cfg, stopped_run_resumes_exactly

    run = stopped_run_resumes_exactly(tmp_path, "eagle3", "drafter.loss=lk", "drafter.unroll_steps=1",
                                      "drafter.draft_vocab_size=64")
    rows = [json.loads(line)["metrics"] for line in open(run / "metrics.jsonl")]
    assert any("train/alpha_1" in r and "train/lk1" in r for r in rows)
    assert any("val/eagle3_alpha_1" in r for r in rows)
    for override, message in (("drafter.loss=tv", "drafter.loss must be one of kl, lk, lk_alpha, got 'tv'"),
                              ("drafter.lk_eta=-1", "drafter.lk_eta must be a finite number")):
        with pytest.raises(ValueError, match=message):
            drafter_job.check_config(compose_cfg("train_heads", ["drafter=eagle3", "target=/no/such", override]))


# -- drafter.on_policy: step i's KL weighted by the chance the drafter's own chain reaches it ------------------------
def test_on_policy_weights_each_depth_by_the_reach_of_the_earlier_ones(target):
    """kl1 under on_policy = Σ_r α_{r,0} · KL_{r,1} / (valid roots), hand-computed from the dense outputs; step 0
    unweighted; lk losses refused."""
    model = random_eagle3(target, draft_vocab=48, seed=5)
    batch = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(6))
    _, plain = eagle3_loss(target, model, batch, unroll_steps=1)
    _, weighted = eagle3_loss(target, model, batch, unroll_steps=1, on_policy=True)
    assert weighted["kl0"] == pytest.approx(plain["kl0"], rel=1e-6) and "reach_0" not in weighted
    with torch.no_grad():
        logits = target(input_ids=batch).logits[0].double()  # [S, V]
        features, _ = target_states(target, batch, model.aux_layers)
        outs = dict(unrolled(model, batch, model.fuse(features[:, :-1]), 1, by_root=True))
        q0 = torch.softmax(model.logits(outs[0])[0].double(), -1)  # [n, V]: depth 1 from root r, -inf → 0 outside
        q1 = torch.softmax(model.draft_logits(outs[1])[0].double(), -1)  # [n − 1, Vd]
    ids = model.draft_ids
    in_vocab = model.t2d[logits.argmax(-1)]
    terms = []
    for r in range(batch.shape[1] - 2):
        if not (in_vocab[r + 1] and in_vocab[r + 2]):  # depth 1 and depth 2 scored only where the argmax is draftable
            continue
        p_full = torch.softmax(logits[r + 1], -1)
        alpha0 = float(torch.minimum(p_full, q0[r]).sum())
        p = torch.softmax(logits[r + 2, ids], -1)
        terms.append(alpha0 * float((p * (p.log() - q1[r].log())).sum()))
    count = int(in_vocab[2:].sum())  # step 1's valid roots (α is 0 where depth 1 was not valid: weight 0)
    assert weighted["kl1"] == pytest.approx(sum(terms) / count, rel=1e-4)
    assert 0 < weighted["reach_1"] < 1
    with pytest.raises(ValueError, match="on_policy"):
        eagle3_loss(target, model, batch, unroll_steps=1, loss="lk", on_policy=True)
