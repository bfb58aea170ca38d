"""The drafter-training job (``scripts/train_heads.py drafter=medusa|eagle|eagle3|draft``): data (self-distilled
corpus text by default, ``data=chat`` conversations, or stored target features ``data.features=DIR``), the
training loop (one process, or several under torchrun: train/training/distributed.py) with the expected τ measured at
every evaluation (train/training/expected_tau.py), export with per-depth rank accuracies, an end-of-run decoding
evaluation whose per-step acceptance lengths are logged (scalars, a table, a histogram) with tokens/s against
vanilla decoding, and a summary a researcher reads (train/training/run_summary.py). ``prepare_features`` is
``scripts/prepare_features.py``.

What differs per drafter is its ``Recipe`` (heads/training/objective.py), found by the drafter's registry name.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from treespec.heads import registry
from treespec.heads.checkpoints.export import formats as export_formats
from treespec.heads.training.objective import TARGET_FOLDER
from treespec.io import single_run, weights_digest
from treespec.planning.autotree import saved_chooser
from treespec.planning.bench import Config, Row, measure
from treespec.planning.tree_spec import build_tree, check_tree_spec
from treespec.reference import load_model
from treespec.train.training import config_checks, distributed, expected_tau, run_summary
from treespec.train.training.chat import SampleBatches, Samples, prepare_chat
from treespec.train.training.data import TokenBatches, eval_windows, prepare_tokens, self_distill
from treespec.train.training.distributed import record
from treespec.train.training.export_profile import save_profile
from treespec.train.training.exportable import check_export_names, check_export_targets
from treespec.train.training.features import FeatureBatches, FeatureStore, WindowSamples, prepare, split_layers
from treespec.train.training.lm_job import fingerprint
from treespec.train.training.log import RunLogger
from treespec.train.training.loop import OptimConfig, train
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


def module_fingerprint(module) -> dict:
    """What a checkpoint of the trained module must match: its config (a transformers model's, the draft model's:
    its architecture values)."""
    return dict(module.config) if isinstance(module.config, dict) else fingerprint(module)


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
    if data.get("chat"):
        data["chat"] = {k: v for k, v in data["chat"].items() if k != "pack"}
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
        store.check(feature_key(cfg, target), needed_layers(cfg, target))
        split = store.split("train")
        if split.meta["digest"] != data.train_samples.digest() or len(split) != len(data.train_samples):
            raise ValueError(f"features in {cfg.data.features} were computed on other training samples than these "
                             "data settings give: prepare them again")
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


def _first(samples, n: int):
    """The first ``n`` samples of a chat.Samples, as its constructor's arguments."""
    end = int(samples.offsets[n])
    return samples.input_ids[:end], samples.loss_mask[:end], samples.offsets[: n + 1], samples.prompt_lens[:n]


def decoding_eval(cfg, target, recipe, accuracy, prompts, tree16=None, choose=None
                  ) -> tuple[dict, Row, object, Row | None]:
    """Decode held-out prompts with the trained drafter on the evaluation tree (an "auto" one chosen by ``choose``,
    the saved cost model's chooser), against vanilla, and on ``tree16`` when given (the expected τ's 16-node
    accuracy tree) → (metrics, the drafter's row, the tree, tree16's row or None)."""
    e, spec, name = cfg.eval, eval_tree_spec(cfg), registry.get(cfg.drafter.name).run_name(cfg.drafter)
    tree = build_tree(spec, accuracy=accuracy, choose=choose)
    configs = [Config(name, recipe.drafter(), tree)]
    if tree16 is not None:
        configs.append(Config(f"{name} on the accuracy tree", recipe.drafter(), tree16))
    rows = measure(target, configs, prompts, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                   seed=cfg.seed)
    drafter_row = rows[1]
    return {"eval_tree_nodes": len(tree), "eval_mean_accept_length": drafter_row.tau,
            "eval_tokens_per_s": drafter_row.tokens_per_s, "eval_vanilla_tokens_per_s": rows[0].tokens_per_s,
            "eval_speedup": drafter_row.speedup}, drafter_row, tree, rows[2] if tree16 is not None else None


def log_accept_lengths(logger, row: Row, step: int) -> None:
    """The decoding evaluation's acceptance lengths (tokens committed per verification pass), where an offline
    reader finds them: scalars ``eval/measured_tau``, ``eval/verification_passes`` and
    ``eval/accept_length_share_<n>`` (the share of passes committing n tokens); the table ``eval/accept_lengths``
    (prompt, pass, accept_length: every pass); and the histogram ``eval/accept_length``."""
    lengths = [int(n) for n in row.accept_lengths]
    if not lengths:
        return
    counts = Counter(lengths)
    logger.histogram("eval/accept_length", lengths, step=step)
    logger.log({"eval/measured_tau": row.tau, "eval/verification_passes": len(lengths),
                **{f"eval/accept_length_share_{n}": counts[n] / len(lengths) for n in range(1, max(lengths) + 1)}},
               step=step)
    table = [[p, i, int(n)] for p, passes in enumerate(row.prompt_accept_lengths) for i, n in enumerate(passes)]
    logger.table("eval/accept_lengths", ["prompt", "pass", "accept_length"], table, step=step)


def tau_probe(cfg, target, recipe, data: TrainingData, say=print) -> expected_tau.ExpectedTau | None:
    """The in-training τ probe on the target's own continuations of the run's held-out windows
    (``eval.expected_tau``; null: off). Off with stored features unless asked: it runs the target."""
    e = cfg.eval.get("expected_tau")
    if not e:
        return None
    if cfg.data.get("features") and not e.get("with_features"):
        say("expected τ: off with data.features (it runs the target; eval.expected_tau.with_features=true turns it "
            "on); the end-of-run decoding evaluation measures τ")
        return None
    t0 = time.time()
    probe = expected_tau.ExpectedTau.prepare(target, data.val_windows, recipe.rank_accuracy, windows=e.windows,
                                             context=e.context, new_tokens=e.new_tokens, lead=e.lead, seed=cfg.seed)
    say(f"expected τ: {len(probe.windows)} continuations of {probe.windows.shape[1]} tokens by the target "
          f"({time.time() - t0:.0f} s), measured every {cfg.trainer.eval_every} steps")
    return probe


def load_target(cfg, ctx):
    target, tokenizer = load_model(cfg.target)
    target.to(ctx.device)
    for p in target.parameters():
        p.requires_grad_(False)
    return target, tokenizer


@record
def run(cfg) -> dict:
    """The ``scripts/train_heads.py`` job (every rank under torchrun; rank 0 returns the summary)."""
    check_config(cfg)
    return distributed.run_job(cfg, _run)


def _run(cfg, ctx) -> dict:
    t, d = cfg.trainer, cfg.drafter
    kind = registry.get(d.name)
    label = kind.run_name(d)  # a recipe's run goes by the recipe's name (Medusa-2's: medusa2)
    target, tokenizer = load_target(cfg, ctx)
    check_export_targets(cfg, target, kind.recipe, log=ctx.is_main)  # every rank refuses alike
    with distributed.rank0_first(ctx):  # rank 0 fills the data caches, the others read them
        data = training_data(cfg, target, tokenizer, progress=ctx.is_main)

    torch.manual_seed(cfg.seed)  # every rank builds the same initial drafter
    recipe = kind.recipe(cfg, target, data.stats_tokens)
    module = recipe.module
    total_steps = t.max_steps or math.ceil(t.epochs * data.batches.steps_per_epoch)
    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_layers = target.config.num_hidden_layers
    warning = run_summary.duplicate_layers_warning(kind, kind.target_layers(d, n_layers), n_layers)
    warnings = [warning] if warning else []
    if ctx.is_main:
        where = f", {ctx.world_size} ranks ({ctx.strategy})" if ctx.distributed else ""
        print(f"{label}: {recipe.description}, {n_params / 1e6:.2f}M trainable parameters, {total_steps} steps"
              f"{where}")
        for warning in warnings:
            print(warning)
    probe = tau_probe(cfg, target, recipe, data, say=print if ctx.is_main else lambda *a: None)

    logger = None
    if ctx.is_main:
        logger = RunLogger(cfg.run_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project,
                           name=f"heads-{label}", config=OmegaConf.to_container(cfg, resolve=True), resume=cfg.resume)

    def evaluate() -> dict:
        metrics = recipe.evaluate(data.val)
        return {**metrics, **probe()} if probe is not None else metrics

    result = train(
        module, recipe.loss, data.batches.batch,
        total_steps=total_steps, optim=OptimConfig(**cfg.optim), run_dir=cfg.run_dir,
        # a resume on other data (corpus, self-distillation, chat) is refused
        fingerprint={**module_fingerprint(module), "target": fingerprint(target), "seq_len": t.seq_len,
                     "seed": cfg.seed, "data": data_settings(cfg)},
        evaluate=evaluate, after_eval=(lambda step, metrics: expected_tau.plot(cfg.run_dir)) if probe else None,
        eval_every=t.eval_every, ckpt_every=t.ckpt_every, log_every=t.log_every, resume=cfg.resume,
        logger=logger, progress=t.progress, stop_after=t.stop_after, precision=t.precision,
        grad_accum=t.get("grad_accum", 1), seed=cfg.seed, dist=ctx,
    )
    if not ctx.is_main:
        return {}
    if result.full_state is not None:  # FSDP: export from an unsharded copy holding the trained weights
        torch.manual_seed(cfg.seed)
        recipe = kind.recipe(cfg, target, data.stats_tokens)
        recipe.module.load_state_dict(result.full_state, strict=False)
        if probe is not None:
            probe.rank_accuracy = recipe.rank_accuracy
    summary = {"drafter": label, "trainable_parameters": n_params, "steps": result.step,
               "tokens_seen": result.tokens_seen, "train_wall_time_s": result.wall_time,
               "train_loss": result.train_loss, "world_size": ctx.world_size, **data.info}
    if warnings:
        summary["warnings"] = warnings
    if result.step >= total_steps:
        print(end_of_run(cfg, target, tokenizer, recipe, probe, data, result, summary, logger))
    else:
        resume = run_summary.resume_command(run_summary.hydra_overrides(), cfg.run_dir, ctx.world_size)
        print(run_summary.text([("resume", [resume])],
                               f"{label} run stopped at step {result.step} of {total_steps} (trainer.stop_after="
                               f"{t.stop_after}); its checkpoint is in {cfg.run_dir}. To continue it:"))
    logger.summary(summary)
    logger.finish()
    return summary


def end_of_run(cfg, target, tokenizer, recipe, probe, data: TrainingData, result, summary: dict, logger) -> str:
    """Export, the decoding evaluation beside the expected τ, and the run's summary (updates ``summary``) →
    the summary's text. A recipe that fine-tunes the target (Medusa-2) is exported, evaluated and decoded with
    its fine-tuned target: the one its drafter is lossless against."""
    d, step = cfg.drafter, result.step
    final_metrics, accuracy = recipe.export(data.val_windows, cfg.export_dir)
    if recipe.tokenizer_beside:  # a whole model folder (the draft model): it loads on its own, as a target does
        tokenizer.save_pretrained(cfg.export_dir)
    decoder, target_name = target, str(cfg.target)
    rows = []
    if recipe.target is not None:
        decoder, target_name = recipe.target.eval(), f"{cfg.export_dir}/{TARGET_FOLDER}"
        tokenizer.save_pretrained(target_name)  # the folder loads as a target on its own
        rows.append(("target", target_lines(result.eval_metrics, summary, target_name)))
    # beside the accuracies, this machine's cost model (and the chain τ of sampled candidates), measured as
    # load_profile and the comparison measure them: what generate(tree={"kind": "auto"}) chooses with
    measured = cfg.eval.get("profile") or {}
    costs = save_profile(cfg.export_dir, decoder, d.name, recipe.module, recipe.drafter(),
                         data.val_windows, eval_temperature=cfg.eval.get("temperature", 0.0), seed=cfg.seed,
                         **{k: v for k, v in measured.items() if k in ("cost_sizes", "engine_rounds", "chain_windows")})
    summary.update(final_metrics)
    probe_acc = probe.last() if probe is not None else None
    tree16 = expected_tau.accuracy_tree(probe_acc) if probe_acc is not None else None
    eval_metrics, row, tree, row16 = decoding_eval(cfg, decoder, recipe, accuracy, data.prompts, tree16,
                                                   saved_chooser(costs))
    summary.update(eval_metrics)
    log_accept_lengths(logger, row, step)
    logger.log({**eval_metrics, **{f"export/{k}": v for k, v in final_metrics.items()}}, step=step)
    formats = export_formats(recipe.drafter(), decoder)
    summary["export_formats"] = {to: reason or "ok" for to, reason in formats.items()}
    run_dir = cfg.run_dir
    files = "metrics.jsonl, summary.json" + (f", {expected_tau.PLOT_FILE}" if probe is not None else "")
    rows.insert(0, ("outputs", [f"{cfg.export_dir} (the trained drafter, head_accuracy.json)",
                                f"{run_dir}: {files}"]))
    if probe_acc is not None:
        tau = expected_tau.expected_taus(probe_acc)
        comparison, lines = expected_tau.against_measured(probe_acc, row16.tau, tree, row.tau)
        summary.update({"expected_tau_chain": tau["chain"], "expected_tau_tree16": tau["tree16"], **comparison})
        logger.log({"eval/measured_tau_tree16": row16.tau}, step=step)
        expected_tau.plot(run_dir, measured=row16.tau)
        rows.append(("τ", [*lines, f"expected at the last evaluation, chain of {len(probe_acc)}: {tau['chain']:.2f}"]))
    else:
        rows.append(("τ", [f"measured {row.tau:.2f} (decoding evaluation; eval.expected_tau is off)"]))
    rows.append(("top-1 @ 1", run_summary.top1_lines(registry.get(d.name), result.eval_metrics, summary, probe_acc)))
    rows.append(("export", run_summary.export_lines(formats, cfg.export_dir, target_name)))
    workload, on = run_summary.training_workload(cfg.data, summary)
    trees, best = run_summary.suggested_trees(probe_acc if probe_acc is not None else accuracy, costs)
    summary["compare_command"] = run_summary.compare_command(d.name, cfg.export_dir, target_name, workload, trees)
    rows.append(("compare", [summary["compare_command"], f"on {on}", best]))
    if summary.get("warnings"):
        rows.append(("warnings", summary["warnings"]))
    title = (f"{summary['drafter']} run finished: {step} steps, {result.tokens_seen:,} tokens, "
             f"{result.wall_time:.0f} s of training; speedup {eval_metrics['eval_speedup']:.2f}x over vanilla decoding")
    return run_summary.text(rows, title)


def target_lines(val_metrics: dict, summary: dict, folder: str) -> list[str]:
    """Where the fine-tuned target went and how its held-out LM loss moved (the last evaluation's
    ``lm_ce`` against the original's ``original_lm_ce``; updates ``summary``)."""
    lines = [f"{folder} (the fine-tuned target: decode with it, the heads are lossless against it)"]
    if "lm_ce" in val_metrics:
        summary.update({"target_lm_loss_before": val_metrics["original_lm_ce"],
                        "target_lm_loss_after": val_metrics["lm_ce"], "kl_to_original": val_metrics["kl_to_original"]})
        lines.append(f"held-out LM loss {val_metrics['original_lm_ce']:.4f} (original) → {val_metrics['lm_ce']:.4f} "
                     f"(fine-tuned); KL(original ‖ fine-tuned) {val_metrics['kl_to_original']:.4f} per token")
    return lines


# -- offline target features (scripts/prepare_features.py) ------------------------------------------------
@record
def prepare_features(cfg) -> dict | None:
    """Run the frozen target once over the training data (and the evaluation windows) of ``cfg`` and store
    what the drafter trains on under ``data.features`` (train/training/features.py): every rank under torchrun takes
    its share of the shards; rank 0 writes the index. Resumable: finished shards are kept."""
    check_config(cfg)
    if not cfg.data.get("features"):
        raise ValueError("prepare_features needs data.features=<folder to write the features to>")
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    with distributed.session("ddp", cfg.trainer.get("dist_timeout_s")) as ctx, \
            (single_run(Path(cfg.data.features) / distributed.LOCK_FILE, f"data.features={cfg.data.features}")
             if ctx.is_main else contextlib.nullcontext()):
        target, tokenizer = load_target(cfg, ctx)
        features = cfg.data.features
        with distributed.rank0_first(ctx):
            plain = OmegaConf.merge(cfg, {"data": {"features": None}})
            data = training_data(plain, target, tokenizer, progress=ctx.is_main)
        t0 = time.time()
        index = prepare(target, {"train": data.train_samples, "val": data.val_samples}, needed_layers(cfg, target),
                        features, key=feature_key(cfg, target), dtype=cfg.data.get("features_dtype", "float32"),
                        batch_size=cfg.data.get("features_batch_size", 8),
                        shard_samples=cfg.data.get("features_shard_samples", 256),
                        pad_id=pad_id(tokenizer), rank=ctx.rank, world_size=ctx.world_size,
                        barrier=lambda: distributed.barrier(ctx), progress=ctx.is_main)
        if index is not None:
            tokens = sum(s["tokens"] for s in index["splits"].values())
            print(f"features written to {features}: {tokens} tokens, {index['bytes_per_token']} bytes/token, "
                  f"{time.time() - t0:.0f} s")
        return index
