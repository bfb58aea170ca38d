"""Where a drafter's training step spends its time: tokens/s over a few steps, and the torch profiler's top ops.

Takes the same hydra config as scripts/train_heads.py, builds the same target, data and recipe, and times
forward + backward + AdamW on the run's own batches (no checkpoints, no evaluation):

    python scripts/train_step_profile.py target=smollm2 drafter=eagle3 data=chat \
        data.chat.source=treespec/models/smollm2/magpie.jsonl trainer.seq_len=448 \
        data.features=feats/smollm2-eagle3 data.features_dtype=bfloat16 trainer.threads=1 trainer.precision=bf16 \
        drafter.draft_vocab_size=8192 drafter.unroll_steps=4 +steps=6 +profile=true

Prints the median seconds per step after a warm-up step, tokens/s (non-padding tokens, as the training
log's ``tok_s``), and with ``+profile=true`` the profiler's table of self CPU time over one step.
"""

import statistics
import time

import hydra
import torch

from treespec.heads import registry
from treespec.heads.training.batches import batch_tokens
from treespec.train.training.distributed import Context
from treespec.train.training.drafter_job import load_target
from treespec.train.training.drafter_setup import check_config, training_data
from treespec.train.training.loop import OptimConfig, make_optimizer


def one_step(module, loss_fn, optimizer, batch, autocast) -> None:
    with autocast:
        loss, _ = loss_fn(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@hydra.main(config_path="../conf", config_name="train_heads", version_base="1.3")
def main(cfg) -> None:
    check_config(cfg)
    if cfg.trainer.threads:
        torch.set_num_threads(int(cfg.trainer.threads))
    ctx = Context()
    target, tokenizer = load_target(cfg, ctx)
    data = training_data(cfg, target, tokenizer, progress=False)
    torch.manual_seed(cfg.seed)
    recipe = registry.get(cfg.drafter.name).recipe(cfg, target, data.stats_tokens)
    module = recipe.module
    module.train()
    optimizer = make_optimizer(module, OptimConfig(**cfg.optim))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16")
    steps = int(cfg.get("steps", 6))
    seconds, tokens = [], []
    for step in range(steps + 1):
        batch = data.batches.batch(step)
        t0 = time.perf_counter()
        one_step(module, recipe.loss, optimizer, batch, autocast)
        if step:  # the first step warms up allocators and oneDNN's kernels
            seconds.append(time.perf_counter() - t0)
            tokens.append(batch_tokens(batch))
    per_step = statistics.median(seconds)
    print(f"{cfg.drafter.name}: {per_step:.2f} s a step (median of {steps}), "
          f"{statistics.median(t / s for t, s in zip(tokens, seconds, strict=True)):.0f} tokens/s, "
          f"{torch.get_num_threads()} thread(s), precision {cfg.trainer.precision}")
    if cfg.get("profile"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            one_step(module, recipe.loss, optimizer, data.batches.batch(steps + 1), autocast)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=int(cfg.get("rows", 25))))


if __name__ == "__main__":
    main()
