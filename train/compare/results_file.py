"""results.json, the comparison's one record of a run: saved atomically while the run measures, read back for
``report=PATH`` with what it lacks filled in as missing (shown as "–", named at the top of results.md) and what
rendering cannot do without refused, naming the file and the field (train/compare/report.py renders it).
"""

from __future__ import annotations

from pathlib import Path

from treespec.io import atomic_write_json, read_json
from treespec.train.compare.plots import partial
from treespec.train.compare.time_split import PARTS
from treespec.train.compare.workload import DEFAULT_CATEGORY


def save_result(result: dict, out_dir: Path) -> Path:
    """results.json, written atomically: a run killed while saving keeps the copy saved before."""
    return atomic_write_json(Path(out_dir) / "results.json", result, indent=1, default=float)


def load_result(path: str | Path) -> tuple[dict, Path]:
    """results.json's contents and its folder, from the file or the run folder holding it. Values it lacks
    (from another version, or edited) are filled in as missing (``fill_absent``), named under
    ``"absent_fields"``; what the report cannot do without is refused (``check_result``)."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no results.json (give a comparison run's folder or its results.json)")
    result = read_json(file, "results.json", dict)
    check_result(result, file)
    result["absent_fields"] = fill_absent(result)
    result["cost_curve"] = {int(n): t for n, t in result["cost_curve"].items()}
    result["cost_curves_after_drafting"] = {name: {int(n): t for n, t in c.items()} for name, c in
                                            (result.get("cost_curves_after_drafting") or {}).items()}
    return result, file.parent


RECORD_VALUES = ("tau", "speedup", "tokens_per_s", "predicted_tau", "predicted_speedup", "target_passes",
                 "new_tokens", "depth")  # what a configuration measured: shown as – when a results.json lacks it
RECORD_NAMES = ("drafter", "tree", "nodes")  # what names a configuration: required (check_result)
RECORD_EXTRAS = ("predicted_speedup_lo", "predicted_speedup_hi")  # newer fields: numbers where present, never filled
PROMPT_VALUES = {"category": DEFAULT_CATEGORY, "id": None, "turn": None, "prompt_tokens": None,
                 "max_new_tokens": None, "answer_tokens": None}


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def fill_absent(result: dict) -> list[str]:
    """Fill in what a results.json lacks: a configuration's values as None (shown as –), a prompt's category as
    ``all`` (the workload's category of a row without one). Returns what was filled in, for results.md."""
    notes = []
    for key in RECORD_VALUES:
        lacking = sum(key not in rec for rec in result["records"])
        if lacking:
            notes.append(f"'{key}' in {lacking} of {len(result['records'])} configurations")
        for rec in result["records"]:
            rec.setdefault(key, None)
    # a pass's time split lacking a part (or holding a non-number) once raised a KeyError in the report: none shown
    split = [rec for rec in result["records"] if rec.get("step_ms") is not None and not (
        isinstance(rec["step_ms"], dict) and all(number(rec["step_ms"].get(part)) for part in PARTS))]
    if split:
        notes.append(f"a number for each of {', '.join(PARTS)} in 'step_ms' of {len(split)} configurations")
        for rec in split:
            rec["step_ms"] = None
    info = result.get("prompt_info") or []
    for key, default in PROMPT_VALUES.items():
        lacking = sum(p.get(key) is None for p in info)
        if lacking and default is not None:
            notes.append(f"'{key}' in {lacking} of {len(info)} prompts (counted in {default!r})")
        for p in info:
            p[key] = default if p.get(key) is None else p[key]
    return notes


def check_result(result: dict, file) -> None:
    """What rendering relies on in a results.json, checked before anything is rendered: a ValueError naming
    the file and the first thing that does not hold."""
    def bad(problem: str):
        return ValueError(f"results.json {file}: {problem}; not a comparison's results.json, or edited since")

    records, curve, settings = result.get("records"), result.get("cost_curve"), result.get("settings", {})
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) and "config" in r for r in records):
        raise bad("'records' must be a non-empty list of configurations (each with a 'config')")
    if not isinstance(curve, dict) or not curve:
        raise bad("'cost_curve' must map tree sizes to seconds")
    if not isinstance(settings, dict):
        raise bad("'settings' must be a JSON object")
    for i, rec in enumerate(records):
        absent = [k for k in RECORD_NAMES if k not in rec]
        if absent:
            raise bad(f"record {i} ({rec['config']!r}) has no {', '.join(map(repr, absent))}")
        wrong = next((k for k in (*RECORD_VALUES, *RECORD_EXTRAS) if rec.get(k) is not None and not number(rec[k])),
                     None)
        if wrong:  # a string predicted_speedup was a TypeError in scripts/prediction_error.py
            raise bad(f"record {i} ({rec['config']!r}) has {wrong} = {rec[wrong]!r}, not a number or null")
    info = result.get("prompt_info")
    if info is not None and not (isinstance(info, list) and all(isinstance(p, dict) for p in info)):
        raise bad("'prompt_info' must be a list of prompts (JSON objects)")
    runs_of = {r["config"]: (r.get("runs") or {}).get("speedup") for r in records}
    prompt_of_run = result.get("prompt_of_run")
    planned = int(settings.get("prompts", 0) or 0) * int(settings.get("repeats", 1) or 1)
    if prompt_of_run is not None and result.get("complete", True) and planned and len(prompt_of_run) != planned:
        raise bad(f"settings give {planned} prompt runs (prompts × repeats) but prompt_of_run lists "
                  f"{len(prompt_of_run)}")
    if info is not None and prompt_of_run is not None and any(
            not isinstance(p, int) or not 0 <= p < len(info) for p in prompt_of_run):
        raise bad(f"'prompt_of_run' must hold indices of prompt_info's {len(info)} prompts")
    cut = partial(result)
    expected = None if prompt_of_run is None else len(prompt_of_run[: cut[0] if cut else None])
    for config, runs in runs_of.items():
        if runs and expected is not None and len(runs) != expected:
            raise bad(f"configuration {config!r} holds {len(runs)} prompt runs, prompt_of_run {expected}")
