"""DFlash's training (heads/dflash/objective.py; the drafter: tests/heads/dflash/test_dflash.py): the objective's
block-sparse pass equals decoding from each anchor (one row and packed conversations), the loss falls and weighs what
the loss mask allows, rank accuracies, the recipe (train, export, draft; its config checks), an exactly resumed run
and training from stored target features equal to training online."""

import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from treespec import generate
from treespec.heads import DFlash, load, registry
from treespec.heads.dflash.drafter import rank_accuracy
from treespec.heads.dflash.objective import dflash_loss
from treespec.heads.training.target_states import target_states

from tests.helpers import (
    compose_cfg,
    conversations,
    heads_cfg,
    hf_greedy,
    random_dflash,
    stopped_run_resumes_exactly,
    tiny_chat_target,
    write_jsonl,
)


# -- training -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("root_feature", [False, True])
def test_anchored_blocks_equal_decoding_from_each_anchor(target, root_feature):
    """The block-sparse training pass: each anchor's block equals the drafter's pass from that root with the
    context before it (and, with root_feature, the feature before the root), in one row and with packed
    conversations."""
    model = random_dflash(target, seed=1, num_layers=2, root_feature=root_feature)
    if root_feature:  # zero at first: give it weight, or the test could not see a wrong feature
        torch.nn.init.normal_(model.root_norm.weight)
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
            root = features[b : b + 1, a - 1 : a]  # [1, 1, K·H]: produced root a
            alone = model(model.block_ids(windows[b, a : a + 1]), features[b : b + 1, :a],
                          torch.arange(a, a + 4)[None], torch.arange(a)[None], root_features=root)
            torch.testing.assert_close(plain[b, i], alone[0], atol=1e-5, rtol=0)
            start = 0 if a < 6 else 6  # its own conversation only, at its own positions
            alone = model(model.block_ids(windows[b, a : a + 1]), features[b : b + 1, start:a],
                          torch.arange(a - start, a - start + 4)[None], torch.arange(a - start)[None],
                          root_features=root)
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


def test_lk_losses_per_block_position(target):
    """drafter.loss=lk / lk_alpha: one LK loss per block position, weighted as its predictions are: η = 0 is the KL
    loss; a one-position block's lk_alpha is −log α (``alpha_1``); gradients are finite."""
    model = random_dflash(target, seed=2)
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))

    def run(**options):
        return dflash_loss(target, model, batch, anchors=6, generator=torch.Generator().manual_seed(0), **options)

    kl, metrics = run()
    assert all(0 < metrics[f"alpha_{k}"] < 1 for k in range(1, model.block_size))
    assert run(loss="lk", lk_eta=0.0)[0].item() == pytest.approx(kl.item(), rel=1e-5)
    lk = run(loss="lk")[0]
    model.zero_grad()
    lk.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    two = random_dflash(target, block_size=2, seed=2)
    value, metrics = dflash_loss(target, two, batch, anchors=6, loss="lk_alpha")
    assert value.item() == pytest.approx(-math.log(metrics["alpha_1"]), rel=1e-5)


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


def test_training_vocabulary(target):
    """drafter.train_vocab: the loss is the decay-weighted KL from the target's distribution restricted to the
    vocabulary and renormalised, over the predictions whose target argmax it holds; α, top-1 and τ stay measured
    against the full target; the head's logits are -inf outside."""
    from treespec.heads.drafting.vocab import DraftVocab

    model = random_dflash(target, seed=3)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [6, 8]] = True  # anchors 5 and 7; predictions (5, 1), (5, 3), (7, 1) read the target at 5, 7, 7
    with torch.no_grad():
        features, logits = target_states(target, ids, model.feature_layers)
    best5, best7 = int(logits[0, 5].argmax()), int(logits[0, 7].argmax())
    assert best5 != best7
    others = [t for t in range(64) if t not in (best5, best7)][:30]
    model.set_vocab(DraftVocab(torch.tensor(sorted([*others, best7])), 64))  # holds position 7's argmax, not 5's
    loss, metrics = dflash_loss(target, model, {"input_ids": ids, "loss_mask": mask}, anchors=4, position_decay=0.5)
    vocab = model.vocab.ids
    with torch.no_grad():
        terms = []
        for a, k in ((5, 3), (7, 1)):  # (5, 1) leaves the loss: its target argmax is outside
            out = model(model.block_ids(ids[0, a : a + 1]), features[:, :a], torch.arange(a, a + 4)[None],
                        torch.arange(a)[None])
            log_q = torch.log_softmax(model.lm_head(out[0, k])[vocab].float(), -1)
            log_p = torch.log_softmax(logits[0, a + k - 1, vocab].float(), -1)
            terms.append((0.5 ** (k - 1), float((log_p.exp() * (log_p - log_q)).sum())))
        full = model.logits(out[0, 1])
    assert loss.item() == pytest.approx(sum(w * kl for w, kl in terms) / sum(w for w, _ in terms), rel=1e-4)
    assert metrics["kept_fraction"] == pytest.approx(2 / 3)
    assert metrics["top1_1"] <= 0.5  # (5, 1) counts, and can never be right
    outside = torch.ones(64, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isinf(full[outside]).all() and torch.isfinite(full[vocab]).all()
    model.zero_grad()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    for name in ("ce", "lk"):  # ce keeps the predictions whose token is inside; both give gradients
        value, _ = dflash_loss(target, model, {"input_ids": ids, "loss_mask": mask}, anchors=4, loss=name)
        assert torch.isfinite(value) and value.requires_grad


def test_training_vocabulary_recipe_saves_and_drafts_it(target, prompt, tmp_path):
    """train_vocab=N: the N most frequent training tokens, saved beside the weights, the loaded drafter's vocabulary,
    lossless; a later export without one removes the file."""
    cfg = compose_cfg("train_heads", ["drafter=dflash", "drafter.block_size=4", "drafter.accuracy_depth=3",
                                      "drafter.anchors=8", "drafter.train_vocab=16"])
    stream = torch.cat([torch.arange(20).repeat(5), torch.arange(20, 64)])  # ids 0..19 five times, the rest once
    r = registry.get("dflash").recipe(cfg, target, stream)
    assert torch.equal(r.module.vocab.ids, torch.arange(16)) and "training vocabulary 16 of 64" in r.description
    windows = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2))
    r.export(windows, tmp_path)
    assert (tmp_path / "draft_vocab.safetensors").exists()
    drafter = load(tmp_path, target)
    assert torch.equal(drafter.model.vocab.ids, torch.arange(16)) and drafter._head.vocab is drafter.model.vocab
    out = generate(target, prompt, drafter=drafter, max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 8))
    r.module.set_vocab(None)
    r.module.save_pretrained(tmp_path)
    assert not (tmp_path / "draft_vocab.safetensors").exists() and load(tmp_path, target).model.vocab is None
    from treespec.train.training import drafter_job

    with pytest.raises(ValueError, match="drafter.train_vocab must be null or an integer >= 1"):
        drafter_job.check_config(compose_cfg("train_heads", ["drafter=dflash", "target=/no/such",
                                                             "drafter.train_vocab=0"]))


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


def test_init_from_grows_a_trained_drafter(target, trained, tmp_path):
    """drafter.init_from: a one-layer drafter grown to two predicts what it did (the new layer starts as the
    identity), then trains; one that does not fit is refused, naming why."""
    trained.save_pretrained(tmp_path)
    overrides = ["drafter=dflash", "drafter.block_size=4", "drafter.anchors=8", f"drafter.init_from={tmp_path}",
                 f"drafter.target_layer_ids={list(trained.target_layer_ids)}", "drafter.num_layers=2"]
    r = registry.get("dflash").recipe(compose_cfg("train_heads", overrides), target)
    assert r.module.num_layers == 2 and "grown from" in r.description
    windows = hf_greedy(target, torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(3)), 12)
    anchors = torch.tensor([[2, 5], [3, 7]])
    with torch.no_grad():
        features, _ = target_states(target, windows, trained.feature_layers)
        grown, base = (m.logits(m.anchored(windows, features, anchors)) for m in (r.module, trained))
    torch.testing.assert_close(grown, base)
    loss, _ = r.loss(windows)
    loss.backward()
    assert r.module.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0  # the new layer learns
    for extra, message in (("drafter.mask_token_id=5", "mask_token_id 63 \\(init_from\\) against 5"),
                           ("drafter.block_size=5", "block_size 4 \\(init_from\\) against 5")):
        with pytest.raises(ValueError, match=message):
            registry.get("dflash").recipe(compose_cfg("train_heads", [*overrides, extra]), target)


def test_stopped_run_resumes_exactly(tmp_path):
    """train_heads drafter=dflash on chat data: stopped at step 2 and resumed to step 3 equals a run to step 3."""
    stopped_run_resumes_exactly(tmp_path, "dflash", "drafter.block_size=4", "drafter.anchors=4")


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
