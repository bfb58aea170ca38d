"""Chat data (``data=chat``): conversations → the target's chat template → token rows whose loss mask
covers the assistant's tokens only.

**Reading.** ``data.chat.source`` is a JSONL/JSON file (or a glob of them), parquet files, a folder of such
files, or a folder written by ``datasets.Dataset.save_to_disk``; all are read with the Hugging Face
``datasets`` library. Rows are ShareGPT ``{"conversations": [{"from", "value"}]}`` or OpenAI
``{"messages": [{"role", "content"}]}`` (content a string or a list of text parts; an assistant message's
``reasoning_content`` is passed to the template as it is).

**Bad rows** are counted and skipped, never a crash later: no conversation, a malformed turn, an unknown
role, an empty turn, no assistant turn, a template error, an assistant turn the template does not render,
more than ``max_length`` tokens (``overlong: skip``; ``truncate`` keeps the first ``max_length`` tokens
when an assistant token remains). ``ChatData.skipped`` and a printed summary say how many, and why.

**Rendering and the loss mask.** A conversation is rendered to text once with the tokenizer's chat
template (or ``data.chat.template``: a .jinja file or ``chatml``) and tokenized with character offsets.
Each assistant turn's span runs from the end of its header (the template's generation prompt, e.g.
``<|im_start|>assistant\\n``, so a reasoning block the template renders before the content is inside it)
through its content and the template's end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ``</s>``: what
the drafter must learn to predict for the target to stop). A token is trained on when its characters
overlap a span. ``reasoning: exclude`` removes ``<think>…</think>`` blocks (``reasoning_tags``) from the mask.

**No attention across conversations.** One conversation per row, right-padded: with causal attention no
real token sees another conversation or the padding, so the forward passes need no mask and the losses
skip padding through the loss mask. Batches are ``permuted_indices`` of (seed, step) as for corpus text,
so exact resume and rank sharding hold.

**Cache.** Tokenized conversations are cached in ``data.cache_dir``, keyed by a sha1 of the source files'
bytes, the tokenizer, the template and these settings.

**Regenerated responses** (``scripts/regenerate.py``, ``regenerate``): the assistant turns replaced by the
target's own, turn by turn, in batches; resumable (rows already in the output file are skipped).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from treespec.io import atomic_write, load_safetensors
from treespec.reference import load_model

from . import distributed
from .data import CollatedBatches

# ShareGPT and OpenAI role names → the roles chat templates know
ROLES = {"user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant", "tool": "tool"}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML}
SENTINEL = "\u00a7\u00a7treespec-probe\u00a7\u00a7"
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CHAT_FILE = "chat.safetensors"


class BadRow(ValueError):
    """A row that cannot be trained on: ``reason`` is its category in the summary, ``detail`` an example."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# -- reading ---------------------------------------------------------------------------------------------
def source_files(source: str | os.PathLike) -> list[Path]:
    """The files a chat source reads: a file, a glob, or every data file in a folder (for a
    ``save_to_disk`` folder, all its files)."""
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if path.is_file():
        return [path]
    files = sorted(Path(p) for p in glob.glob(str(source), recursive=True) if Path(p).is_file())
    if not files:
        raise ValueError(f"chat source {source!r} matches no file or folder")
    return files


def source_digest(source: str | os.PathLike) -> str:
    """sha1 over the bytes (and relative names) of every file ``source`` reads."""
    h = hashlib.sha1()
    for path in source_files(source):
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def load_rows(source: str | os.PathLike, *, split: str = "train", cache_dir: str | os.PathLike | None = None):
    """The rows of a chat source as a ``datasets.Dataset`` (see the module docstring for what it may be)."""
    import datasets  # heavy: imported only by the jobs that read chat data

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source)
    hf_cache = str(Path(cache_dir) / "hf-datasets") if cache_dir else None
    try:
        if path.is_dir() and any((path / n).is_file() for n in ("dataset_dict.json", "state.json")):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"chat source {path} has splits {sorted(ds)}, not data.chat.split={split!r}")
                ds = ds[split]
            return ds
        files = [p for p in source_files(source) if p.suffix in FILE_BUILDERS]
        builders = {FILE_BUILDERS[p.suffix] for p in files}
        if not files or len(builders) != 1:
            raise ValueError(f"chat source {source!r} must be JSON/JSONL or parquet files (one kind), or a "
                             f"datasets folder; found {[p.name for p in source_files(source)][:5]}")
        return datasets.load_dataset(builders.pop(), data_files=[str(p) for p in files], split="train",
                                     cache_dir=hf_cache)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets/arrow raise many kinds; name the source
        raise ValueError(f"cannot read chat source {source!r} with the datasets library: {type(err).__name__}: "
                         f"{err}") from err


def _text(content) -> str | None:
    """A message's content as text: a string, or the text parts of an OpenAI content list."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") not in (None, "text"):
                raise BadRow("non-text content", str(part.get("type")))
        return "".join(parts)
    raise BadRow("malformed turn", f"content of type {type(content).__name__}")


def normalize(row, system_prompt: str | None = None) -> list[dict]:
    """A ShareGPT or OpenAI row → [{"role", "content"(, "reasoning_content")}], or BadRow."""
    if not isinstance(row, dict):
        raise BadRow("malformed row", type(row).__name__)
    turns = row.get("messages")
    if turns is None:
        turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise BadRow("no conversation", "neither 'conversations' nor 'messages' holds turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRow("malformed turn", type(turn).__name__)
        raw_role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        role = ROLES.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            raise BadRow("unknown role", repr(raw_role))
        content = _text(turn.get("content") if turn.get("content") is not None else turn.get("value"))
        reasoning = turn.get("reasoning_content") if role == "assistant" else None
        if not (content and content.strip()) and not (isinstance(reasoning, str) and reasoning.strip()):
            raise BadRow("empty turn", role)
        message = {"role": role, "content": content or ""}
        if isinstance(reasoning, str) and reasoning.strip():
            message["reasoning_content"] = reasoning
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant turn")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


# -- rendering -------------------------------------------------------------------------------------------
def resolve_template(tokenizer, template: str | None) -> str:
    """The chat template's text: ``template`` (a name in TEMPLATES or a file), else the tokenizer's own."""
    if template:
        if template in TEMPLATES:
            return TEMPLATES[template]
        path = Path(template)
        if not path.is_file():
            raise ValueError(f"data.chat.template={template!r} is neither a template name ({', '.join(TEMPLATES)}) "
                             "nor a file")
        return path.read_text()
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default") or next(iter(own.values()), None)
    if not own:
        raise ValueError("the target's tokenizer has no chat template: set data.chat.template to a .jinja file "
                         f"or one of {', '.join(TEMPLATES)}")
    return own


class ChatRenderer:
    """Renders conversations with one chat template and finds the assistant spans (module docstring)."""

    def __init__(self, tokenizer, template: str | None = None, *, reasoning: str = "include",
                 reasoning_tags=("<think>", "</think>")):
        if reasoning not in ("include", "exclude"):
            raise ValueError(f"data.chat.reasoning must be include or exclude, got {reasoning!r}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("chat data needs a fast (Rust) tokenizer for character offsets")
        self.tokenizer, self.template = tokenizer, resolve_template(tokenizer, template)
        self.reasoning, self.tags = reasoning, tuple(reasoning_tags or ())
        user = [{"role": "user", "content": "Hi"}]
        try:
            plain, gen = self.render(user), self.render(user, add_generation_prompt=True)
            self.header = gen[len(plain):].strip() if gen.startswith(plain) else ""
            probe = self.render(user + [{"role": "assistant", "content": SENTINEL}])
            after = probe[probe.rindex(SENTINEL) + len(SENTINEL):].lstrip()
            self.end_marker = after.split("\n")[0].strip()
        except Exception:  # noqa: BLE001 - an unusual template: spans are then the content alone
            self.header, self.end_marker = "", ""

    @property
    def template_sha1(self) -> str:
        return hashlib.sha1(self.template.encode()).hexdigest()

    def render(self, messages, *, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def spans(self, text: str, messages) -> list[tuple[int, int]]:
        """Character spans [start, end) of the assistant turns in ``text`` (the rendered ``messages``)."""
        spans, cursor = [], 0
        for m in messages:
            content = m["content"].strip()
            if m["role"] != "assistant":
                pos = text.find(content, cursor) if content else -1
                cursor = pos + len(content) if pos >= 0 else cursor
                continue
            pos = text.find(content, cursor) if content else -1
            if pos < 0 and self.tags and self.tags[-1] in content:  # templates that drop earlier reasoning
                content = content.rsplit(self.tags[-1], 1)[1].strip()
                pos = text.find(content, cursor) if content else -1
            if pos < 0 and not content and self.header:  # reasoning only: from the header on
                pos = text.find(self.header, cursor)
                pos = pos + len(self.header) if pos >= 0 else -1
            if pos < 0:
                raise BadRow("assistant turn not rendered", "the template dropped or rewrote an assistant turn")
            start = pos
            if self.header:
                h = text.rfind(self.header, cursor, pos)
                if h >= 0:
                    start = h + len(self.header)
                    while start < pos and text[start].isspace():
                        start += 1
            end = pos + len(content)
            if self.end_marker:
                after = end
                while after < len(text) and text[after] in " \t\r\n" and not text.startswith(self.end_marker, after):
                    after += 1
                if text.startswith(self.end_marker, after):
                    end = after + len(self.end_marker)
            spans.append((start, end))
            cursor = end
        return spans

    def reasoning_spans(self, text: str, start: int, end: int) -> list[tuple[int, int]]:
        """The ``<think>…</think>`` blocks (with the whitespace after them) inside [start, end)."""
        if len(self.tags) != 2:
            return []
        open_tag, close_tag = self.tags
        out, cursor = [], start
        while (a := text.find(open_tag, cursor, end)) >= 0:
            b = text.find(close_tag, a + len(open_tag), end)
            b = end if b < 0 else b + len(close_tag)
            while b < end and text[b].isspace():
                b += 1
            out.append((a, b))
            cursor = b
        return out

    def encode(self, messages) -> tuple[list[int], list[bool], str]:
        """(token ids, loss mask, rendered text) of one normalized conversation; BadRow when it cannot be."""
        try:
            text = self.render(messages)
        except Exception as err:  # noqa: BLE001 - jinja raises its own errors (e.g. roles must alternate)
            raise BadRow("template error", str(err)[:200]) from None
        char_mask = bytearray(len(text) + 1)
        for start, end in self.spans(text, messages):
            char_mask[start:end] = b"\x01" * (end - start)
            if self.reasoning == "exclude":
                for a, b in self.reasoning_spans(text, start, end):
                    char_mask[a:b] = bytes(b - a)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        prefix = [0]
        for c in char_mask:
            prefix.append(prefix[-1] + c)
        mask = [prefix[e] - prefix[s] > 0 for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask, text


# -- tokenized conversations -----------------------------------------------------------------------------
@dataclass
class Samples:
    """Variable-length token rows: sample i is ``input_ids[offsets[i]:offsets[i+1]]`` with its loss mask;
    ``prompt_lens[i]`` tokens come before its first trained token (the prompt of a decoding evaluation)."""

    masked = True  # what features.prepare stores: a loss mask per token

    input_ids: torch.Tensor   # [N] int32
    loss_mask: torch.Tensor   # [N] bool
    offsets: torch.Tensor     # [n + 1] int64
    prompt_lens: torch.Tensor  # [n] int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]

    def collate(self, indices, pad_id: int = 0) -> dict:
        """Rows ``indices``, right-padded to the longest: {"input_ids" [b, L] long, "loss_mask" [b, L] bool,
        "attention_mask" [b, L] bool}."""
        indices = [int(i) for i in torch.as_tensor(indices).reshape(-1)]
        width = max(int(self.offsets[i + 1] - self.offsets[i]) for i in indices)
        ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.bool)
        attention = torch.zeros(len(indices), width, dtype=torch.bool)
        for row, i in enumerate(indices):
            tokens, m = self.sample(i)
            ids[row, : len(tokens)], mask[row, : len(tokens)], attention[row, : len(tokens)] = tokens, m, True
        return {"input_ids": ids, "loss_mask": mask, "attention_mask": attention}

    def digest(self) -> str:
        """sha1 of the rows (ids, masks, boundaries): what stored features must have been computed on."""
        h = hashlib.sha1()
        for t in (self.input_ids.to(torch.int32), self.loss_mask.to(torch.uint8), self.offsets.to(torch.int64)):
            if t.numel():
                h.update(t.contiguous().view(torch.uint8).numpy().data)
        return h.hexdigest()

    def stream(self, eos_id: int) -> torch.Tensor:
        """All rows as one stream [N + n] int32, each followed by ``eos_id`` (held-out windows for accuracies)."""
        pieces = []
        for i in range(len(self)):
            pieces += [self.sample(i)[0].to(torch.int32), torch.tensor([eos_id], dtype=torch.int32)]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)

    def trained_tokens(self) -> torch.Tensor:
        """The tokens under the loss mask, flat: the statistics a draft vocabulary is built from."""
        return self.input_ids[self.loss_mask]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.input_ids": self.input_ids.to(torch.int32), f"{prefix}.loss_mask":
                self.loss_mask.to(torch.uint8), f"{prefix}.offsets": self.offsets, f"{prefix}.prompt_lens":
                self.prompt_lens}

    @classmethod
    def from_tensors(cls, tensors: dict, prefix: str) -> Samples:
        return cls(tensors[f"{prefix}.input_ids"], tensors[f"{prefix}.loss_mask"].bool(),
                   tensors[f"{prefix}.offsets"].long(), tensors[f"{prefix}.prompt_lens"].long())

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[bool]]]) -> Samples:
        lengths = [len(ids) for ids, _ in rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        if rows:
            offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        ids = torch.tensor([t for r, _ in rows for t in r], dtype=torch.int32)
        mask = torch.tensor([m for _, ms in rows for m in ms], dtype=torch.bool)
        prompt = [next((j for j, m in enumerate(ms) if m), len(ms)) for _, ms in rows]
        return cls(ids, mask, offsets, torch.tensor(prompt, dtype=torch.int64))


@dataclass
class ChatData:
    train: Samples
    val: Samples
    rows: int = 0
    skipped: dict = field(default_factory=dict)  # reason → {"count", "examples": [[row, detail], ...]}

    def summary(self) -> str:
        n_skipped = sum(v["count"] for v in self.skipped.values())
        text = (f"chat data: {self.rows} rows → {len(self.train)} train + {len(self.val)} validation conversations "
                f"({self.train.n_tokens + self.val.n_tokens} tokens, {int(self.train.loss_mask.sum())} trained on)")
        if n_skipped:
            why = "; ".join(f"{v['count']} {reason}" + (f" (e.g. row {v['examples'][0][0]}: {v['examples'][0][1]})"
                                                        if v["examples"] and v["examples"][0][1] else "")
                            for reason, v in sorted(self.skipped.items(), key=lambda kv: -kv[1]["count"]))
            text += f"; skipped {n_skipped}: {why}"
        return text


def _is_validation(messages, val_fraction: float) -> bool:
    digest = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def encode_conversations(rows, renderer: ChatRenderer, *, max_length: int, overlong: str = "skip",
                         val_fraction: float = 0.02, system_prompt: str | None = None,
                         max_conversations: int | None = None, progress: bool = False) -> ChatData:
    """Normalize, render, tokenize and mask every row; bad rows are counted and skipped (``ChatData.skipped``)."""
    if overlong not in ("skip", "truncate"):
        raise ValueError(f"data.chat.overlong must be skip or truncate, got {overlong!r}")
    train, val, skipped, n = [], [], {}, 0
    for i, row in enumerate(tqdm(rows, disable=not progress, desc="chat data", dynamic_ncols=True)):
        if max_conversations and len(train) + len(val) >= max_conversations:
            break
        n += 1
        try:
            messages = normalize(row, system_prompt)
            ids, mask, _ = renderer.encode(messages)
            if len(ids) > max_length:
                if overlong == "skip":
                    raise BadRow("over max_length", f"{len(ids)} > {max_length} tokens")
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask[1:]):
                raise BadRow("no assistant token", "nothing to train on within max_length")
        except BadRow as bad:
            entry = skipped.setdefault(bad.reason, {"count": 0, "examples": []})
            entry["count"] += 1
            if len(entry["examples"]) < 3:
                entry["examples"].append([i, bad.detail])
            continue
        (val if _is_validation(messages, val_fraction) else train).append((ids, mask))
    if not val and val_fraction > 0 and len(train) > 1:  # tiny sets: keep one conversation for validation
        val.append(train.pop())
    if not train:
        raise ValueError(f"no usable conversation among {n} rows: " + ", ".join(
            f"{v['count']} {k}" for k, v in skipped.items()))
    return ChatData(Samples.from_rows(train), Samples.from_rows(val), n, skipped)


def chat_settings(chat_cfg) -> dict:
    keys = ("source", "split", "template", "system_prompt", "reasoning", "reasoning_tags", "max_length", "overlong",
            "val_fraction", "max_conversations")
    out = {k: chat_cfg.get(k) for k in keys}
    out["reasoning_tags"] = list(out["reasoning_tags"] or ())
    return out


def prepare_chat(chat_cfg, tokenizer, cache_dir: str | os.PathLike, *, progress: bool = True) -> ChatData:
    """The tokenized conversations of ``data.chat`` (conf/data/chat.yaml), cached in ``cache_dir`` under a key
    of the source's bytes, the tokenizer, the template and the settings. ``progress``: a progress bar and the
    summary of skipped rows (rank 0)."""
    settings = chat_settings(chat_cfg)
    if not settings["source"]:
        raise ValueError("data=chat needs data.chat.source=<JSONL/JSON/parquet file, glob or datasets folder>")
    renderer = ChatRenderer(tokenizer, settings["template"], reasoning=settings["reasoning"],
                            reasoning_tags=settings["reasoning_tags"])
    key_data = {**settings, "source_sha1": source_digest(settings["source"]), "template_sha1": renderer.template_sha1,
                "tokenizer": hashlib.sha1(tokenizer._tokenizer.to_str().encode()).hexdigest(), "format": 1}
    key = hashlib.sha1(json.dumps(key_data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"chat-{key}" / CHAT_FILE
    if path.is_file():
        try:
            tensors = load_safetensors(path, "chat data cache")
            meta = json.loads((path.parent / "meta.json").read_text())
            data = ChatData(Samples.from_tensors(tensors, "train"), Samples.from_tensors(tensors, "val"),
                            meta["rows"], meta["skipped"])
            if progress:
                print(data.summary() + f" (cached: {path.parent})")
            return data
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
            print(f"chat data cache {path} is unusable ({err!r}): encoding the conversations again")
    rows = load_rows(settings["source"], split=settings["split"] or "train", cache_dir=cache_dir)
    data = encode_conversations(rows, renderer, max_length=int(settings["max_length"]), overlong=settings["overlong"],
                                val_fraction=float(settings["val_fraction"]), system_prompt=settings["system_prompt"],
                                max_conversations=settings["max_conversations"], progress=progress)
    atomic_write(path.parent / "meta.json", lambda tmp: tmp.write_text(json.dumps(
        {"rows": data.rows, "skipped": data.skipped, "settings": settings}, indent=1, default=str)))
    atomic_write(path, lambda tmp: save_file({**data.train.tensors("train"), **data.val.tensors("val")}, str(tmp)))
    if progress:
        print(data.summary())
    return data


class SampleBatches(CollatedBatches):
    """Deterministic batches of whole conversations: step → ``permuted_indices`` → right-padded rows."""

    def __init__(self, samples: Samples, batch_size: int, seed: int = 0, pad_id: int = 0):
        super().__init__(samples, batch_size, seed, pad_id, what="training conversations")


# -- regenerated responses -------------------------------------------------------------------------------
def _done_rows(out: Path) -> set[int]:
    """Rows already in a regeneration output; a last line cut by a kill is removed from the file."""
    if not out.is_file():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        out.write_bytes(data)
    done = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            done.add(int(json.loads(line)["row"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


@torch.no_grad()
def regenerate(target, tokenizer, chat_cfg, out: str | os.PathLike, *, batch_size: int = 8,
               max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               cache_dir: str | os.PathLike | None = None, rank: int = 0, world_size: int = 1,
               progress: bool = True) -> dict:
    """Replace every assistant turn of ``data.chat.source`` with the target's own response, generated turn
    by turn (each sees the regenerated turns before it), ``batch_size`` conversations at a time (left-padded).
    Writes OpenAI-style rows ``{"row", "messages"}`` to ``out`` (JSONL), flushed after every batch; a rerun
    skips the rows already there. Under torchrun rank r takes rows r, r + W, ... into ``out`` + ``.rank<r>``.
    Returns counts (written, skipped as bad, already done)."""
    settings = chat_settings(chat_cfg)
    renderer = ChatRenderer(tokenizer, settings["template"])
    out = Path(out) if world_size == 1 else Path(f"{out}.rank{rank}")
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done_rows(out)
    rows = load_rows(settings["source"], split=settings["split"] or "train", cache_dir=cache_dir)
    todo, bad = [], Counter()
    limit = settings["max_conversations"]
    for i, row in enumerate(rows):
        if limit and i >= limit:
            break
        if i % world_size != rank or i in done:
            continue
        try:
            todo.append((i, normalize(row, settings["system_prompt"])))
        except BadRow as err:
            bad[err.reason] += 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = [renderer.end_marker] if renderer.end_marker else None
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    bar = tqdm(total=len(todo), disable=not progress, desc="regenerating", dynamic_ncols=True)
    try:
        with open(out, "a", encoding="utf-8") as f:
            for b in range(0, len(todo), batch_size):
                chunk = todo[b : b + batch_size]
                convs = [[m for m in msgs] for _, msgs in chunk]
                n_turns = max(sum(m["role"] == "assistant" for m in msgs) for msgs in convs)
                for turn in range(n_turns):
                    where = []  # (conversation, index of its turn-th assistant message)
                    for c, msgs in enumerate(convs):
                        idx = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
                        if turn < len(idx):
                            where.append((c, idx[turn]))
                    prompts = [renderer.render(convs[c][:j], add_generation_prompt=True) for c, j in where]
                    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
                    enc = {k: v.to(target.device) for k, v in enc.items()}
                    torch.manual_seed(seed + b * 1009 + turn)
                    gen = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                          temperature=temperature if temperature > 0 else None,
                                          top_p=top_p if temperature > 0 else None, top_k=0 if temperature > 0
                                          else None, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                                          stop_strings=stop, tokenizer=tokenizer if stop else None)
                    new = gen[:, enc["input_ids"].shape[1]:].cpu()
                    for (c, j), ids in zip(where, new, strict=True):
                        text = tokenizer.decode(ids, skip_special_tokens=True)
                        if renderer.end_marker and renderer.end_marker in text:
                            text = text.split(renderer.end_marker)[0]
                        convs[c][j] = {"role": "assistant", "content": text.strip()}
                for (i, _), msgs in zip(chunk, convs, strict=True):
                    f.write(json.dumps({"row": i, "messages": msgs}, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(chunk))
    finally:
        tokenizer.padding_side = padding_side
        bar.close()
    return {"written": len(todo), "bad_rows": dict(bad), "already_done": len(done), "out": str(out)}


def run_regenerate(cfg) -> dict:
    """The ``scripts/regenerate.py`` job (train_heads' config: ``target``, ``data=chat``, ``data.regenerate``).
    Under torchrun each rank writes its share; rank 0 then merges them, in row order, into
    ``data.regenerate.out``."""
    r = cfg.data.get("regenerate") or {}
    if cfg.data.get("chat") is None or not cfg.data.chat.get("source"):
        raise ValueError("regenerate needs data=chat and data.chat.source=<conversations>")
    if not r.get("out"):
        raise ValueError("regenerate needs data.regenerate.out=<the JSONL file to write>")
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    with distributed.session("ddp", cfg.trainer.get("dist_timeout_s")) as ctx:
        target, tokenizer = load_model(cfg.target)
        target.to(ctx.device)
        with distributed.rank0_first(ctx):  # rank 0 converts the source with datasets first (its cache)
            load_rows(cfg.data.chat.source, split=cfg.data.chat.split or "train", cache_dir=cfg.data.cache_dir)
        counts = regenerate(target, tokenizer, cfg.data.chat, r.out, batch_size=r.get("batch_size", 8),
                            max_new_tokens=r.get("max_new_tokens", 512), temperature=r.get("temperature", 0.0),
                            top_p=r.get("top_p", 1.0), seed=cfg.seed, cache_dir=cfg.data.cache_dir, rank=ctx.rank,
                            world_size=ctx.world_size, progress=ctx.is_main)
        distributed.barrier(ctx)
        if ctx.distributed and ctx.is_main:
            rows = []
            for rank in range(ctx.world_size):
                part = Path(f"{r.out}.rank{rank}")
                rows += [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines() if line.strip()]
            rows.sort(key=lambda row: row["row"])
            atomic_write(Path(r.out), lambda tmp: tmp.write_text(
                "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"))
            counts["out"] = str(r.out)
        if ctx.is_main:
            print(f"regenerated responses: {counts}")
        return counts
