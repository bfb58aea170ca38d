"""Corpus, tokenizer and token batches for training the reference models.

The corpus (by default the running interpreter's standard library) and its deterministic train/validation split
are read by treespec/corpus.py, which REST's datastore shares; its names are re-exported here. Any other
directory of text files, or a JSONL file of ``{"text": ...}`` records, can be selected instead; a JSONL file's
conversation rows (``messages``/``conversations``, as ``data=chat`` reads) are rendered in ChatML (``chat_document``),
so a model trained here on conversations learns the chat format its tokenizer's template writes.

The tokenizer trained for a new language model (``train_tokenizer``) is byte-level BPE with ChatML's chat template
(``<|im_start|>role\n...<|im_end|>\n``) and its two markers as special tokens (one id each), beside
``<|endoftext|>`` (EOS, BOS) and ``<|pad|>``: a target built here reads chat data (``data=chat``) and chat workloads
with its own template, whatever text it was trained on.

Token streams are one flat uint16/int32 tensor per split, documents joined by an EOS token; a
training batch is a set of windows at positions drawn from a permutation that depends only on
(seed, epoch), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from treespec.corpus import STDLIB_CORPUS, Corpus, corpus_digest, is_validation, load_corpus, stdlib_root  # noqa: F401
from treespec.io import atomic_write, load_safetensors, weights_digest
from treespec.train.training.conversations import BadRow, normalize

# ids 0.. in this order; the ChatML markers are special tokens, never split or merged with their neighbours
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_MARKERS = SPECIAL_TOKENS[2:]
# ChatML (Qwen's, OpenAI's): each message "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt
# opens an assistant turn
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BYTE_ALPHABET = 256
TOKENS_FILE = "tokens.safetensors"  # {"train": [n] int32, "val": [n] int32}


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | os.PathLike | None = None):
    """Byte-level BPE over ``texts`` with ``SPECIAL_TOKENS`` and the ChatML chat template (module docstring);
    returns a transformers ``PreTrainedTokenizerFast``."""
    min_size = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size={vocab_size} is below the byte alphabet plus special tokens ({min_size})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], bos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1], additional_special_tokens=CHAT_MARKERS, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """One flat token stream: each document followed by EOS. Shape [n_tokens], int32."""
    ids: list[int] = []
    for enc in tokenizer._tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


def prepare_tokens(corpus_cfg: dict, vocab_size: int, cache_dir: str | os.PathLike, tokenizer=None):
    """Tokenizer + train/val token streams [n] int32, cached under ``cache_dir``.

    The cache is keyed by the config, the tokenizer (when given) and a digest of the corpus files'
    contents (``corpus_digest``), so an edited or grown corpus is re-encoded, never served stale.
    With ``tokenizer`` given (training heads for an existing target), the corpus is encoded with it;
    otherwise a new tokenizer of ``vocab_size`` is trained on the train split."""
    key_data = {**corpus_cfg, "vocab": vocab_size, "corpus_sha1": corpus_digest(**corpus_cfg)}
    if tokenizer is not None:
        key_data["tokenizer"] = hashlib.sha1(tokenizer._tokenizer.to_str().encode()).hexdigest()
    else:  # a tokenizer trained here: one cached before the chat markers existed is not reused
        key_data["special_tokens"] = SPECIAL_TOKENS
    if str(corpus_cfg.get("source", "")).endswith(".jsonl"):  # cached before a row's split followed its content
        key_data["split"] = "row content"
    key = hashlib.sha1(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"tokens-{key}"
    tokens_file = cache / TOKENS_FILE
    if tokens_file.is_file() and (tokenizer is not None or (cache / "tokenizer").is_dir()):
        try:
            streams = load_safetensors(tokens_file, "token cache")
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(cache / "tokenizer")
            return tokenizer, streams["train"], streams["val"]
        except (ValueError, KeyError, OSError) as err:
            print(f"token cache {tokens_file} is unusable ({err!r}): encoding the corpus again")
    corpus = load_corpus(**corpus_cfg, render=lambda row: chat_document(row, tokenizer))
    cache.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = train_tokenizer([t for _, t in corpus.train], vocab_size, cache / "tokenizer")
    streams = {
        "train": encode_documents(tokenizer, [t for _, t in corpus.train]),
        "val": encode_documents(tokenizer, [t for _, t in corpus.val]),
    }
    atomic_write(tokens_file, lambda tmp: save_file(streams, str(tmp)))
    return tokenizer, streams["train"], streams["val"]


def chat_document(row, tokenizer=None) -> str | None:
    """A conversation row of a JSONL corpus as one training document: rendered with ``tokenizer``'s chat template
    when it has one (training for an existing target), else in ChatML, the template of the tokenizer a language
    model trained here gets. None for a row with no usable turns (the corpus counts it)."""
    try:
        messages = normalize(row)
    except BadRow:
        return None
    if tokenizer is not None and tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    # CHATML's output, written out: no tokenizer exists yet to apply it (tests/train/training/test_train.py checks
    # they agree)
    return "".join(f"{CHAT_MARKERS[0]}{m['role']}\n{m['content']}{CHAT_MARKERS[1]}\n" for m in messages)


def distill_cache_file(target, tokens: torch.Tensor, cache_dir: str | os.PathLike, **params) -> Path:
    """Where ``self_distill`` caches its stream: a name keyed by its parameters, the prompt token stream
    (length and sha1) and the target (``weights_digest`` and its config)."""
    config = target.config.to_dict() if hasattr(target, "config") else {}
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    flat = tokens.contiguous().reshape(-1)
    key = {
        **params, "n_tokens": len(tokens),
        "tokens_sha1": hashlib.sha1(flat.view(torch.uint8).numpy().data).hexdigest() if flat.numel() else "",
        "tokens_dtype": str(tokens.dtype), "weights": weights_digest(target),
        "config": hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
    }
    name = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"distill-{name}.safetensors"


@torch.no_grad()
def self_distill(target, tokens: torch.Tensor, *, n_prompts: int, prompt_tokens: int, new_tokens: int,
                 temperature: float, batch_size: int, seed: int, cache_dir: str | os.PathLike,
                 eos_token_id: int | None = None) -> torch.Tensor:
    """Continuations the target itself generates from corpus prompts (Medusa's self-distillation: the
    heads learn what the target will actually verify). Returns one flat stream [n] int32 of
    prompt + continuation sequences joined by EOS, cached under ``cache_dir`` in the file
    ``distill_cache_file`` names (keyed by these arguments, the token stream and the target's weights);
    the file holds one tensor, "tokens"."""
    # temperature as a float: ``temperature=0`` and ``0.0`` (a command line's and a yaml's) are one cache file
    params = {"n_prompts": n_prompts, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
              "temperature": float(temperature), "batch_size": batch_size, "seed": seed, "eos_token_id": eos_token_id}
    cache_path = distill_cache_file(target, tokens, cache_dir, **params)
    if cache_path.is_file():
        try:
            stream = load_safetensors(cache_path, "self-distillation cache")["tokens"]
            print(f"self-distillation data: {len(stream)} tokens from the cache {cache_path}")
            return stream
        except (ValueError, KeyError) as err:
            print(f"self-distillation cache {cache_path} is unusable ({err!r}): generating again")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - prompt_tokens, (n_prompts,), generator=g)
    pieces = []
    for i in range(0, n_prompts, batch_size):
        idx = starts[i : i + batch_size, None] + torch.arange(prompt_tokens)[None]
        prompts = tokens[idx].long().to(target.device)  # [b, prompt_tokens]
        torch.manual_seed(seed + i)
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=temperature > 0,
                              temperature=temperature if temperature > 0 else None, top_k=0,
                              pad_token_id=eos_token_id, eos_token_id=None)
        for row in out.cpu():
            pieces += [row.to(torch.int32), torch.tensor([eos_token_id or 0], dtype=torch.int32)]
    stream = torch.cat(pieces)
    atomic_write(cache_path, lambda tmp: save_file({"tokens": stream}, str(tmp)))
    print(f"self-distillation data: {len(stream)} tokens, cached at {cache_path}")
    return stream


def permuted_indices(n: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The sample indices of global step ``step``: epoch e visits every one of ``n`` samples once, in the order
    ``randperm(n, seed + e)``, ``batch_size`` at a time (a last partial batch is dropped). A pure function of
    (seed, step): what exact resume and rank sharding rest on."""
    steps_per_epoch = n // batch_size
    epoch, i = divmod(step, steps_per_epoch)
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)[i * batch_size : (i + 1) * batch_size]


class CollatedBatches:
    """Deterministic batches of whole samples from anything with ``len`` and ``collate(indices, pad_id)`` (chat
    conversations, stored feature samples): step → ``permuted_indices`` → right-padded rows. ``what`` names the
    samples in the error a too-small set raises."""

    def __init__(self, samples, batch_size: int, seed: int = 0, pad_id: int = 0, *, what: str = "training samples"):
        if len(samples) < batch_size:
            raise ValueError(f"{len(samples)} {what}, fewer than batch_size={batch_size}")
        self.samples, self.batch_size, self.seed, self.pad_id = samples, batch_size, seed, pad_id
        self.steps_per_epoch = len(samples) // batch_size

    def indices(self, step: int) -> torch.Tensor:
        return permuted_indices(len(self.samples), self.batch_size, self.seed, step)

    def batch(self, step: int) -> dict:
        return self.samples.collate(self.indices(step), self.pad_id)


class TokenBatches:
    """Deterministic [batch, seq_len + 1] windows over a token stream.

    Epoch e visits every non-overlapping window once in the order ``randperm(n, seed + e)``; the
    position (epoch, index) is the whole sampler state, so resuming needs only the step count.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < batch_size:
            raise ValueError(
                f"token stream of {len(tokens)} tokens has {self.n_windows} windows of {seq_len}, "
                f"fewer than batch_size={batch_size}"
            )
        self.steps_per_epoch = self.n_windows // batch_size

    def indices(self, step: int) -> torch.Tensor:
        """The windows of global step ``step`` (``permuted_indices``)."""
        return permuted_indices(self.n_windows, self.batch_size, self.seed, step)

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        """Windows ``indices`` (window i starts at token i · seq_len): LongTensor [len(indices), seq_len + 1]."""
        idx = torch.as_tensor(indices)[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx].long()

    def batch(self, step: int) -> torch.Tensor:
        """The batch for global step ``step``: LongTensor [batch, seq_len + 1]."""
        return self.windows(self.indices(step))


def eval_windows(tokens: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """All non-overlapping validation windows, LongTensor [n, seq_len + 1]."""
    n = (len(tokens) - 1) // seq_len
    if max_windows:
        n = min(n, max_windows)
    idx = (torch.arange(n) * seq_len)[:, None] + torch.arange(seq_len + 1)[None, :]
    return tokens[idx].long()


@torch.no_grad()
def own_continuations(target, windows: torch.Tensor, *, context: int = 128, new_tokens: int = 128, lead: int = 16,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 8) -> torch.Tensor:
    """The text a verification pass actually sees: the target's own continuation (greedy, or sampled at
    ``temperature`` / ``top_p``) of the first ``context`` tokens of each held-out window [n, S], returned with the
    last ``lead`` tokens of its prompt before it, [n, lead + new_tokens].

    Why: drafters agree with the target far more on what the target writes itself than on human-written text,
    and decoding verifies the target's own text: agreement measured on held-out windows underestimates the
    acceptance length decoding reaches, while agreement on these continuations predicts it."""
    if windows.shape[1] < context:
        raise ValueError(f"own_continuations: windows of {windows.shape[1]} tokens are shorter than context={context}")
    sampled = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0 else \
        {"do_sample": False}
    pieces = []
    for i, batch in enumerate(windows[:, :context].split(batch_size)):
        torch.manual_seed(seed + i)  # transformers samples from the global generator
        out = target.generate(batch.to(target.device), attention_mask=torch.ones_like(batch, device=target.device),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
                              **sampled)
        pieces.append(out[:, context - lead :])
    return torch.cat(pieces)


def held_out_windows(tokenizer, seq_len: int, max_windows: int, cache_dir: str | os.PathLike = ".cache/data"):
    """[max_windows, seq_len] windows of the stdlib corpus's validation split, encoded with ``tokenizer``:
    the held-out text drafters' acceptance rates are measured on."""
    _, _, val = prepare_tokens(STDLIB_CORPUS, len(tokenizer), cache_dir, tokenizer=tokenizer)
    return eval_windows(val, seq_len, max_windows)
