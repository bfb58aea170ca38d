"""Measure decoding configurations against vanilla decoding in the same process.

Machines are shared and noisy, so speed is only ever reported as a ratio against a baseline measured
in the same run: configurations are interleaved prompt by prompt (vanilla first), after a warm-up, and
each configuration's speedup is the median over prompts of (its tokens/s ÷ vanilla's tokens/s on that
prompt). τ is the mean tokens committed per verification pass, bonus included. Each row also keeps its
per-prompt values (tokens/s, ratio to vanilla, accept lengths), for intervals over prompts; ``on_prompt``
hands over the rows of the prompts measured so far after each prompt, so a long run can be saved as it goes.
A "prompt" may be a batch (a list of 1-D prompts, decoded at once): its tokens/s count every row's tokens.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from treespec.generate import generate
from treespec.timing import StepTimer


@dataclass
class Config:
    """A decoding configuration. ``run``, when given, replaces treespec's generate() (peers such as
    transformers' own generate): run(prompt, max_new_tokens, temperature, top_p, generator) → GenerationResult."""

    name: str
    drafter: object = None
    tree: object = None
    acceptance: str = "rejection"
    run: Callable | None = None


def own_copy(drafter):
    """A configuration's drafter: its own copy when it remembers across generate() calls (Token Recycling,
    SuffixDecoding: ``Drafter.remembers_across_calls``), since ``measure`` runs configurations interleaved prompt by
    prompt and one must not draft from another's output of the same prompt; otherwise the one drafter, shared."""
    return copy.deepcopy(drafter) if getattr(drafter, "remembers_across_calls", False) else drafter


@dataclass
class Row:
    name: str
    tokens_per_s: float                 # median over prompts
    speedup: float                      # median over prompts of the per-prompt ratio to vanilla
    tau: float                          # mean accept length over all verification passes
    target_passes: int
    new_tokens: int
    overhead_fraction: float            # engine time outside model forwards / wall time (median)
    accept_lengths: list[int] = field(default_factory=list)
    # one entry per prompt run, in the order measure() was given the prompts (for intervals over prompts)
    prompt_tokens_per_s: list[float] = field(default_factory=list)
    prompt_speedups: list[float] = field(default_factory=list)      # tokens/s ÷ vanilla's on the same prompt
    prompt_accept_lengths: list[list[int]] = field(default_factory=list)
    prompt_new_tokens: list[int] = field(default_factory=list)      # tokens each prompt run generated
    draft_time_per_pass: float = float("nan")  # seconds in drafter.propose/accept per verification pass
    walk_time_per_pass: float = float("nan")   # seconds in the walker (walker.py) per verification pass


def rows_of(results: dict[str, list]) -> list[Row]:
    """One Row per configuration from its GenerationResults, one per prompt run measured so far ({name: [...]},
    vanilla's included, every list the same length); rows in the dict's order."""
    base, rows = results["vanilla"], []
    for name, outs in results.items():
        lengths = [n for o in outs for n in o.accept_lengths]
        # the time split exists for treespec's own runs (an observer timed them); a peer's runs have none
        timed = bool(lengths) and any(o.target_time > 0 for o in outs)
        ratios = [o.tokens_per_s / b.tokens_per_s for o, b in zip(outs, base, strict=True)]
        rows.append(Row(
            name=name,
            tokens_per_s=statistics.median(o.tokens_per_s for o in outs),
            speedup=statistics.median(ratios),
            tau=sum(lengths) / len(lengths) if lengths else float("nan"),
            target_passes=sum(o.target_passes for o in outs),
            new_tokens=sum(o.new_tokens for o in outs),
            overhead_fraction=(statistics.median(o.overhead_time / o.wall_time for o in outs)
                               if timed else float("nan")),
            accept_lengths=lengths,
            prompt_tokens_per_s=[o.tokens_per_s for o in outs],
            prompt_speedups=ratios,
            prompt_accept_lengths=[list(o.accept_lengths) for o in outs],
            prompt_new_tokens=[o.new_tokens for o in outs],
            draft_time_per_pass=(sum(o.draft_time for o in outs) / max(1, sum(o.target_passes for o in outs))
                                 if timed else float("nan")),
            walk_time_per_pass=(sum(o.walk_time for o in outs) / max(1, sum(o.target_passes for o in outs))
                                if timed else float("nan")),
        ))
    return rows


def measure(target, configs: list[Config], prompts: list[torch.Tensor], *, max_new_tokens: int,
            temperature: float = 0.0, top_p: float = 1.0, eos_token_id=None, seed: int = 0,
            warmup: bool = True, progress=None, on_prompt: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Run vanilla + every config on every prompt ([1, P] tensors, or batches: lists of 1-D prompts); rows in
    config order, vanilla first.

    ``progress(name, i)`` is called after each run; ``on_prompt(rows)`` after every config has run on a prompt,
    with the rows of the prompts measured so far (their per-prompt lists hold one entry per such prompt), so a
    caller can save what it has before a long run ends."""
    configs = [Config("vanilla")] + [c for c in configs if c.name != "vanilla"]

    def run(config: Config, prompt: torch.Tensor, tag: int):
        gen = torch.Generator().manual_seed(seed + tag)
        if config.run is not None:
            return config.run(prompt, max_new_tokens, temperature, top_p, gen)
        # the synchronising observer charges the target and the drafter for their own kernels
        return generate(target, prompt, drafter=config.drafter, tree=config.tree, max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, generator=gen,
                        acceptance=config.acceptance, observer=StepTimer(synchronize=True, device=target.device))

    if warmup:  # first calls pay for lazy initialisation (kernels, allocator): keep them out of the numbers
        for config in configs:
            run(config, [p[:8] for p in prompts[0]] if isinstance(prompts[0], list) else prompts[0][:, :8], -1)
    results: dict[str, list] = {c.name: [] for c in configs}
    for i, prompt in enumerate(prompts):
        for config in configs:
            results[config.name].append(run(config, prompt, i))
            if progress is not None:
                progress(config.name, i)
        if on_prompt is not None:
            on_prompt(rows_of(results))
    return rows_of(results)


def markdown_table(rows: list[Row]) -> str:
    lines = ["| config | tokens/s | speedup | τ | target passes | engine overhead |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.tokens_per_s:.1f} | {r.speedup:.2f}× | {r.tau:.2f} | {r.target_passes} | "
                     f"{100 * r.overhead_fraction:.1f}% |")
    return "\n".join(lines)

