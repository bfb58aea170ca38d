"""Self-generated requests, Magpie-style (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing"): an aligned chat model given only its template's user-turn prefix (the
system turn its template inserts, then the user header) writes what a user would ask, because that is what it
was tuned to see there. The regeneration job (train/training/regeneration.py) then has the target answer each
request, so a drafter trains on the target's own conversations without any data set
(``data.chat.source=magpie``).

Requests are sampled ``batch_size`` at a time from the same prefix, cut at the template's end-of-turn marker,
then kept only when they are new (compared lower-cased with whitespace collapsed), within the length bounds, and
not one of the ``exclude`` texts (a benchmark's questions must never become training data: pass their file).
Output: OpenAI-style JSONL rows ``{"row", "batch", "messages": [{"role": "user", "content"}]}``, flushed after
every batch. Batch b samples with seed ``seed + 1009·b``, so a rerun after a kill redoes the last batch written
and carries on: the file equals an uninterrupted run's (on the same machine and torch build).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from tqdm import tqdm

from treespec.train.training.chat import ChatRenderer

MARK = "\x00request\x00"  # a user message no template changes: where the request will go


def user_prefix(renderer: ChatRenderer, system_prompt: str | None = None) -> str:
    """The rendered text before a user turn's content: the template's system turn (its default one, or
    ``system_prompt``) and the user header."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": MARK}]
    text = renderer.render(messages)
    if MARK not in text:
        raise ValueError("the chat template drops the user's message: it cannot prompt for a request")
    return text[: text.index(MARK)]


def request_key(text: str) -> str:
    """What counts as the same request: lower case, whitespace collapsed."""
    return re.sub(r"\s+", " ", text.strip().lower())


def excluded_texts(path) -> set[str]:
    """Request keys of every question in a JSONL file of Spec-Bench / MT-bench rows (``turns``), OpenAI rows
    (``messages``: the user turns) or ``prompt`` rows: texts a training request may never be."""
    keys = set()
    for n, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"exclude file {path}, line {n}: not JSON ({err.msg})") from None
        texts = row.get("turns") or [m.get("content") for m in row.get("messages") or [] if m.get("role") == "user"]
        texts = texts or [row.get("prompt")]
        keys |= {request_key(t) for t in texts if isinstance(t, str) and t.strip()}
    return keys


def _written(out: Path) -> tuple[list[dict], int]:
    """(rows already in ``out``, the batch to resume at: the last one written, redone); a last line cut by a
    kill is removed from the file."""
    if not out.is_file():
        return [], 0
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        out.write_bytes(data[: data.rfind(b"\n") + 1])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows, max((r["batch"] for r in rows), default=0)


@torch.no_grad()
def generate_requests(target, tokenizer, renderer: ChatRenderer, out, *, count: int, batch_size: int = 16,
                      temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 128,
                      min_chars: int = 16, max_chars: int = 1000, exclude: set[str] = frozenset(),
                      system_prompt: str | None = None, seed: int = 0, max_batches: int | None = None,
                      progress: bool = True) -> dict:
    """Write ``count`` new requests to ``out`` (module docstring); resumes a file already there. Stops early,
    saying so in the counts, after ``max_batches`` batches (default: enough for ``count`` if a quarter of the
    samples were kept), so a model that repeats itself cannot loop forever. Returns the counts."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, batch = _written(out)
    seen = {request_key(r["messages"][0]["content"]) for r in rows}
    max_batches = max_batches or max(4, -(-4 * count // batch_size))
    enc = tokenizer([user_prefix(renderer, system_prompt)] * batch_size, return_tensors="pt",
                    add_special_tokens=False)
    enc = {k: v.to(target.device) for k, v in enc.items()}
    stop = [renderer.end_marker] if renderer.end_marker else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dropped = {"duplicate": 0, "too short": 0, "too long": 0, "excluded": 0}
    bar = tqdm(total=count, initial=min(len(rows), count), disable=not progress, desc="magpie requests",
               dynamic_ncols=True)
    with open(out, "a", encoding="utf-8") as f:
        while len(rows) < count and batch < max_batches:
            torch.manual_seed(seed + 1009 * batch)
            gen = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                  top_p=top_p, top_k=0, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                                  stop_strings=stop, tokenizer=tokenizer if stop else None)
            lines = []
            for ids in gen[:, enc["input_ids"].shape[1]:].cpu():
                text = tokenizer.decode(ids, skip_special_tokens=True)
                text = (text.split(renderer.end_marker)[0] if renderer.end_marker else text).strip()
                key = request_key(text)
                why = ("duplicate" if key in seen else "too short" if len(text) < min_chars else
                       "too long" if len(text) > max_chars else "excluded" if key in exclude else None)
                if why is not None:
                    dropped[why] += 1
                    continue
                if len(rows) < count:
                    seen.add(key)
                    rows.append({"row": len(rows), "batch": batch,
                                 "messages": [{"role": "user", "content": text}]})
                    lines.append(json.dumps(rows[-1], ensure_ascii=False) + "\n")
            f.write("".join(lines))  # one write a batch: a kill leaves whole batches (and a cut line, dropped)
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(lines))
            batch += 1
    bar.close()
    return {"requests": len(rows), "asked": count, "batches": batch, "dropped": dropped, "out": str(out),
            "stopped_early": len(rows) < count}
