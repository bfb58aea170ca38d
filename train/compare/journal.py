"""The comparison's journal: every (prompt run, configuration) measurement is durable as soon as it finishes, so a
killed comparison loses at most the generation in flight, and ``resume=true`` continues from the rest.

``measurements.jsonl`` in the run folder, one JSON object a line, each carrying the sha1 of its own content:

- the header (line 1, written whole or not at all): ``key``, the settings that decide what is measured (the
  target's and drafters' weights, the prompts and their budgets, sampling, seed, trees and rules asked for, and
  the job's config), and ``setup``, what was measured before the first run: the cost curves and every
  configuration's resolved tree and prediction. A resumed run verifies the same trees beside the same
  predictions, whatever its own timing of the curves would say (``tree=auto`` chooses from the curves).
- ``{"kind": "run", "pass", "run", "prompt", "config", "measured"}`` per run: the pass (``main``, or ``peers``
  beside transformers), the prompt run's index in measuring order (prompts × repeats), its prompt, the
  configuration and its ``bench.Measured``;
- ``{"kind": "resume"}`` where a later process took over (results.json counts the sessions).

A line is written with one ``write`` and an fsync, so a kill leaves at most a torn last line: a resume drops it,
says so, and measures that run again. Any other line that does not check out is corruption or an edit, refused
naming the file and the line. A resume whose settings differ from the header's is refused naming each one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from treespec.io import atomic_write_text, remove_stale_temps
from treespec.planning.bench import Measured
from treespec.train.compare.stamp import flatten

JOURNAL = "measurements.jsonl"
FORMAT = 1


def _plain(obj):
    """``obj`` as it reads back from JSON (tuples as lists, number types as floats): what a key is compared as."""
    return json.loads(json.dumps(obj, default=float))


def _digest(obj: dict) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _line(obj: dict) -> str:
    obj = _plain(obj)
    return json.dumps({**obj, "sha1": _digest(obj)}, separators=(",", ":")) + "\n"


def _short(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _checked(text: str) -> dict | None:
    """The object a line holds, or None when it is not one this module wrote whole."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or "sha1" not in obj:
        return None
    sha1 = obj.pop("sha1")
    return obj if sha1 == _digest(obj) else None


def differences(saved: dict, now: dict) -> dict[str, tuple[str, str]]:
    """{dotted setting: (saved, now)} where two keys differ (a setting one of them lacks shows as "absent")."""
    a, b = flatten(saved), flatten(now)
    return {k: (a.get(k, "absent"), b.get(k, "absent")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


class Journal:
    """One run folder's journal: what an earlier process measured (``runs``) and where new runs are appended."""

    def __init__(self, out_dir):
        self.path = Path(out_dir) / JOURNAL
        self.header: dict | None = None
        self.runs: dict[tuple[str, int, str], tuple[int, Measured]] = {}  # (pass, run, config) → (prompt, measured)
        self.sessions = 1
        self.dropped = 0  # a torn last line dropped on reading

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> Journal:
        """Read the file: the header, every run; a torn last line is cut off the file (it is measured again)."""
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        good, offset = [], 0
        for number, line in enumerate(lines, start=1):
            last = all(not rest.strip() for rest in lines[number:])
            if not line.strip():
                offset += len(line) + 1
                continue
            obj = _checked(line.decode("utf-8", "replace"))
            if obj is None or (last and number == len(lines)):  # no newline after it: torn while being written
                if not last:
                    raise ValueError(f"{self.path} line {number} is corrupt (not the JSON and sha1 it was written "
                                     "with) and runs follow it: the journal was edited or damaged; delete the run "
                                     "folder to measure afresh")
                self.dropped = 1
                break
            good.append((number, obj))
            offset += len(line) + 1
        if self.dropped:
            with open(self.path, "r+b") as f:  # appends continue after the last whole line
                f.truncate(offset)
                os.fsync(f.fileno())
        if not good or good[0][1].get("kind") != "header":
            raise ValueError(f"{self.path} has no header line: not a comparison's journal, or damaged; delete it "
                             "(or the run folder) to measure afresh")
        self.header = good[0][1]
        if self.header.get("format") != FORMAT:
            raise ValueError(f"{self.path}: journal format {self.header.get('format')!r}, this treespec reads "
                             f"{FORMAT}: finish it with the treespec that began it, or measure afresh")
        for number, obj in good[1:]:
            if obj.get("kind") == "resume":
                self.sessions += 1
                continue
            try:
                key = (str(obj["pass"]), int(obj["run"]), str(obj["config"]))
                measured = Measured(**obj["measured"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{self.path} line {number}: not a measured run ({err!r})") from None
            if key in self.runs:
                raise ValueError(f"{self.path} line {number}: {key} is journaled twice: edited or damaged")
            self.runs[key] = (int(obj.get("prompt", -1)), measured)
        return self

    def check(self, key: dict, only: str | None = None) -> None:
        """Refuse to continue under other settings, naming each that differs (``only``: compare that section)."""
        saved, key = self.header["key"], _plain(key)
        saved, now = (saved.get(only), key.get(only)) if only else (
            {k: v for k, v in saved.items() if k != "config"}, {k: v for k, v in key.items() if k != "config"})
        diff = differences(saved or {}, now or {})
        if diff:
            prefix = f"{only}." if only else ""
            listed = "; ".join(f"{prefix}{k}: measured with {_short(a)}, now {_short(b)}"
                               for k, (a, b) in list(diff.items())[:8])
            more = f" (and {len(diff) - 8} more)" if len(diff) > 8 else ""
            raise ValueError(f"resume: {self.path} was measured with other settings: {listed}{more}. resume=true "
                             "continues a run with the settings it began with: set these back, or measure afresh "
                             "in another run_dir")

    def start(self, key: dict, setup: dict) -> None:
        """A fresh journal: the header, written whole (atomically)."""
        self.header = {"kind": "header", "format": FORMAT, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                       "key": key, "setup": setup}
        atomic_write_text(self.path, _line(self.header))

    def resumed(self) -> None:
        """Mark where this process took over."""
        self._append({"kind": "resume", "started": time.strftime("%Y-%m-%d %H:%M:%S %z")})

    def record(self, pass_: str, run: int, prompt: int, config: str, measured: Measured) -> None:
        self._append({"kind": "run", "pass": pass_, "run": run, "prompt": prompt, "config": config,
                      "measured": dataclasses.asdict(measured)})
        self.runs[(pass_, run, config)] = (prompt, measured)

    def restored(self, pass_: str, order: list[int]) -> dict[tuple[int, str], Measured]:
        """{(run, config): measured} of one pass; ``order``: the prompt of every run, as this process measures
        them (a journaled run of another prompt means the journal does not belong to these settings)."""
        out = {}
        for (p, run, config), (prompt, measured) in self.runs.items():
            if p != pass_:
                continue
            if not 0 <= run < len(order) or order[run] != prompt:
                raise ValueError(f"{self.path}: run {run} of the {pass_} pass ({config}) was prompt {prompt}, this "
                                 f"run measures {order[run] if 0 <= run < len(order) else 'no such run'} there: "
                                 "edited, or written by another version")
            out[(run, config)] = measured
        return out

    def _append(self, obj: dict) -> None:
        with open(self.path, "a") as f:  # one write of one whole line, then durable
            f.write(_line(obj))
            f.flush()
            os.fsync(f.fileno())


def _sizes(curve: dict) -> dict[int, float]:
    return {int(n): float(t) for n, t in curve.items()}


def precheck(out_dir, config: dict | None, resume: bool) -> Journal | None:
    """What a job can refuse before loading any model: measurements in ``out_dir`` without ``resume``, or a config
    other than the one they were measured with (``open_journal`` checks the rest once the models are loaded).
    Returns the journal read, or None where there is none."""
    journal = Journal(out_dir)
    if not journal.exists():
        return None
    if not resume:
        raise ValueError(f"run_dir {out_dir} already holds a comparison's measurements ({journal.path}): "
                         "resume=true continues it; another run_dir measures afresh")
    journal.read().check({"config": config}, only="config")
    return journal


def open_journal(out_dir, key: dict, resume: bool, log=print) -> tuple[Journal, dict | None]:
    """(the run folder's journal, the setup to continue from or None to measure one). A folder that already holds
    measurements is continued only with ``resume`` and the same settings (``Journal.check``), else refused."""
    journal = precheck(out_dir, key.get("config"), resume)
    if journal is None:
        if resume:
            log(f"resume=true but no measurements in {out_dir} ({JOURNAL}): measuring afresh")
        return Journal(out_dir), None
    journal.check(key)
    remove_stale_temps(out_dir)  # what the killed process was writing atomically (results.json, a tree)
    if journal.dropped:
        log(f"resume: {journal.path}'s last line was cut off by the kill: that run is measured again")
    log(f"resume: {len(journal.runs)} runs kept from {journal.sessions} earlier session"
        f"{'s' if journal.sessions > 1 else ''}; measuring the rest")
    journal.resumed()
    journal.sessions += 1
    setup = dict(journal.header["setup"])
    setup["cost_curve"], setup["prefill_curve"] = _sizes(setup["cost_curve"]), _sizes(setup["prefill_curve"])
    setup["cost_curves_after_drafting"] = {name: _sizes(c) for name, c in setup["cost_curves_after_drafting"].items()}
    return journal, setup
