"""Measure decoding configurations against vanilla decoding in the same process.

Machines are shared and noisy, so speed is only ever reported as a ratio against a baseline measured
in the same run: configurations are interleaved prompt by prompt (vanilla first), after a warm-up, and
each configuration's speedup is the median over prompts of (its tokens/s ÷ vanilla's tokens/s on that
prompt). τ is the mean tokens committed per verification pass, bonus included. Each row also keeps its
per-prompt values (tokens/s, ratio to vanilla, accept lengths), for intervals over prompts; ``on_prompt``
hands over the rows of the prompts measured so far after each prompt, so a long run can be saved as it goes.
A "prompt" may be a batch (a list of 1-D prompts, decoded at once): its tokens/s count every row's tokens.

A run killed part way can continue (train/compare/journal.py keeps every run): ``done`` hands back runs measured
by an earlier process, ``on_run`` gets every new one. A ratio is only meaningful within one process (another
process may run on a busier machine, with other threads), so on a prompt where some runs are restored and some
are not, vanilla runs again first and the new runs are paired with it (``Measured.vanilla_tokens_per_s``);
restored runs keep the pairing they were measured with.

With ``compile`` (generate's: compiled static passes, treespec/static_pass.py) every treespec configuration, vanilla
included, runs compiled; its warm-up then runs each configuration at the full budget on one prompt of every cache
capacity the prompts need, so that no compilation (seconds to minutes) falls inside a timed run.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from treespec.generate import decode
from treespec.result import TimedRun
from treespec.static_pass import static_capacity
from treespec.timing import StepTimer


@dataclass
class Config:
    """A decoding configuration. ``run``, when given, replaces treespec's decoding loop (peers such as
    transformers' own generate): run(prompt, max_new_tokens, temperature, top_p, generator) → GenerationResult."""

    name: str
    drafter: object = None
    tree: object = None  # a resolved Tree or DynamicTree (a spec: planning.resolve.plan_tree first); None: the default
    acceptance: str = "rejection"
    run: Callable | None = None


def own_copy(drafter):
    """A configuration's drafter: its own copy when it remembers across generate() calls (Token Recycling,
    SuffixDecoding: ``Drafter.remembers_across_calls``), since ``measure`` runs configurations interleaved prompt by
    prompt and one must not draft from another's output of the same prompt; otherwise the one drafter, shared."""
    return copy.deepcopy(drafter) if getattr(drafter, "remembers_across_calls", False) else drafter


@dataclass
class Measured(TimedRun):
    """What a Row keeps of one run (a GenerationResult's numbers), small enough to journal and restore."""

    new_tokens: int
    wall_time: float
    accept_lengths: list[int]
    target_passes: int
    target_time: float = 0.0
    draft_time: float = 0.0
    update_time: float = 0.0  # part of draft_time: the drafter updated from verified passes (observe_pass, accept)
    walk_time: float = 0.0
    prefill_time: float = 0.0         # of wall_time: the prefill, and its parts in target_time and draft_time
    prefill_target_time: float = 0.0
    prefill_draft_time: float = 0.0
    vanilla_tokens_per_s: float | None = None  # the vanilla run this one's ratio is to, when it is not the
    #                                             prompt's own (a resumed prompt: module docstring)

    @classmethod
    def of(cls, result) -> Measured:
        return cls(new_tokens=int(result.new_tokens), wall_time=float(result.wall_time),
                   accept_lengths=[int(n) for n in result.accept_lengths], target_passes=int(result.target_passes),
                   target_time=float(result.target_time), draft_time=float(result.draft_time),
                   update_time=float(result.update_time), walk_time=float(result.walk_time),
                   prefill_time=float(result.prefill_time), prefill_target_time=float(result.prefill_target_time),
                   prefill_draft_time=float(result.prefill_draft_time))


WARMUP_TOKENS = 8  # a warm-up generation's budget: a few steps of every configuration initialise what is lazy


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
    # where a pass's wall time goes (the prefill left out: it is no pass's): the target's forwards, the drafter's
    # updates from verified passes (part of draft_time_per_pass), and the whole wall time
    target_time_per_pass: float = float("nan")
    update_time_per_pass: float = float("nan")
    wall_time_per_pass: float = float("nan")


#: each part's share of the prefill (Measured fields): what a per-pass time leaves out
PREFILL_SHARE = {"wall_time": "prefill_time", "target_time": "prefill_target_time", "draft_time": "prefill_draft_time"}


def _per_pass(outs: list[Measured], part: str) -> float:
    """Seconds of that part (a Measured field) per verification pass, over every prompt run, the prefill's share
    left out (a run journaled before it was kept has none: its prefill stays in)."""
    prefill = PREFILL_SHARE.get(part)
    spent = sum(getattr(o, part) - (getattr(o, prefill) if prefill else 0.0) for o in outs)
    return spent / max(1, sum(o.target_passes for o in outs))


def step_parts(row: Row) -> dict[str, float] | None:
    """Milliseconds per verification pass by part (None for an untimed row, a peer's): the target's forwards, the
    drafter proposing (retrieval, draft depths), the drafter updating from the pass (an index's update), the walker,
    and the rest of the engine's host work (masks, cache compaction, Python); they sum to the pass's wall time."""
    if math.isnan(row.wall_time_per_pass) or math.isnan(row.target_time_per_pass):
        return None
    propose = row.draft_time_per_pass - row.update_time_per_pass
    parts = {"target": row.target_time_per_pass, "draft": propose, "update": row.update_time_per_pass,
             "walk": row.walk_time_per_pass}
    parts["other"] = row.wall_time_per_pass - sum(parts.values())
    return {k: round(1e3 * v, 4) for k, v in parts.items()}


def rows_of(results: dict[str, list[Measured]]) -> list[Row]:
    """One Row per configuration from its runs, one per prompt run measured so far ({name: [...]}, vanilla's
    included, every list the same length); rows in the dict's order."""
    base, rows = results["vanilla"], []
    for name, outs in results.items():
        lengths = [n for o in outs for n in o.accept_lengths]
        # the time split exists for treespec's own runs (an observer timed them); a peer's runs have none
        timed = bool(lengths) and any(o.target_time > 0 for o in outs)
        ratios = [o.tokens_per_s / (o.vanilla_tokens_per_s or b.tokens_per_s) for o, b in zip(outs, base, strict=True)]
        per_pass = functools.partial(_per_pass, outs) if timed else lambda part: float("nan")
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
            draft_time_per_pass=per_pass("draft_time"),
            walk_time_per_pass=per_pass("walk_time"),
            target_time_per_pass=per_pass("target_time"),
            update_time_per_pass=per_pass("update_time"),
            wall_time_per_pass=per_pass("wall_time"),
        ))
    return rows


def measure(target, configs: list[Config], prompts: list[torch.Tensor], *, max_new_tokens: int,
            temperature: float = 0.0, top_p: float = 1.0, eos_token_id=None, seed: int = 0,
            warmup: bool = True, progress=None, on_prompt: Callable[[list[Row]], None] | None = None,
            done: dict[tuple[int, str], Measured] | None = None,
            on_run: Callable[[int, str, Measured], None] | None = None, compile: bool | dict = False) -> list[Row]:
    """Run vanilla + every config on every prompt ([1, P] tensors, or batches: lists of 1-D prompts); rows in
    config order, vanilla first.

    ``progress(name, i)`` is called after each run; ``on_prompt(rows)`` after every config has run on a prompt,
    with the rows of the prompts measured so far (their per-prompt lists hold one entry per such prompt), so a
    caller can save what it has before a long run ends. ``done[(i, name)]``: prompt i's run of a configuration
    measured earlier (not run again; module docstring for the pairing); ``on_run(i, name, measured)`` after each
    new run."""
    configs = [Config("vanilla")] + [c for c in configs if c.name != "vanilla"]
    done = done or {}
    have = dict(done)  # every run so far: restored, then new

    def run(config: Config, prompt: torch.Tensor, tag: int, budget: int = max_new_tokens) -> Measured:
        gen = torch.Generator().manual_seed(seed + tag)
        if config.run is not None:
            return Measured.of(config.run(prompt, budget, temperature, top_p, gen))
        # the synchronising observer charges the target and the drafter for their own kernels
        return Measured.of(decode(target, prompt, drafter=config.drafter, tree=config.tree, max_new_tokens=budget,
                                  temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, generator=gen,
                                  acceptance=config.acceptance, compile=compile,
                                  observer=StepTimer(synchronize=True, device=target.device)))

    left = [[c for c in configs if (i, c.name) not in done] for i in range(len(prompts))]
    if warmup and any(left):  # first calls pay for lazy initialisation (kernels, allocator): keep it out of the numbers
        for config in configs:
            run(config, [p[:8] for p in prompts[0]] if isinstance(prompts[0], list) else prompts[0][:, :8], -1,
                min(max_new_tokens, WARMUP_TOKENS))
            for prompt in (compile_warmups(config, prompts, max_new_tokens) if compile else []):
                run(config, prompt, -1)
    results: dict[str, list] = {c.name: [] for c in configs}
    for i, prompt in enumerate(prompts):
        # vanilla first whenever anything runs: the ratios of this process's runs are to this process's vanilla
        paired = None
        for config in ([configs[0]] if left[i] else []) + [c for c in left[i] if c.name != "vanilla"]:
            measured = run(config, prompt, i)
            if config.name == "vanilla" and (i, "vanilla") in done:
                paired = measured.tokens_per_s  # a resumed prompt's vanilla: only the new runs' pairing
                continue
            measured.vanilla_tokens_per_s = paired
            have[(i, config.name)] = measured
            if on_run is not None:
                on_run(i, config.name, measured)
            if progress is not None:
                progress(config.name, i)
        for config in configs:
            results[config.name].append(have[(i, config.name)])
        if on_prompt is not None:
            on_prompt(rows_of(results))
    return rows_of(results)


def compile_warmups(config: Config, prompts: list, max_new_tokens: int) -> list:
    """One prompt per cache capacity ``config``'s compiled runs over ``prompts`` need (its graphs are compiled per
    capacity: treespec/static_pass.py), for a full-budget warm-up; none for a peer's runner."""
    if config.run is not None:
        return []
    nodes = getattr(config.tree, "num_nodes", 1)  # (vanilla: none; a spec resolved later: its bucket is a guess)
    firsts = {}
    for prompt in prompts:
        width = max(len(p) for p in prompt) if isinstance(prompt, list) else prompt.shape[1]
        firsts.setdefault(static_capacity(width + max_new_tokens + nodes), prompt)
    return list(firsts.values())


def markdown_table(rows: list[Row]) -> str:
    lines = ["| config | tokens/s | speedup | τ | target passes | engine overhead |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.tokens_per_s:.1f} | {r.speedup:.2f}× | {r.tau:.2f} | {r.target_passes} | "
                     f"{100 * r.overhead_fraction:.1f}% |")
    return "\n".join(lines)

