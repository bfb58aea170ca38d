"""Offline target features: prepared once (sharded over 2 forked ranks, resumable), they hold exactly the target's
hidden states, and training from them equals online training on the same batches (EAGLE, EAGLE-3, Medusa, a draft
model; chat data and corpus windows) without ever running the target's decoder layers."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treespec.reference import load_model
from treespec.train.training import drafter_job as train_heads
from treespec.train.training.features import FeatureStore

from tests.helpers import (
    TINY_DRAFT,
    assert_ok,
    compose_cfg,
    conversations,
    heads_cfg,
    run_killed,
    run_ranks,
    tiny_chat_target,
    write_jsonl,
)

STEPS = 3


def _prepare(rank, cfg):
    return train_heads.prepare_features(cfg)


def features_cfg(root, target, source, folder, *overrides, drafter="eagle3"):
    return heads_cfg(root / "unused", target, source, f"data.features={folder}", "data.features_shard_samples=8",
                     "data.features_batch_size=4", *overrides, drafter=drafter)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Features of a tiny 3-layer target over 40 conversations, for EAGLE-3's aux layers (which also serve EAGLE
    and Medusa: the last hidden state is always stored), written by 2 ranks."""
    root = tmp_path_factory.mktemp("features")
    target = tiny_chat_target(root / "target")
    source = write_jsonl(root / "chat.jsonl", conversations(40))
    folder = root / "feats"
    results = run_ranks(_prepare, features_cfg(root, target, source, folder))
    index, _ = assert_ok(results)
    return root, target, source, folder, index


def test_features_hold_the_targets_hidden_states(prepared):
    root, target_dir, source, folder, index = prepared
    assert index["layers"] == [1, 2, 3] and index["dtype"] == "float32"
    assert index["bytes_per_token"] == 3 * 32 * 4 + 5  # three hidden states of 32 floats, the id, the mask
    train = index["splits"]["train"]
    assert len(train["shards"]) == (train["samples"] + 7) // 8 and index["splits"]["val"]["samples"] >= 1
    store = FeatureStore(folder).split("train")
    target, _ = load_model(target_dir)
    for i in (0, len(store) - 1):
        sample = store.sample(i)
        ids = sample["input_ids"][None]
        out = target.base_model(input_ids=ids, output_hidden_states=True)
        for layer in index["layers"]:
            torch.testing.assert_close(sample[f"hidden.{layer}"], out.hidden_states[layer][0], atol=1e-5, rtol=0)
        assert sample["loss_mask"].any() and not sample["loss_mask"][0]


def test_prepare_resumes_where_it_stopped(prepared, capsys):
    root, target, source, folder, index = prepared
    shards = sorted(folder.glob("train-*.safetensors"))
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    (folder / "train-00001.json").unlink()  # as if killed while writing shard 1
    (folder / "train-00001.safetensors").unlink()
    again = train_heads.prepare_features(features_cfg(root, target, source, folder))
    after = {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("train-*.safetensors"))}
    assert [n for n in after if after[n] != before.get(n)] == ["train-00001.safetensors"]
    assert again["splits"] == index["splits"]
    assert "bytes/token" in capsys.readouterr().out  # the size estimate comes first


def no_decoder_layers(monkeypatch):
    """train_heads.run's target refuses to run any decoder layer."""
    def load(spec):
        target, tok = load_model(spec)
        for layer in target.model.layers:
            layer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(AssertionError("a decoder layer ran")))
        return target, tok

    monkeypatch.setattr(train_heads, "load_model", load)


def checkpoint_weights(run_dir: Path) -> dict:
    tensors = load_file(run_dir / f"ckpt-{STEPS}" / "state.safetensors")
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


@pytest.mark.parametrize("drafter", ["eagle", "eagle3", "medusa", "draft"])
def test_training_from_features_equals_online_training(prepared, monkeypatch, drafter):
    root, target, source, folder, _ = prepared
    # stop before the end: export and the decoding evaluation run the target by design; evaluations do not
    common = [f"trainer.max_steps={STEPS + 1}", f"trainer.stop_after={STEPS}", "trainer.eval_every=2",
              *(TINY_DRAFT if drafter == "draft" else [])]
    train_heads.run(heads_cfg(root / f"online-{drafter}", target, source, *common, drafter=drafter))
    with monkeypatch.context() as m:
        no_decoder_layers(m)
        summary = train_heads.run(heads_cfg(root / f"offline-{drafter}", target, source, f"data.features={folder}",
                                            *common, drafter=drafter))
    assert summary["features"] == str(folder)
    online, offline = checkpoint_weights(root / f"online-{drafter}"), checkpoint_weights(root / f"offline-{drafter}")
    assert online.keys() == offline.keys()
    for name in online:
        torch.testing.assert_close(offline[name], online[name], atol=1e-5, rtol=0, msg=name)
    rows = [json.loads(line) for line in (root / f"offline-{drafter}" / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("val/") for r in rows for k in r["metrics"])  # evaluated on stored features too


def test_a_training_subset_reads_the_whole_files_features(prepared, monkeypatch):
    """data.chat.train_conversations=N: the first N training conversations, online or from the features prepared
    for all of them (the same weights), and validation kept whole; N beyond the split is refused by name."""
    root, target, source, folder, _ = prepared
    common = [f"trainer.max_steps={STEPS + 1}", f"trainer.stop_after={STEPS}", "trainer.eval_every=2",
              "data.chat.train_conversations=12"]
    online = train_heads.run(heads_cfg(root / "online-subset", target, source, *common))
    with monkeypatch.context() as m:
        no_decoder_layers(m)
        offline = train_heads.run(heads_cfg(root / "offline-subset", target, source, f"data.features={folder}",
                                            *common))
    full = train_heads.run(heads_cfg(root / "online-all", target, source, *common[:-1]))
    assert online["data_train_conversations"] == offline["data_train_conversations"] == 12
    assert full["data_train_conversations"] > 12 and full["data_val_conversations"] == online["data_val_conversations"]
    assert online["data_trained_tokens"] < full["data_trained_tokens"]
    a, b = checkpoint_weights(root / "online-subset"), checkpoint_weights(root / "offline-subset")
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)
    assert any(not torch.equal(a[n], w) for n, w in checkpoint_weights(root / "online-all").items())
    with pytest.raises(ValueError, match="train_conversations=500, but the training split holds"):
        train_heads.run(heads_cfg(root / "too-many", target, source, *common[:-1], "data.chat.train_conversations=500"))


def test_corpus_windows_from_features_equal_online(tmp_path, monkeypatch):
    target = tiny_chat_target(tmp_path / "target")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": " ".join(m["content"] for m in c["messages"])}
                                                      for c in conversations(60, seed=1) if "messages" in c])

    def cfg(run_dir, *overrides):
        return compose_cfg("train_heads", [
            "drafter=eagle", "data=stdlib", f"data.corpus.source={corpus}", "data.corpus.val_fraction=0.3",
            f"target={target}", f"run_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}", "logger=none", "trainer.seq_len=16", "trainer.batch_size=4",
            f"trainer.max_steps={STEPS + 1}", f"trainer.stop_after={STEPS}", "trainer.eval_every=2",
            "trainer.eval_windows=2", "trainer.progress=false", "optim.warmup_steps=1", "optim.lr=1e-3", *overrides])

    features = f"data.features={tmp_path / 'feats'}"
    index = train_heads.prepare_features(cfg(tmp_path / "unused", features))
    assert index["splits"]["train"]["masked"] is False and index["bytes_per_token"] == 32 * 4 + 4
    train_heads.run(cfg(tmp_path / "online"))
    no_decoder_layers(monkeypatch)
    train_heads.run(cfg(tmp_path / "offline", features))
    online, offline = checkpoint_weights(tmp_path / "online"), checkpoint_weights(tmp_path / "offline")
    for name in online:
        torch.testing.assert_close(offline[name], online[name], atol=1e-5, rtol=0, msg=name)


def test_features_for_another_run_are_refused(prepared):
    root, target, source, folder, _ = prepared
    with pytest.raises(ValueError, match="prepared for another run.*data"):
        train_heads.run(heads_cfg(root / "other", target, source, f"data.features={folder}",
                                  "data.chat.val_fraction=0.5"))
    with pytest.raises(ValueError, match=r"also needs \[0\]"):
        train_heads.run(heads_cfg(root / "other", target, source, f"data.features={folder}",
                                  "drafter.feature_layers=[0,-1]"))
    with pytest.raises(ValueError, match="not a finished features folder"):
        train_heads.run(heads_cfg(root / "other", target, source, f"data.features={root / 'missing'}"))
    assert not os.path.exists(root / "other" / "ckpt-1")


@pytest.mark.slow  # a fresh Python process (torch, transformers) for the killed run
def test_prepare_killed_with_sigkill_resumes_to_the_uninterrupted_shards(tmp_path):
    """A real SIGKILL while a shard is written: the rerun removes the half-written file, redoes that shard, and
    every file equals an uninterrupted run's."""
    target = tiny_chat_target(tmp_path / "target")
    source = write_jsonl(tmp_path / "chat.jsonl", conversations(24))
    common = ["drafter=eagle3", "data=chat", f"data.chat.source={source}", f"target={target}", "logger=none",
              f"data.cache_dir={tmp_path / 'cache'}", "trainer.seq_len=96", "data.features_shard_samples=8",
              "data.features_batch_size=4"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train_heads.prepare_features(compose_cfg("train_heads", [*common, f"data.features={whole}"]))
    assert run_killed("treespec.train.training.drafter_job:prepare_features",
                      [*common, f"data.features={killed}"], 3) == -9  # shard 0 whole, shard 1 half-written
    assert (killed / "train-00000.json").exists() and not (killed / "train-00001.safetensors").exists()
    assert [p.name for p in killed.glob(".train-00001.safetensors.*.tmp")]  # removed by the rerun
    train_heads.prepare_features(compose_cfg("train_heads", [*common, f"data.features={killed}"]))
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in killed.iterdir()) and "index.json" in files
    assert all((whole / f).read_bytes() == (killed / f).read_bytes() for f in files)
