"""The drafter-training job (``scripts/train_heads.py drafter=medusa|eagle|eagle3|draft``): data (self-distilled
corpus text by default, ``data=chat`` conversations, or stored target features ``data.features=DIR``), the
training loop (one process, or several under torchrun: train/training/distributed.py) with the expected τ measured at
every evaluation (train/training/expected_tau.py), export with per-depth rank accuracies, an end-of-run decoding
evaluation whose per-step acceptance lengths are logged (scalars, a table, a histogram) with tokens/s against
vanilla decoding, and a summary a researcher reads (train/training/run_summary.py). ``prepare_features`` is
``scripts/prepare_features.py``. The config checks and the data: train/training/drafter_setup.py.

What differs per drafter is its ``Recipe`` (heads/training/objective.py), found by the drafter's registry name.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf

from treespec.heads import registry
from treespec.heads.checkpoints.export import formats as export_formats
from treespec.heads.training.objective import TARGET_FOLDER
from treespec.io import single_run
from treespec.planning.autotree import saved_chooser
from treespec.planning.bench import Config, Row, measure
from treespec.planning.tree_spec import build_tree
from treespec.reference import load_model
from treespec.train.training import distributed, expected_tau, run_summary
from treespec.train.training.distributed import record
from treespec.train.training.drafter_setup import (
    TrainingData,
    check_config,
    data_settings,
    eval_tree_spec,
    feature_key,
    needed_layers,
    pad_id,
    training_data,
)
from treespec.train.training.export_profile import save_profile
from treespec.train.training.exportable import check_export_targets
from treespec.train.training.features import prepare
from treespec.train.training.lm_job import fingerprint
from treespec.train.training.log import RunLogger
from treespec.train.training.loop import OptimConfig, train


def module_fingerprint(module) -> dict:
    """What a checkpoint of the trained module must match: its config (a transformers model's, the draft model's:
    its architecture values)."""
    return dict(module.config) if isinstance(module.config, dict) else fingerprint(module)


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
