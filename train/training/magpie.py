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

**Task kinds** (``tasks``, train/training/magpie_tasks.py): a bare prefix gives what the model most often
sees, mostly chit-chat and advice. Given task kinds, batch b asks for kind ``tasks[b % len(tasks)]``: its
system prompt describes that kind of user (Magpie's task-conditioned system prompts), and each row starts the
request with one of the kind's openers ("Translate the following sentence into French:"), which a 135M
model needs to stay on the task. The row keeps the kind as its ``category``.

**Follow-ups** (``follow_up``): the model, shown a whole answered conversation and the next user header, writes
the user's second turn the same way; the regeneration job answers it (a multi-turn conversation).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tqdm import tqdm

from treespec.train.training import config_checks
from treespec.train.training.chat import ChatRenderer
from treespec.train.training.magpie_tasks import TASKS, opener

MARK = "\x00request\x00"  # a user message no template changes: where the request will go


def user_prefix(renderer: ChatRenderer, system_prompt: str | None = None, before: list[dict] = ()) -> str:
    """The rendered text before a user turn's content: the template's system turn (its default one, or
    ``system_prompt``), the messages ``before`` it (a follow-up's conversation so far) and the user header."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(before) + [
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
    for n, line in enumerate(Path(path).read_text(encoding="utf-8-sig").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"exclude file {path}, line {n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):  # was an AttributeError, naming neither the file nor the line
            raise ValueError(f"exclude file {path}, line {n}: not a JSON object of turns, messages or a prompt "
                             f"({line[:80]})")
        texts = row.get("turns") or [m.get("content") for m in row.get("messages") or []
                                     if isinstance(m, dict) and m.get("role") == "user"]
        texts = texts or [row.get("prompt")]
        keys |= {request_key(t) for t in texts if isinstance(t, str) and t.strip()}
    return keys


def _written(out: Path) -> tuple[list[dict], int]:
    """(rows already in ``out``, the batch to resume at: the last one written, redone); a last line cut by a
    kill is removed from the file."""
    if not out.is_file():
        return [], 0
    # split at "\n" only: str.splitlines() also splits at U+2028 and the like, which json.dumps(ensure_ascii=False)
    # writes raw inside a string (a request with one made the resume fail)
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        out.write_bytes(data[: data.rfind(b"\n") + 1])
    rows = []
    for n, line in enumerate(out.read_text(encoding="utf-8").split("\n"), 1):
        try:  # a corrupt line was a bare JSONDecodeError or KeyError, naming neither the file nor the line
            row = json.loads(line) if line.strip() else None
            if row is not None and not (isinstance(row["batch"], int) and isinstance(row["messages"][0]["content"],
                                                                                     str)):
                raise TypeError
            rows += [row] if row is not None else []
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(f"requests file {out}, line {n}: not a request this job wrote ({line[:80]!r}); remove "
                             "the line, or the file to start again") from None
    return rows, max((r["batch"] for r in rows), default=0)


def why_dropped(text: str, seen: set[str], exclude: set[str], min_chars: int, max_chars: int) -> str | None:
    """Why a sampled request is not kept (a key of the counts' ``dropped``), or None to keep it."""
    key = request_key(text)
    return ("duplicate" if key in seen else "too short" if len(text) < min_chars else
            "too long" if len(text) > max_chars else "excluded" if key in exclude else None)


def generate_requests(backend, renderer: ChatRenderer, out, *, count: int, batch_size: int = 16,
                      temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 128,
                      min_chars: int = 16, max_chars: int = 1000, exclude: set[str] = frozenset(),
                      system_prompt: str | None = None, tasks: list[str] | None = None, seed: int = 0,
                      max_batches: int | None = None, progress: bool = True) -> dict:
    """Write ``count`` new requests to ``out`` (module docstring) with ``backend`` (train/training/completions.py);
    resumes a file already there. With ``tasks``, batch b asks for kind ``tasks[b % len(tasks)]``. Stops early,
    saying so in the counts, after ``max_batches`` batches (default: enough for ``count`` if a quarter of the
    samples were kept), so a model that repeats itself cannot loop forever. Returns the counts."""
    config_checks.integer(batch_size, "data.magpie.batch_size")  # 0 was a ZeroDivisionError
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, batch = _written(out)
    seen = {request_key(r["messages"][0]["content"]) for r in rows}
    max_batches = max_batches or max(4, -(-4 * count // batch_size))
    dropped = {"duplicate": 0, "too short": 0, "too long": 0, "excluded": 0}
    bar = tqdm(total=count, initial=min(len(rows), count), disable=not progress, desc="magpie requests",
               dynamic_ncols=True)
    with open(out, "a", encoding="utf-8") as f:
        while len(rows) < count and batch < max_batches:
            task = tasks[batch % len(tasks)] if tasks else None
            starts = [opener(task, batch * batch_size + i) for i in range(batch_size)]
            prefix = user_prefix(renderer, TASKS[task].system if task else system_prompt)
            sampled = backend.complete([prefix + start for start in starts], max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed + 1009 * batch)
            lines = []
            for start, completion in zip(starts, sampled, strict=True):
                text = (start + completion.text).strip()
                why = why_dropped(text, seen, exclude, min_chars, max_chars)
                if why is not None:
                    dropped[why] += 1
                    continue
                if len(rows) < count:
                    seen.add(request_key(text))
                    rows.append({"row": len(rows), "batch": batch, **({"category": task} if task else {}),
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


class FollowUps:
    """Second user turns, Magpie-style (module docstring): the share ``fraction`` of conversations chosen by their
    row number (so a resumed job chooses alike) gets one, sampled at ``temperature`` with seed ``seed + row``,
    kept under the same rules as first requests (length bounds, never an excluded question)."""

    def __init__(self, backend, renderer: ChatRenderer, *, fraction: float, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 128, min_chars: int = 16, max_chars: int = 1000,
                 exclude: set[str] = frozenset(), system_prompt: str | None = None, seed: int = 0):
        self.backend, self.renderer, self.fraction = backend, renderer, fraction
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}
        self.min_chars, self.max_chars, self.exclude = min_chars, max_chars, exclude
        self.system_prompt, self.seed = system_prompt, seed
        self.dropped = {"duplicate": 0, "too short": 0, "too long": 0, "excluded": 0}

    def chosen(self, row: int) -> bool:
        """Whether conversation ``row`` gets a follow-up: a fixed pseudo-random share of the rows."""
        return (row * 2654435761 + self.seed) % 1000 < self.fraction * 1000

    def ask(self, rows: list[int], conversations: list[list[dict]]) -> list[str | None]:
        """The follow-up request for each chosen conversation (its messages so far), or None where the row was
        not chosen or the sample was dropped."""
        asked = [i for i, row in enumerate(rows) if self.chosen(row)]
        if not asked:
            return [None] * len(rows)
        so_far = [[m for m in conversations[i] if m["role"] != "system"] for i in asked]
        prompts = [user_prefix(self.renderer, self.system_prompt, messages) for messages in so_far]
        sampled = self.backend.complete(prompts, seed=self.seed + 7919 * rows[asked[0]], **self.sampling)
        out: list[str | None] = [None] * len(rows)
        for i, completion in zip(asked, sampled, strict=True):
            seen = {request_key(m["content"]) for m in conversations[i] if m["role"] == "user"}
            text = completion.text.strip()
            why = why_dropped(text, seen, self.exclude, self.min_chars, self.max_chars)
            if why is None:
                out[i] = text
            else:
                self.dropped[why] += 1
        return out
