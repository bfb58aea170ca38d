"""Sequence packing of chat data (train/training/packing.py, heads/training/segments.py): every conversation lands in
exactly
one window, and a packed batch trains exactly what its conversations one per row would: the target's and the
drafters' per-token outputs and every drafter kind's loss and metrics agree, while the same row without its
per-conversation positions (attention across conversations) does not. Offline features pack alike, and a packed
run resumes exactly."""

import pytest
import torch
from safetensors.torch import load_file

from treespec.heads import registry
from treespec.heads.training.segments import PackedModel, same_segment, segment_ids
from treespec.heads.training.unroll import unrolled
from treespec.reference import load_model
from treespec.train.training import drafter_job as train_heads
from treespec.train.training.chat import ChatRenderer, encode_conversations
from treespec.train.training.packing import PackedBatches, check_packing, collate_packed, plan, sample_row

from tests.helpers import TINY_DRAFT, compose_cfg, conversations, heads_cfg, tiny_chat_target, write_jsonl

WIDTH = 96


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    target_dir = tiny_chat_target(root / "target")
    target, tok = load_model(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    data = encode_conversations(conversations(16, seed=3), ChatRenderer(tok), max_length=WIDTH, val_fraction=0.0)
    return root, target_dir, target, tok, data.train


def packed_and_one_per_row(samples, windows: int = 2):
    """The first ``windows`` packed windows, and the same conversations one per right-padded row."""
    packing = PackedBatches(samples, WIDTH, 1)
    chosen = packing.windows[:windows]
    packed = collate_packed([[sample_row(samples, i) for i in w] for w in chosen])
    flat = [i for w in chosen for i in w]
    assert sum(len(w) > 1 for w in chosen) >= 1, "the test needs a window holding several conversations"
    return packed, samples.collate(flat), chosen


def test_every_conversation_is_packed_once_within_the_window():
    lengths = [90, 10, 50, 45, 5, 96, 30, 30, 30, 1]
    windows = plan(lengths, 96)
    assert sorted(i for w in windows for i in w) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in w) <= 96 for w in windows)
    assert len(windows) == 5  # 387 tokens: the fewest windows of 96 that can hold them
    with pytest.raises(ValueError, match="longer than the packing window of 96 tokens"):
        plan([97, 3], 96)


def test_truncated_conversations_are_kept_and_counted(world):
    _, _, _, tok, _ = world
    long = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": " ".join(["value"] * 400)}]}
    rows = conversations(5) + [long]
    kept = encode_conversations(rows, ChatRenderer(tok), max_length=WIDTH, overlong="truncate", val_fraction=0.0)
    assert len(kept.train) == 6 and int(kept.train.lengths().max()) == WIDTH
    assert kept.truncated["count"] == 1 and kept.truncated["tokens"] > 300
    assert "1 truncated to max_length=96 tokens" in kept.summary()
    skipped = encode_conversations(rows, ChatRenderer(tok), max_length=WIDTH, overlong="skip", val_fraction=0.0)
    assert len(skipped.train) == 5 and skipped.skipped["over max_length"]["count"] == 1


def test_packed_batches_depend_only_on_the_step_and_restart_positions_per_conversation(world):
    samples = world[4]
    a, b = PackedBatches(samples, WIDTH, 2, seed=5), PackedBatches(samples, WIDTH, 2, seed=5)
    x, y = a.batch(3), b.batch(3)
    assert all(torch.equal(x[k], y[k]) for k in x)
    for row, w in enumerate(a.windows[int(i)] for i in a.indices(3)):
        lengths = [int(samples.lengths()[i]) for i in w]
        starts = torch.nonzero(x["position_ids"][row] == 0).flatten().tolist()
        assert starts == [sum(lengths[:k]) for k in range(len(lengths))]
        assert int(x["attention_mask"][row].sum()) == sum(lengths)
    assert 0.5 < a.fill() <= 1.0 and "packed 16 conversations" in a.summary()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_targets_packed_states_are_its_states_one_conversation_at_a_time(world, attn):
    samples = world[4]
    target, _ = load_model(world[1], attn_implementation=attn)
    packed, single, chosen = packed_and_one_per_row(samples)
    out = PackedModel(target, packed["position_ids"]).base_model(input_ids=packed["input_ids"]).last_hidden_state
    flat = iter(range(single["input_ids"].shape[0]))
    for row, w in enumerate(chosen):
        at = 0
        for _ in w:
            r = next(flat)
            n = int(single["attention_mask"][r].sum())
            alone = target.base_model(input_ids=single["input_ids"][r : r + 1, :n]).last_hidden_state[0]
            torch.testing.assert_close(out[row, at : at + n], alone, atol=1e-5, rtol=1e-5)
            at += n
    # the negative control: the same rows without per-conversation positions attend across conversations
    crossed = target.base_model(input_ids=packed["input_ids"]).last_hidden_state
    assert not torch.allclose(crossed, out, atol=1e-3)
    assert check_packing(target, samples) < 1e-4


class IgnoresPositions(torch.nn.Module):
    """A model whose base model drops position ids and the cache switch: attention then crosses conversations."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def base_model(self, input_ids=None, **kwargs):
        return self.model.base_model(input_ids=input_ids)


def test_a_model_that_lets_attention_cross_conversations_is_refused(world):
    target, samples = world[2], world[4]
    with pytest.raises(ValueError, match="lets attention cross conversations.*data.chat.pack=false"):
        check_packing(IgnoresPositions(target), samples)


@pytest.mark.parametrize("by_root,kind", [(True, "eagle3"), (False, "eagle")])
def test_the_unrolled_drafter_sees_one_conversation_at_every_step(world, by_root, kind):
    """Every unrolled step's output at every entry whose chain lies inside one conversation equals that
    conversation's own unroll: the drafter's attention (step 0 causal, steps >= 1 its own chain) stays inside."""
    target, samples = world[2], world[4]
    cfg = compose_cfg("train_heads", [f"drafter={kind}"])
    torch.manual_seed(0)
    model = registry.get(kind).recipe(cfg, target, samples.trained_tokens()).module.eval()
    packed, _, chosen = packed_and_one_per_row(samples)
    ids, positions = packed["input_ids"], packed["position_ids"]
    features = torch.randn(ids.shape[0], ids.shape[1] - 1, target.config.hidden_size)  # stand-ins for fused ones
    with torch.no_grad():
        outs = dict(unrolled(model, ids, features, 3, by_root=by_root, positions=positions))
        checked = 0
        for row, w in enumerate(chosen):
            start = 0
            for i in w:
                n_c = int(samples.lengths()[i])
                alone = dict(unrolled(model, ids[row : row + 1, start : start + n_c],
                                      features[row : row + 1, start : start + n_c - 1], 3, by_root=by_root))
                for step, out in alone.items():
                    entries = range(n_c - 1 - step) if by_root else range(step, n_c - 1)
                    for e in entries:
                        torch.testing.assert_close(outs[step][row, start + e], out[0, e], atol=1e-5, rtol=1e-5)
                        checked += 1
                start += n_c
    assert checked > 100


DRAFTERS = ["eagle", "eagle3", "medusa", "hydra", "draft", "medusa2"]


def recipe_of(name, target, samples):
    overrides = [f"drafter={name}", *(TINY_DRAFT if name == "draft" else []),
                 *(["drafter.prefix_attention=true", "drafter.distill=true"] if name == "hydra" else [])]
    cfg = compose_cfg("train_heads", overrides)
    torch.manual_seed(0)
    recipe = registry.get(cfg.drafter.name).recipe(cfg, target, samples.trained_tokens())  # medusa2: a Medusa recipe
    recipe.module.eval()  # no feature noise: the two batches' losses are then comparable
    if name == "medusa2":
        recipe.module.set_step(10**6)  # joint: the backbone's LM terms count too
    return recipe


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_packed_batch_trains_what_its_conversations_one_per_row_do(world, name):
    """Same positions scored, same per-position terms: every metric of the packed batch equals the one-per-row
    batch's (means over the same scored positions), and its gradient too; without the positions it differs."""
    target, samples = world[2], world[4]
    recipe = recipe_of(name, target, samples)
    packed, single, _ = packed_and_one_per_row(samples)
    loss_p, metrics_p = recipe.loss(packed)
    grads_p = torch.autograd.grad(loss_p, [p for p in recipe.module.parameters() if p.requires_grad],
                                  allow_unused=True)
    loss_s, metrics_s = recipe.loss(single)
    grads_s = torch.autograd.grad(loss_s, [p for p in recipe.module.parameters() if p.requires_grad],
                                  allow_unused=True)
    assert metrics_p.keys() == metrics_s.keys()
    for k in metrics_s:
        assert metrics_p[k] == pytest.approx(metrics_s[k], rel=1e-4, abs=1e-5), k
    torch.testing.assert_close(loss_p, loss_s, atol=1e-5, rtol=1e-4)
    for gp, gs in zip(grads_p, grads_s, strict=True):
        if gs is not None:
            torch.testing.assert_close(gp, gs, atol=1e-5, rtol=1e-3)
    # the negative control: the packed rows read as plain rows (attention and predictions across conversations)
    plain = {k: v for k, v in packed.items() if k != "position_ids"}
    with torch.no_grad():
        crossed = recipe.loss(plain)[0]
    assert abs(crossed.item() - loss_s.item()) > 1e-4


def test_no_prediction_crosses_a_boundary():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    segments = segment_ids(positions)
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert same_segment(segments, 0, 2, 9).tolist() == [[True, False, False, False, False, True, True, False, False]]
    assert same_segment(segments, -1, 1, 9)[0, 0].item() is False  # a position before the row


@pytest.mark.parametrize("drafter", ["eagle3", "medusa"])
def test_a_packed_run_resumes_exactly_and_keeps_every_conversation(world, drafter):
    root, target_dir = world[0], world[1]
    source = write_jsonl(root / f"chat-{drafter}.jsonl", conversations(40, seed=4))
    common = ["trainer.max_steps=5", "eval.expected_tau=null", "trainer.eval_every=10", "trainer.ckpt_every=2"]
    train_heads.run(heads_cfg(root / f"a-{drafter}", target_dir, source, *common, "trainer.stop_after=3",
                              drafter=drafter))
    resumed = train_heads.run(heads_cfg(root / f"a-{drafter}", target_dir, source, *common, "resume=true",
                                        drafter=drafter))
    whole = train_heads.run(heads_cfg(root / f"b-{drafter}", target_dir, source, *common, drafter=drafter))
    assert whole["steps"] == resumed["steps"] == 5
    assert whole["data_train_conversations"] + whole["data_val_conversations"] == 40 and not whole["data_skipped"]
    assert 0 < whole["data_packed_windows"] < whole["data_train_conversations"]
    a, b = (load_file(root / f"{r}-{drafter}" / "ckpt-5" / "state.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
