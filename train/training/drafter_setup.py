"""A drafter run's setup (train/training/drafter_job.py runs it): the config checks raised before any model loads
(``check_config``), the evaluation tree, and the data it trains and evaluates on (``training_data``): corpus
windows (self-distilled when asked), chat conversations (packed or not), or stored target features
(``data.features``), with what stored features must match (``feature_key``) and which target layers they hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from treespec.heads import registry
from treespec.io import weights_digest
from treespec.planning.tree_spec import check_tree_spec
from treespec.train.training import config_checks, distributed
from treespec.train.training.chat import SampleBatches, Samples, prepare_chat
from treespec.train.training.data import TokenBatches, eval_windows, prepare_tokens, self_distill
from treespec.train.training.exportable import check_export_names
from treespec.train.training.features import FeatureBatches, FeatureStore, WindowSamples, split_layers
from treespec.train.training.lm_job import fingerprint
from treespec.train.training.packing import PackedBatches, check_packing


def trainable_kind(d):
    """The registry's kind of drafter config ``d``: its training objectives, its own and its recipe's (checked)."""
    kind = registry.get(d.name)
    if not kind.trainable:
        trainable = ", ".join(n for k in registry.KINDS if k.trainable for n in (k.name, *k.recipes))
        raise ValueError(f"drafter={d.name!r} cannot be trained; trainable drafters: {trainable}")
    kind.run_name(d)
    return kind


def eval_tree_spec(cfg):
    """The end-of-run evaluation's tree spec: ``tree=...`` when given, else the drafter's eval_tree."""
    spec = cfg.get("tree") or cfg.drafter.get("eval_tree")
    return OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec


def check_config(cfg) -> None:
    """Everything that can be wrong in the config, raised before any model is loaded or trained."""
    kind = trainable_kind(cfg.drafter)
    spec = eval_tree_spec(cfg)
    if spec is None:
        raise ValueError("no evaluation tree: set tree=... or the drafter's eval_tree")
    check_tree_spec(spec)
    config_checks.check_job(cfg)
    config_checks.check_drafter(cfg.drafter)
    config_checks.check_eval(cfg.eval)
    check_export_names(cfg)
    chat = cfg.data.get("chat")
    if chat is not None and not chat.get("source"):
        raise ValueError("data=chat needs data.chat.source=<JSONL/JSON/parquet file, glob or datasets folder>")
    if chat is not None:
        config_checks.integer(chat.get("train_conversations"), "data.chat.train_conversations", 1, optional=True)
    if chat is None and cfg.data.get("corpus") is None:
        raise ValueError("no training data: data.corpus (data=stdlib) or data.chat (data=chat)")
    kind.check_training(cfg, distributed.launched_world_size())


def training_tokens(cfg, target, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams; the train stream is self-distilled when the data config asks."""
    corpus_cfg = OmegaConf.to_container(cfg.data.corpus, resolve=True)
    _, train_tokens, val_tokens = prepare_tokens(corpus_cfg, len(tokenizer), cfg.data.cache_dir, tokenizer=tokenizer)
    if cfg.data.get("self_distill"):
        sd = cfg.data.self_distill
        t0 = time.time()
        train_tokens = self_distill(target, train_tokens, n_prompts=sd.prompts, prompt_tokens=sd.prompt_tokens,
                                    new_tokens=sd.new_tokens, temperature=sd.temperature, batch_size=sd.batch_size,
                                    seed=cfg.seed, cache_dir=cfg.data.cache_dir, eos_token_id=tokenizer.eos_token_id)
        print(f"self-distillation data: {len(train_tokens)} tokens ({time.time() - t0:.0f} s)")
    return train_tokens, val_tokens


@dataclass
class TrainingData:
    """What a drafter run trains and evaluates on."""

    batches: object                  # .batch(step) → the global batch; .steps_per_epoch
    val: object                      # the in-training evaluation's batch: [n, S] windows or a dict (chat, features)
    val_windows: torch.Tensor        # [n, S] held-out windows: per-depth accuracies at export
    prompts: list                    # [1, P] prompts of the decoding evaluation
    stats_tokens: torch.Tensor       # the trained-on tokens: statistics for recipes (EAGLE-3's draft vocabulary)
    train_samples: object            # what prepare_features stores: chat.Samples or features.WindowSamples
    val_samples: object
    info: dict = field(default_factory=dict)  # for the run's summary


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def data_settings(cfg) -> dict:
    """The data settings stored features depend on (beside the target and its layers)."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    keep = {k: data.get(k) for k in ("corpus", "self_distill", "chat")}
    return {**keep, "seq_len": cfg.trainer.seq_len, "eval_windows": cfg.trainer.eval_windows, "seed": cfg.seed}


def feature_key(cfg, target) -> dict:
    """What stored features must match. Packing is left out: features are stored one conversation at a time, and
    packed or not they are the same (train/training/packing.py)."""
    data = data_settings(cfg)
    if data.get("chat"):  # one store serves every training subset (train_conversations), packed or not
        data["chat"] = {k: v for k, v in data["chat"].items() if k not in ("pack", "train_conversations")}
    return {"target": fingerprint(target), "weights": weights_digest(target), "data": data}


def packing(cfg) -> int | None:
    """The packed windows' width (``data.chat.max_length``) when chat data is packed (``data.chat.pack``), else
    None."""
    chat = cfg.data.get("chat")
    return int(chat.max_length) if chat is not None and chat.get("pack", False) else None


def needed_layers(cfg, target) -> list[int]:
    n = target.config.num_hidden_layers
    return split_layers(registry.get(cfg.drafter.name).target_layers(cfg.drafter, n), n)


def training_data(cfg, target, tokenizer, *, progress: bool = True) -> TrainingData:
    """The data of ``cfg.data``: corpus windows (self-distilled when asked) or chat conversations; with
    ``data.features`` the training batches and the evaluation batch come from stored target features."""
    t, e = cfg.trainer, cfg.eval
    pad = pad_id(tokenizer)
    if cfg.data.get("chat") is not None:
        chat = prepare_chat(cfg.data.chat, tokenizer, cfg.data.cache_dir, progress=progress)
        width = packing(cfg)
        stored = None
        if cfg.data.get("features"):  # checked against every training conversation, then cut like them
            stored = stored_split(cfg, target, chat.train)
        chat.train, stored = subset(cfg.data.chat.get("train_conversations"), chat.train, stored, progress)
        if width is not None:
            batches = PackedBatches(chat.train, width, t.batch_size, seed=cfg.seed, pad_id=pad)
            if not cfg.data.get("features"):  # the target runs packed rows: attention must stay inside each one
                check_packing(target, chat.train)
            if progress:
                print(batches.summary())
        else:
            batches = SampleBatches(chat.train, t.batch_size, seed=cfg.seed, pad_id=pad)
        n_val = min(len(chat.val), t.eval_windows or len(chat.val))
        held_out, n_val = (chat.val, n_val) if n_val else (chat.train, 1)  # tiny sets may have no validation
        val_samples = Samples(*_first(held_out, n_val))
        val = val_samples.collate(range(n_val), pad)
        stream = held_out.stream(tokenizer.eos_token_id or 0)
        val_windows = eval_windows(stream, t.seq_len, t.eval_windows) if len(stream) > t.seq_len else val["input_ids"]
        prompts = []
        for i in range(min(len(held_out), e.prompts)):  # each conversation up to its first answer (its last
            ids, _ = held_out.sample(i)                    # eval.prompt_tokens tokens)
            end = max(1, int(held_out.prompt_lens[i]))
            prompts.append(ids[max(0, end - e.prompt_tokens) : end][None].long())
        data = TrainingData(batches, val, val_windows, prompts, chat.train.trained_tokens(), chat.train, val_samples,
                            {"data_rows": chat.rows, "data_train_conversations": len(chat.train),
                             "data_trained_tokens": int(chat.train.loss_mask.sum()),
                             "data_val_conversations": len(chat.val), "data_skipped": chat.skipped,
                             "data_truncated": chat.truncated, "data_val_by_hash": chat.val_by_hash})
        if width is not None:
            data.info.update({"data_packed_windows": len(batches.windows), "data_packed_fill": batches.fill()})
    else:
        train_tokens, val_tokens = training_tokens(cfg, target, tokenizer)
        batches = TokenBatches(train_tokens, t.seq_len, t.batch_size, seed=cfg.seed)
        val = eval_windows(val_tokens, t.seq_len, t.eval_windows)
        prompts = [w[None, : e.prompt_tokens] for w in eval_windows(val_tokens, e.prompt_tokens, e.prompts)]
        data = TrainingData(batches, val, val, prompts, train_tokens, WindowSamples(batches=batches),
                            WindowSamples(val))
    if cfg.data.get("features"):
        store = FeatureStore(cfg.data.features)
        split = stored if cfg.data.get("chat") is not None else stored_split(cfg, target, data.train_samples)
        width = packing(cfg)
        data.batches = (PackedBatches(split, width, t.batch_size, seed=cfg.seed, pad_id=pad,
                                      what="stored training conversations") if width is not None
                        else FeatureBatches(split, t.batch_size, seed=cfg.seed, pad_id=pad))
        val_split = store.split("val")
        if val_split.meta["digest"] != data.val_samples.digest():
            raise ValueError(f"features in {cfg.data.features} hold other evaluation samples than these data settings "
                             "give: prepare them again")
        data.val = val_split.collate(range(len(val_split)), pad)
        data.info["features"] = str(cfg.data.features)
    return data


def stored_split(cfg, target, train_samples):
    """The training split of ``data.features``, checked against the run: the same target, data settings, layers and
    training samples."""
    store = FeatureStore(cfg.data.features)
    store.check(feature_key(cfg, target), needed_layers(cfg, target))
    split = store.split("train")
    if split.meta["digest"] != train_samples.digest() or len(split) != len(train_samples):
        raise ValueError(f"features in {cfg.data.features} were computed on other training samples than these "
                         "data settings give: prepare them again")
    return split


def subset(k: int | None, train: Samples, stored, progress: bool = True):
    """The first ``k`` training conversations (``data.chat.train_conversations``; None: all), of the samples and of
    their stored features when given → (samples, stored). The first k in file order: subsets of one file nest, so
    a data-scaling curve's smaller sets are parts of its larger ones; validation is never cut."""
    if k is None:
        return train, stored
    if k > len(train):
        raise ValueError(f"data.chat.train_conversations={k}, but the training split holds {len(train)} "
                         "conversations")
    if progress:
        print(f"training on the first {k} of {len(train)} training conversations (data.chat.train_conversations)")
    return Samples(*_first(train, k)), None if stored is None else stored.first(k)


def _first(samples, n: int):
    """The first ``n`` samples of a chat.Samples, as its constructor's arguments."""
    end = int(samples.offsets[n])
    return samples.input_ids[:end], samples.loss_mask[:end], samples.offsets[: n + 1], samples.prompt_lens[:n]
