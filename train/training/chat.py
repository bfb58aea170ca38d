"""Chat data (``data=chat``): conversations → the target's chat template → token rows whose loss mask
covers the assistant's tokens only.

**Reading** (train/training/conversations.py): ``data.chat.source`` is JSON/JSONL or parquet files, or a ``datasets``
folder, of ShareGPT or OpenAI conversations.

**Bad rows** are counted and skipped, never a crash later: no conversation, a malformed turn, an unknown
role, an empty turn, no assistant turn, a template error, an assistant turn the template does not render.
``ChatData.skipped`` and a printed summary say how many, and why.

**Long conversations.** ``max_length`` (``trainer.seq_len`` by default) is the most tokens one conversation
trains on: a packed window's width. Longer ones are cut to their first ``max_length`` tokens (``overlong:
truncate``, the default: counted in ``ChatData.truncated`` and printed with the tokens cut) and skipped only when
no assistant token remains inside; ``overlong: skip`` skips them all (counted). None is dropped silently.

**Rendering and the loss mask.** A conversation is rendered to text once with the tokenizer's chat
template (or ``data.chat.template``: a .jinja file or ``chatml``) and tokenized with character offsets.
Each assistant turn's span runs from the end of its header (the template's generation prompt, e.g.
``<|im_start|>assistant\\n``, so a reasoning block the template renders before the content is inside it)
through its content and the template's end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ``</s>``: what
the drafter must learn to predict for the target to stop). A token is trained on when its characters
overlap a span. ``reasoning: exclude`` removes ``<think>…</think>`` blocks (``reasoning_tags``) from the mask.

**No attention across conversations.** By default conversations are packed into full windows
(train/training/packing.py: per-conversation position ids keep attention and loss inside each). With ``pack:
false``, one conversation per row, right-padded: causal attention keeps real tokens from the padding, and the
loss mask skips it. Batches are ``permuted_indices`` of (seed, step), so exact resume and rank sharding hold.

**Cache.** Tokenized conversations are cached in ``data.cache_dir``, keyed by a sha1 of the source files'
bytes, the tokenizer, the template and these settings. **Regenerated responses** (train/training/regeneration.py)
are conversations in the same format, with the assistant turns written by the target itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from treespec.io import atomic_write, load_safetensors
from treespec.train.training import config_checks
from treespec.train.training.conversations import BadRow, load_rows, normalize, source_digest
from treespec.train.training.data import CHATML, CollatedBatches, is_validation

TEMPLATES = {"chatml": CHATML}
SENTINEL = "\u00a7\u00a7treespec-probe\u00a7\u00a7"
CHAT_FILE = "chat.safetensors"


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


def warn_split_markers(tokenizer, markers) -> None:
    """Warn when a named template's markers are not tokens of ``tokenizer``: each is then split into ordinary
    tokens (``<|im_start|>`` into six or so), which lengthens every row and trains on marker pieces."""
    vocab = tokenizer.get_vocab()
    missing = [m for m in markers if m not in vocab]
    if missing:
        warnings.warn(f"data.chat.template=chatml, but the tokenizer has no {', '.join(missing)} token(s): they are "
                      "split into ordinary tokens; use the tokenizer's own chat template (data.chat.template=null) "
                      "or add them as special tokens", stacklevel=3)


class ChatRenderer:
    """Renders conversations with one chat template and finds the assistant spans (module docstring)."""

    def __init__(self, tokenizer, template: str | None = None, *, reasoning: str = "include",
                 reasoning_tags=("<think>", "</think>")):
        if reasoning not in ("include", "exclude"):
            raise ValueError(f"data.chat.reasoning must be include or exclude, got {reasoning!r}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("chat data needs a fast (Rust) tokenizer for character offsets")
        self.tokenizer, self.template = tokenizer, resolve_template(tokenizer, template)
        if template == "chatml":
            warn_split_markers(tokenizer, ("<|im_start|>", "<|im_end|>"))
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
            # The answer is searched after its header (from the cursor, "a" was found in "<|im_start|>assistant") and
            # backwards from its end marker ("hi" was found in the "<think>\n\n</think>" Qwen3's renders before it)
            h = text.find(self.header, cursor) if self.header else -1
            body = h + len(self.header) if h >= 0 else cursor
            stop = text.find(self.end_marker, body) if self.end_marker and content else -1
            pos = text.rfind(content, body, stop) if stop >= 0 else -1
            pos = text.find(content, body) if pos < 0 and content else pos
            if pos < 0 and self.tags and self.tags[-1] in content:  # templates that drop earlier reasoning
                content = content.rsplit(self.tags[-1], 1)[1].strip()
                pos = text.find(content, body) if content else -1
            if pos < 0 and not content and h >= 0:  # reasoning only: from the header on
                pos = body
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
    truncated: dict = field(default_factory=dict)  # {"count", "tokens": cut in all, "max_length"} (overlong: truncate)
    val_by_hash: bool = True  # False: none hashed into validation, so one train conversation was moved there

    def summary(self) -> str:
        n_skipped = sum(v["count"] for v in self.skipped.values())
        text = (f"chat data: {self.rows} rows → {len(self.train)} train + {len(self.val)} validation conversations "
                f"({self.train.n_tokens + self.val.n_tokens} tokens, {int(self.train.loss_mask.sum())} trained on)")
        if self.truncated.get("count"):
            text += (f"; {self.truncated['count']} truncated to max_length={self.truncated['max_length']} tokens "
                     f"({self.truncated['tokens']} tokens cut)")
        if n_skipped:
            why = "; ".join(f"{v['count']} {reason}" + (f" (e.g. row {v['examples'][0][0]}: {v['examples'][0][1]})"
                                                        if v["examples"] and v["examples"][0][1] else "")
                            for reason, v in sorted(self.skipped.items(), key=lambda kv: -kv[1]["count"]))
            text += f"; skipped {n_skipped}: {why}"
        return text


def encode_conversations(rows, renderer: ChatRenderer, *, max_length: int, overlong: str = "skip",
                         val_fraction: float = 0.02, system_prompt: str | None = None,
                         max_conversations: int | None = None, progress: bool = False) -> ChatData:
    """Normalize, render, tokenize and mask every row; bad rows are counted and skipped (``ChatData.skipped``)."""
    if overlong not in ("skip", "truncate"):
        raise ValueError(f"data.chat.overlong must be skip or truncate, got {overlong!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:  # else "no assistant token"
        raise ValueError(f"data.chat.max_length (else trainer.seq_len) must be an integer ≥ 2, got {max_length!r}")
    config_checks.number(val_fraction, "data.chat.val_fraction", 0, 1, high_open=True)  # else no row left, no reason
    config_checks.integer(max_conversations, "data.chat.max_conversations", 0, optional=True)  # -1 once read no row
    train, val, skipped, n, cut = [], [], {}, 0, 0
    truncated = {"count": 0, "tokens": 0, "max_length": max_length}
    for i, row in enumerate(tqdm(rows, disable=not progress, desc="chat data", dynamic_ncols=True)):
        if max_conversations and len(train) + len(val) >= max_conversations:
            break
        n += 1
        try:
            messages = normalize(row, system_prompt)
            ids, mask, _ = renderer.encode(messages)
            cut = max(0, len(ids) - max_length)
            if cut:
                if overlong == "skip":
                    raise BadRow("over max_length", f"{len(ids)} > {max_length} tokens")
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask[1:]):
                raise BadRow("no assistant token", f"nothing to train on within max_length={max_length}")
        except BadRow as bad:
            entry = skipped.setdefault(bad.reason, {"count": 0, "examples": []})
            entry["count"] += 1
            if len(entry["examples"]) < 3:
                entry["examples"].append([i, bad.detail])
            continue
        truncated["count"], truncated["tokens"] = truncated["count"] + bool(cut), truncated["tokens"] + cut
        (val if is_validation(conversation_key(messages), val_fraction) else train).append((ids, mask))
    by_hash = True
    if not val and val_fraction > 0 and len(train) > 1:  # tiny sets: keep one conversation for validation
        val.append(train.pop())
        by_hash = False
    if not train:
        raise ValueError(f"no usable conversation among {n} rows: " + ", ".join(
            f"{v['count']} {k}" for k, v in skipped.items()))
    return ChatData(Samples.from_rows(train), Samples.from_rows(val), n, skipped, truncated, by_hash)


def conversation_key(messages) -> str:
    """What decides a conversation's split (``is_validation``): its normalized messages as JSON. The comparison's
    ``workload.chat_validation`` selects the held-out conversations by the same key (train/compare/workload.py)."""
    return json.dumps(messages, sort_keys=True)


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
    # format 4: masks before it could cover a marker or a block before a short answer instead (ChatRenderer.spans)
    key_data = {**settings, "source_sha1": source_digest(settings["source"]), "template_sha1": renderer.template_sha1,
                "tokenizer": hashlib.sha1(tokenizer._tokenizer.to_str().encode()).hexdigest(), "format": 4}
    key = hashlib.sha1(json.dumps(key_data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"chat-{key}" / CHAT_FILE
    if path.is_file():
        try:
            tensors = load_safetensors(path, "chat data cache")
            meta = json.loads((path.parent / "meta.json").read_text())
            data = ChatData(Samples.from_tensors(tensors, "train"), Samples.from_tensors(tensors, "val"),
                            meta["rows"], meta["skipped"], meta.get("truncated", {}), meta.get("val_by_hash", True))
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
        {"rows": data.rows, "skipped": data.skipped, "truncated": data.truncated, "val_by_hash": data.val_by_hash,
         "settings": settings}, indent=1, default=str)))
    atomic_write(path, lambda tmp: save_file({**data.train.tensors("train"), **data.val.tensors("val")}, str(tmp)))
    if progress:
        print(data.summary())
    return data


class SampleBatches(CollatedBatches):
    """Deterministic batches of whole conversations: step → ``permuted_indices`` → right-padded rows."""

    def __init__(self, samples: Samples, batch_size: int, seed: int = 0, pad_id: int = 0):
        super().__init__(samples, batch_size, seed, pad_id, what="training conversations")
