"""transformers' own decoding methods as the comparison's peers: greedy (or sampling), assisted generation with a
draft model, and prompt lookup, each a bench.Config runner over the same prompts as treespec's configurations, its
target calls counted so its τ stands beside treespec's (train/compare/target_calls.py). train/compare/harness.py
measures them in a pass of their own, interleaved with each drafter's best configuration (``peers=true``), or as
methods of the main pass (``baselines``, train/compare/methods.py).
"""

from __future__ import annotations

import statistics
import time

import torch

from treespec.compat import NO_EOS
from treespec.generate import GenerationResult
from treespec.planning.bench import Row
from treespec.train.compare.target_calls import TargetCalls

PEERS = {"greedy": "transformers greedy", "assisted": "transformers assisted",
         "prompt_lookup": "transformers prompt lookup"}  # transformers' own methods: hf_peer's kinds → their names


def hf_peer(target, kind: str, assistant=None, eos_token_id=None):
    """A bench.Config runner for transformers' own generate(): greedy/sampling, assisted, prompt lookup. With
    ``eos_token_id`` it stops where treespec does (end tokens); without, it runs the whole budget."""
    extra = {"assisted": {"assistant_model": assistant}, "prompt_lookup": {"prompt_lookup_num_tokens": 4}}.get(kind, {})
    stop = {"eos_token_id": list(eos_token_id)} if eos_token_id else {"eos_token_id": NO_EOS}

    def run(prompt, max_new_tokens, temperature, top_p, generator):
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
            {"do_sample": False}
        budget = {} if eos_token_id else {"min_new_tokens": max_new_tokens}
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        with TargetCalls(target, prompt.shape[1]) as calls:  # each target call's commits: τ beside treespec's
            t0 = time.perf_counter()
            seq = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                  pad_token_id=0, **budget, **stop, **sampling, **extra)
            wall = time.perf_counter() - t0
        return GenerationResult(sequences=seq, prompt_length=prompt.shape[1], wall_time=wall,
                                accept_lengths=calls.accept_lengths(seq.shape[1]))

    return run


def peer_results(rows: list[Row], best: str) -> tuple[dict, list[dict]]:
    """(peer_pass, peers) of one interleaved pass holding transformers' methods (``PEERS``): every treespec row's
    per-prompt values, and each transformers method's, with the ratio of ``best``'s tokens/s to its own."""
    is_peer = lambda r: r.name in PEERS.values()
    runs = {r.name: r.prompt_tokens_per_s for r in rows}
    best_runs = runs.get(best, runs["vanilla"])
    passed = {r.name: {"tokens_per_s": r.prompt_tokens_per_s, "speedup": r.prompt_speedups,
                       "new_tokens": r.prompt_new_tokens} for r in rows if not is_peer(r)}
    peers = [{"name": r.name, "tokens_per_s": r.tokens_per_s, "speedup_vs_vanilla": r.speedup,
              "treespec_best_over_this": statistics.median(
                  b / p for b, p in zip(best_runs, r.prompt_tokens_per_s, strict=True)),
              "runs": {"tokens_per_s": r.prompt_tokens_per_s, "speedup": r.prompt_speedups,
                       "new_tokens": r.prompt_new_tokens, "accept_lengths": r.prompt_accept_lengths}}
             for r in rows if is_peer(r)]
    return passed, peers
