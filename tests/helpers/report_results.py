"""A comparison's results.json synthesised from a plan (no model runs) for the report's tests (tests/train/compare/:
test_report.py, test_report_figures.py, test_report_intervals.py, test_side_by_side.py): ``synthetic_result``
(the trees of REPORT_PLAN, the peers of REPORT_PEERS, a stamp), ``with_categories`` (the same run as a workload's),
``rendered_run`` (written and rendered into a folder) and ``md_table_of`` (a results.md table's cells)."""

import copy
import itertools
import random

from treespec.train.compare import report

# drafter → [(tree, nodes, depth, mean τ, median speedup, predicted)]; prompt lookup and dynamic trees have no
# prediction, prompt lookup no accuracies (no heat map)
REPORT_PLAN = {
    "draft": [("chain γ=1", 1, 1, 1.5, 0.95, True), ("chain γ=2", 2, 2, 1.7, 1.0, True),
              ("full 2×2", 6, 2, 2.2, 1.1, True), ("accuracy 6", 6, 3, 2.3, 1.05, True)],
    "prompt_lookup": [("chain γ=2", 2, 2, 2.1, 1.6, False), ("chain γ=4", 4, 4, 2.8, 2.2, False)],
    "eagle": [("chain γ=4", 4, 4, 3.5, 1.5, True), ("dynamic 16/5/4", 16, 5, 4.6, 1.3, False)],
}
REPORT_PEERS = {"transformers greedy": 0.45, "transformers assisted": 0.3, "transformers prompt lookup": 0.8}


def _lengths(rng, tau: float, passes: int) -> list[int]:
    top = max(2, round(2 * tau))
    return [max(1, min(top, round(rng.gauss(tau, 0.8)))) for _ in range(passes)]


def _ratios(tps: list[float], base: list[float]) -> list[float]:
    return [t / b for t, b in zip(tps, base, strict=True)]


def synthetic_result(seed: int = 0, prompts: int = 5, repeats: int = 2, commit: str = "a" * 40) -> dict:
    rng = random.Random(seed)
    runs = prompts * repeats
    prompt_of_run = [i % prompts for i in range(runs)]
    vanilla_tps = [100 * (1 + 0.05 * rng.random()) for _ in range(runs)]
    records = [{"config": "vanilla", "drafter": "none", "tree": "vanilla", "nodes": 0, "depth": 0,
                "predicted_tau": 1.0, "predicted_speedup": 1.0, "tau": 1.0, "tokens_per_s": 100.0, "speedup": 1.0,
                "target_passes": runs * 16, "new_tokens": runs * 16, "overhead_fraction": 0.04,
                "draft_ms_per_depth": None, "c": None,
                "runs": {"tokens_per_s": vanilla_tps, "speedup": [1.0] * runs, "accept_lengths": [[1] * 16] * runs}}]
    prompt_effect = [rng.uniform(0.85, 1.15) for _ in range(prompts)]
    for drafter, trees in REPORT_PLAN.items():
        for tree, nodes, depth, tau, speedup, predicted in trees:
            ratios = [speedup * prompt_effect[p] * rng.uniform(0.97, 1.03) for p in prompt_of_run]
            lengths = [_lengths(rng, tau, 12) for _ in range(runs)]
            records.append({
                "config": f"{drafter} | {tree}", "drafter": drafter, "tree": tree, "nodes": nodes, "depth": depth,
                "predicted_tau": tau * 0.9 if predicted else None,
                "predicted_speedup": speedup * 0.8 if predicted else None,
                "tau": sum(map(sum, lengths)) / sum(map(len, lengths)), "tokens_per_s": 100 * speedup,
                "speedup": sorted(ratios)[len(ratios) // 2], "target_passes": 12 * runs, "new_tokens": 16 * runs,
                "overhead_fraction": None if tree.startswith("dynamic") else 0.03,
                "draft_ms_per_depth": 0.5 * nodes, "c": 0.05 * nodes,
                "step_ms": {"target": 8.0 + nodes / 4, "draft": 0.5 * depth, "update": 0.1, "walk": 0.3,
                            "other": 1.0},
                "runs": {"tokens_per_s": [100 * r for r in ratios], "speedup": ratios, "accept_lengths": lengths}})
    bests = {}
    for rec in records[1:]:
        if rec["drafter"] not in bests or rec["speedup"] > bests[rec["drafter"]]["speedup"]:
            bests[rec["drafter"]] = rec
    best = max(records[1:], key=lambda r: r["speedup"])["config"]
    pass_vanilla = [100.0 * rng.uniform(0.98, 1.02) for _ in range(runs)]
    peer_pass = {"vanilla": {"tokens_per_s": pass_vanilla, "speedup": [1.0] * runs}}
    for rec in bests.values():
        tps = [v * rec["speedup"] * rng.uniform(0.95, 1.05) for v in pass_vanilla]
        peer_pass[rec["config"]] = {"tokens_per_s": tps, "speedup": _ratios(tps, pass_vanilla)}
    peers = []
    for name, speed in REPORT_PEERS.items():
        tps = [v * speed * rng.uniform(0.95, 1.05) for v in pass_vanilla]
        peers.append({"name": name, "tokens_per_s": sorted(tps)[runs // 2], "speedup_vs_vanilla": speed,
                      "treespec_best_over_this": 2.0,
                      "runs": {"tokens_per_s": tps, "speedup": _ratios(tps, pass_vanilla)}})
    stamp = {"command": "python scripts/compare_trees.py", "started": "2025-01-01 00:00:00 +0000",
             "git": {"commit": commit, "dirty": False, "changed": []},
             "versions": {"treespec": "0.1.0", "torch": "2.13.0", "transformers": "5.0", "python": "3.11"},
             "device": {"device": "cpu", "cpu": "test cpu", "cpu_count": 2, "torch_threads": 2,
                        "OMP_NUM_THREADS": None},
             "target": {"source": "reference:target", "files": {"model.safetensors": "b" * 40},
                        "weights_sha1": "c" * 40},
             "drafters": {"draft": {"source": "reference:draft", "files": {}, "weights_sha1": "d" * 40},
                          "prompt_lookup": {"source": None, "weights": None},
                          "eagle": {"source": "reference:eagle", "files": {}, "weights_sha1": "e" * 40}},
             "prompts": {"set": "synthetic", "count": prompts, "token_ids_sha1": "f" * 40}, "seed": 0,
             "config": {"prompts": prompts, "repeats": repeats, "max_new_tokens": 16}}
    return {"format": 2, "stamp": stamp,
            "settings": {"prompts": prompts, "repeats": repeats, "max_new_tokens": 16, "temperature": 0.0,
                         "top_p": 1.0, "seed": 0, "bootstrap": {"samples": 500, "level": 0.95, "seed": 0}},
            "prompt_of_run": prompt_of_run, "cost_curve": {1: 0.01, 4: 0.012, 16: 0.02},
            "records": records, "skipped": [{"config": "prompt_lookup | accuracy 6", "drafter": "prompt_lookup",
                                             "tree": "accuracy 6", "reason": "no measured accuracies"}],
            "best": best, "accuracy": {"draft": [[0.6, 0.2, 0.1], [0.5, 0.15]], "eagle": [[0.7, 0.1], [0.7, 0.1]]},
            "peers": peers, "peer_pass": peer_pass, "wall_s": 12.0}


def with_categories(result: dict) -> dict:
    """The synthetic run as a workload run: prompts 0, 2, 4 are "code", 1 and 3 "chat"."""
    result = copy.deepcopy(result)
    result["prompt_info"] = [{"id": str(p), "category": "code" if p % 2 == 0 else "chat", "turn": 1,
                              "prompt_tokens": 40 + 30 * p, "max_new_tokens": 16, "answer_tokens": 16}
                             for p in range(result["settings"]["prompts"])]
    result["settings"]["held_out"] = "the target's own continuations of 2 held-out prompts"
    return result


def md_table_of(md: str, section: str) -> tuple[list[str], list[list[str]]]:
    """The first table under the heading starting with ``section``: (header, rows of cells)."""
    lines = md.split(f"## {section}", 1)[1].split("\n", 1)[1].strip().splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines)]
    return cells[0], cells[2:]


def rendered_run(out):
    """One synthetic run written and rendered into ``out``: (result, its analysis, out)."""
    result = synthetic_result()
    return result, report.write_outputs(copy.deepcopy(result), out), out
