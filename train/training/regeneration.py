"""The regeneration job (``scripts/regenerate.py``): a conversation file's assistant turns replaced by the
target's own responses, so a drafter learns what the target says rather than what another model wrote.

Turns are generated one at a time, each seeing the regenerated turns before it, a batch of conversations at
a time (left-padded); the output is OpenAI-style JSONL rows ``{"row", "messages"}`` (plus the source row's ``id`` and
``category``) that ``data=chat`` reads
(train/training/chat.py). Resumable: rows already in the output file are skipped, and a last line cut by a kill is
removed. Under torchrun each rank writes its share of the rows; rank 0 merges them in row order. A conversation
that ends on a user turn gets the target's answer appended.

``data.chat.source=magpie`` needs no conversations: the target first writes its own requests
(train/training/magpie.py, ``data.magpie``) into ``<out>.requests.jsonl``, then answers them; with
``data.magpie.second_turns`` a share of them gets a follow-up request, written by the target too, and its answer.

Answers come from a backend (train/training/completions.py): treespec's own batched decoding by default, or
with ``data.regenerate.backend=server`` an OpenAI-compatible server already serving the target
(train/training/server_backend.py; only the tokenizer is loaded here). A server's request still unanswered after its
retries stops the job naming its row; the batches before it are written, and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from treespec.io import atomic_write, single_run
from treespec.reference import load_model, load_tokenizer
from treespec.train.training import config_checks, distributed, magpie, server_backend
from treespec.train.training.chat import ChatRenderer, chat_settings
from treespec.train.training.completions import EmbeddedBackend
from treespec.train.training.conversations import BadRow, load_rows, normalize
from treespec.train.training.magpie_tasks import check_tasks

KEPT_FIELDS = ("id", "category")  # carried from a source row to its regenerated row (workloads read them)


def _done_rows(out: Path) -> set[int]:
    """Rows already in a regeneration output; a last line cut by a kill is removed from the file."""
    if not out.is_file():
        return set()
    # split at "\n" only (magpie._written says why): a row holding U+2028 was skipped, so answered twice
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        out.write_bytes(data)
    done = set()
    for line in data.decode("utf-8", errors="replace").split("\n"):
        try:
            done.add(int(json.loads(line)["row"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


def _pending(settings: dict, done: set[int], cache_dir, rank: int, world_size: int) -> tuple[list, Counter]:
    """The source's rows this rank still has to answer, as (row, messages ending in the assistant turn to write,
    kept fields), and the bad rows counted by reason."""
    rows = load_rows(settings["source"], split=settings["split"] or "train", cache_dir=cache_dir)
    todo, bad = [], Counter()
    limit = settings["max_conversations"]
    for i, row in enumerate(rows):
        if limit and i >= limit:
            break
        if i % world_size != rank or i in done:
            continue
        try:
            messages = normalize(row, settings["system_prompt"], answered=False)
        except BadRow as err:
            bad[err.reason] += 1
            continue
        if messages[-1]["role"] == "user":  # a prompt without its answer: the target writes it
            messages.append({"role": "assistant", "content": ""})
        todo.append((i, messages, {k: row[k] for k in KEPT_FIELDS if row.get(k) is not None}))
    return todo, bad


def regenerate(backend, chat_cfg, out: str | os.PathLike, *, batch_size: int = 8, max_new_tokens: int = 512,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, follow_ups: magpie.FollowUps | None = None,
               cache_dir: str | os.PathLike | None = None, rank: int = 0, world_size: int = 1,
               progress: bool = True) -> dict:
    """Replace every assistant turn of ``data.chat.source`` with the target's own response, generated turn
    by turn (each sees the regenerated turns before it), ``batch_size`` conversations at a time, by ``backend``
    (train/training/completions.py). ``follow_ups`` (magpie.FollowUps): after the last turn, the chosen
    conversations get a user follow-up written by the target, and its answer.
    Writes OpenAI-style rows ``{"row", "messages"}`` to ``out`` (JSONL), with the source row's ``id`` and
    ``category`` when it has them (a workload read from ``out`` keeps its categories), flushed after every batch;
    a rerun skips the rows already there. Under torchrun rank r takes rows r, r + W, ... into ``out`` + ``.rank<r>``.
    Returns counts (written, skipped as bad, already done, turns, assistant tokens)."""
    config_checks.integer(batch_size, "data.regenerate.batch_size")  # 0 was range()'s own error
    settings = chat_settings(chat_cfg)
    renderer = ChatRenderer(backend.tokenizer, settings["template"])
    out = Path(out) if world_size == 1 else Path(f"{out}.rank{rank}")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_rows(out)
    todo, bad = _pending(settings, done, cache_dir, rank, world_size)
    bar = tqdm(total=len(todo), disable=not progress, desc="regenerating", unit="conv", dynamic_ncols=True)
    turns = empty = tokens = 0

    def answer(chunk_rows: list[int], convs: list[list[dict]], where: list[tuple[int, int]], turn: int) -> None:
        """The target's answer to each (conversation, assistant message index) in ``where``, in place."""
        nonlocal turns, empty, tokens
        prompts = [renderer.render(convs[c][:j], add_generation_prompt=True) for c, j in where]
        # seeded by row, not by batch position: a resumed run draws alike
        try:
            answers = backend.complete(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, seed=seed + chunk_rows[0] * 1009 + turn)
        except server_backend.CompletionError as err:  # named by row; the batches before are written
            raise err.named([f"row {chunk_rows[c]} (turn {turn + 1})" for c, _ in where]) from None
        for (c, j), completion in zip(where, answers, strict=True):
            text = completion.text.strip()
            convs[c][j] = {"role": "assistant", "content": text}
            turns, empty, tokens = turns + 1, empty + (not text), tokens + completion.tokens

    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), batch_size):
            chunk = todo[b : b + batch_size]
            chunk_rows = [i for i, _, _ in chunk]
            convs = [[dict(m) for m in msgs] for _, msgs, _ in chunk]
            n_turns = max(sum(m["role"] == "assistant" for m in msgs) for msgs in convs)
            for turn in range(n_turns):
                where = []  # (conversation, index of its turn-th assistant message)
                for c, msgs in enumerate(convs):
                    idx = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
                    if turn < len(idx):
                        where.append((c, idx[turn]))
                answer(chunk_rows, convs, where, turn)
            if follow_ups is not None:
                asked = follow_ups.ask(chunk_rows, convs)
                where = []
                for c, request in enumerate(asked):
                    if request is not None:
                        convs[c] += [{"role": "user", "content": request}, {"role": "assistant", "content": ""}]
                        where.append((c, len(convs[c]) - 1))
                if where:
                    answer(chunk_rows, convs, where, n_turns)
            # one write a batch: a kill loses at most the batch in flight, and a rerun redoes it whole
            f.write("".join(json.dumps({"row": i, **kept, "messages": msgs}, ensure_ascii=False) + "\n"
                            for (i, _, kept), msgs in zip(chunk, convs, strict=True)))
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(chunk))
            bar.set_postfix(tokens=tokens, refresh=False)
    bar.close()
    return {"written": len(todo), "bad_rows": dict(bad), "already_done": len(done), "out": str(out),
            "turns": turns, "empty_turns": empty, "assistant_tokens": tokens,
            **({"follow_ups_dropped": follow_ups.dropped} if follow_ups is not None else {})}


def check_responses(counts: dict, template) -> None:
    """A regeneration whose every response is empty failed, whatever it wrote: the target ended each one at
    once (end of text straight after the assistant header), so there is nothing to train on."""
    if counts["turns"] and counts["empty_turns"] == counts["turns"]:
        used = template or "the tokenizer's own"
        raise ValueError(f"regeneration failed: all {counts['turns']} regenerated assistant turns are empty (the "
                         "target emitted end of text straight after the assistant header); check that "
                         f"data.chat.template ({used}) is the target's chat format and that the target answers chats; "
                         f"{counts['out']} holds the empty rows: delete it before rerunning")


def magpie_requests(cfg, backend, ctx) -> str:
    """``data.chat.source=magpie``: the target's own requests (train/training/magpie.py), written once by rank 0
    to ``<data.regenerate.out>.requests.jsonl`` (resumable) → that file, the source to answer."""
    m, chat = cfg.data.magpie, cfg.data.chat
    out = f"{cfg.data.regenerate.out}.requests.jsonl"
    if ctx.is_main:
        renderer = ChatRenderer(backend.tokenizer, chat_settings(chat)["template"])
        counts = magpie.generate_requests(
            backend, renderer, out, count=m.conversations, batch_size=m.batch_size,
            temperature=m.temperature, top_p=m.top_p, max_new_tokens=m.max_new_tokens, min_chars=m.min_chars,
            max_chars=m.max_chars, exclude=excluded(m), system_prompt=chat.get("system_prompt"),
            tasks=check_tasks(m.get("tasks")), seed=cfg.seed, progress=True)
        print(f"magpie requests: {counts}")
    distributed.barrier(ctx)
    return out


def exclude_files(m) -> list[str]:
    """``data.magpie.exclude``: one file or a list of them."""
    files = m.get("exclude") or []
    return [files] if isinstance(files, str) else list(files)


def excluded(m) -> set[str]:
    """The request keys of every ``data.magpie.exclude`` file (a benchmark's questions, conversations already
    had), never kept as requests."""
    return set().union(*(magpie.excluded_texts(path) for path in exclude_files(m)))


def follow_ups(cfg, backend) -> magpie.FollowUps | None:
    """``data.magpie.second_turns``: the share of self-written conversations that get a follow-up request."""
    m = cfg.data.magpie
    if cfg.data.chat.source != "magpie" or not m.get("second_turns"):
        return None
    renderer = ChatRenderer(backend.tokenizer, chat_settings(cfg.data.chat)["template"])
    return magpie.FollowUps(backend, renderer, fraction=m.second_turns, temperature=m.temperature, top_p=m.top_p,
                            max_new_tokens=m.max_new_tokens, min_chars=m.min_chars, max_chars=m.max_chars,
                            exclude=excluded(m), system_prompt=cfg.data.chat.get("system_prompt"), seed=cfg.seed)


def check_magpie(m) -> None:
    for key in ("conversations", "batch_size", "max_new_tokens", "min_chars", "max_chars"):
        config_checks.integer(m.get(key), f"data.magpie.{key}")
    config_checks.number(m.get("temperature"), "data.magpie.temperature", 0, low_open=True)
    config_checks.number(m.get("top_p"), "data.magpie.top_p", 0, 1, low_open=True)
    if m.min_chars > m.max_chars:
        raise ValueError(f"data.magpie.min_chars={m.min_chars} exceeds data.magpie.max_chars={m.max_chars}")
    for path in exclude_files(m):
        if not Path(path).is_file():
            raise ValueError(f"data.magpie.exclude={path}: no such file (a JSONL of questions never to train on)")
    check_tasks(m.get("tasks"))
    config_checks.number(m.get("second_turns", 0), "data.magpie.second_turns", 0, 1)


def run(cfg) -> dict:
    """The ``scripts/regenerate.py`` job (train_heads' config: ``target``, ``data=chat``, ``data.regenerate``).
    Under torchrun each rank writes its share; rank 0 then merges them, in row order, into
    ``data.regenerate.out``."""
    r = cfg.data.get("regenerate") or {}
    if cfg.data.get("chat") is None or not cfg.data.chat.get("source"):
        raise ValueError("regenerate needs data=chat and data.chat.source=<conversations, or magpie>")
    if not r.get("out"):
        raise ValueError("regenerate needs data.regenerate.out=<the JSONL file to write>")
    self_written = cfg.data.chat.source == "magpie"
    if self_written:
        check_magpie(cfg.data.magpie)
    for key in ("batch_size", "max_new_tokens"):
        config_checks.integer(r.get(key, 1), f"data.regenerate.{key}")
    config_checks.number(r.get("temperature", 0.0), "data.regenerate.temperature", 0)
    config_checks.number(r.get("top_p", 1.0), "data.regenerate.top_p", 0, 1, low_open=True)
    server = server_backend.check_backend(r)  # None: the embedded backend
    config_checks.integer(cfg.trainer.get("threads"), "trainer.threads", optional=True)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    config_checks.choice(cfg.trainer.get("precision", "fp32"), "trainer.precision", config_checks.PRECISIONS)
    # bf16 autocast roughly halves generation time on CPUs with AVX512-BF16/AMX; the answers are then the
    # target's greedy ones under bf16 matmuls, which can differ from fp32's after a near-tie
    bf16 = cfg.trainer.get("precision", "fp32") == "bf16"
    with distributed.session("ddp", cfg.trainer.get("dist_timeout_s")) as ctx, \
            torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16), \
            (single_run(f"{r.out}.lock", f"data.regenerate.out={r.out}") if ctx.is_main else contextlib.nullcontext()):
        chat = cfg.data.chat
        if server is None:
            target, tokenizer = load_model(cfg.target)
            target.to(ctx.device)
        else:  # the server holds the weights
            tokenizer = load_tokenizer(cfg.target)
        end_marker = ChatRenderer(tokenizer, chat_settings(chat)["template"]).end_marker
        backend = (EmbeddedBackend(target, tokenizer, end_marker) if server is None else
                   server_backend.ServerBackend.from_settings(server, tokenizer, end_marker))
        if self_written:
            chat = OmegaConf.merge(chat, {"source": magpie_requests(cfg, backend, ctx)})
        with distributed.rank0_first(ctx):  # rank 0 converts the source with datasets first (its cache)
            load_rows(chat.source, split=chat.split or "train", cache_dir=cfg.data.cache_dir)
        counts = regenerate(backend, chat, r.out, batch_size=r.get("batch_size", 8),
                            max_new_tokens=r.get("max_new_tokens", 512), temperature=r.get("temperature", 0.0),
                            top_p=r.get("top_p", 1.0), seed=cfg.seed, follow_ups=follow_ups(cfg, backend),
                            cache_dir=cfg.data.cache_dir, rank=ctx.rank, world_size=ctx.world_size,
                            progress=ctx.is_main)
        check_responses(counts, cfg.data.chat.get("template"))
        distributed.barrier(ctx)
        if ctx.distributed and ctx.is_main:
            rows = []
            for rank in range(ctx.world_size):
                part = Path(f"{r.out}.rank{rank}")
                rows += [json.loads(line) for line in part.read_text(encoding="utf-8").split("\n") if line.strip()]
            rows.sort(key=lambda row: row["row"])
            atomic_write(Path(r.out), lambda tmp: tmp.write_text(
                "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"))
            counts["out"] = str(r.out)
        if ctx.is_main:
            print(f"regenerated responses: {counts}")
        return counts
