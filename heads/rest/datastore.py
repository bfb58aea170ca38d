"""REST's datastore: a corpus, tokenized with the target's tokenizer, in a suffix array (heads/rest/suffix_array.py),
built once and cached by content.

A corpus is one of:

* ``"stdlib"``: the standard-library corpus the reference models were trained on, *without* its held-out files
  (treespec/corpus.py's split, the one the comparison's held-out prompts come from): the default for the code
  reference target;
* a folder of text files (every file matching ``pattern``, "*" by default), all of them;
* a ``.jsonl`` file of ``{"text": ...}`` records, all of them;
* a ``datasets`` folder written by ``save_to_disk``: its ``text`` column (a DatasetDict's ``train`` split).

The cache file ``rest-<key>.safetensors`` (under ``cache_dir``, the data cache: conf/paths' ``data``) is keyed by a
sha1 over the corpus's contents (every file it reads, with their names), the tokenizer and the reading options, so
an edited corpus or another tokenizer builds anew and an unchanged one is read back (about a second for the
stdlib's 9 M tokens, against minutes to encode and sort them). It is written atomically (treespec.io).

    index = load_datastore("stdlib", tokenizer)                 # heads/rest/suffix_array.py's SuffixArray
    index = load_datastore("/data/my_texts", tokenizer, pattern="*.md", cache_dir=".cache/data")
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from treespec.corpus import STDLIB_CORPUS, corpus_digest, load_corpus
from treespec.heads.rest.suffix_array import SEPARATOR, SuffixArray
from treespec.io import atomic_write, load_safetensors

VERSION = 2  # of the cache file's layout and of how a corpus is read: bumping it rebuilds every datastore (2: a
# one-document corpus was stored twice)
KINDS = "'stdlib', a folder of text files, a .jsonl file of {\"text\": ...} records or a datasets save_to_disk folder"


def is_dataset_folder(path: Path) -> bool:
    """Whether ``path`` is a folder ``datasets``' ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json"))


def check_corpus(corpus) -> None:
    """Refuse a corpus that cannot be read, before anything is built, naming what it should be."""
    if corpus == "stdlib":
        return
    if not isinstance(corpus, (str, os.PathLike)):
        raise ValueError(f"REST's corpus must be {KINDS}; got {corpus!r}")
    path = Path(corpus)
    if not path.exists():
        raise ValueError(f"REST's corpus {str(path)!r} does not exist; give {KINDS}")
    if path.is_file() and path.suffix != ".jsonl":
        raise ValueError(f"REST's corpus {str(path)!r} is a file but not a .jsonl of {{\"text\": ...}} records; "
                         f"give {KINDS}")


def read_texts(corpus, pattern: str | None = None) -> list[str]:
    """The documents of ``corpus`` (module docstring), in a fixed order."""
    check_corpus(corpus)
    if corpus == "stdlib":  # the training split only: the held-out files stay unseen, as for the trained drafters
        spec = {**STDLIB_CORPUS, "pattern": pattern or STDLIB_CORPUS["pattern"]}
        return [text for _, text in load_corpus(**spec).train]
    path = Path(corpus)
    if is_dataset_folder(path):
        return _dataset_texts(path)
    every = load_corpus(str(path), pattern=pattern or "*", val_fraction=0.0).documents()  # none held out
    return [text for _, text in every]


def _dataset_texts(path: Path) -> list[str]:
    import datasets  # heavy: only this kind of corpus needs it

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"REST's corpus {str(path)!r} is a DatasetDict without a 'train' split (it has "
                             f"{', '.join(data)}); save the split to use with save_to_disk")
        data = data["train"]
    if "text" not in data.column_names:
        raise ValueError(f"REST's corpus {str(path)!r} has no 'text' column (its columns: "
                         f"{', '.join(data.column_names)})")
    return [t for t in data["text"] if t]


def tokenizer_digest(tokenizer) -> str:
    """sha1 of what decides a tokenizer's ids: its serialized fast tokenizer, else its vocabulary."""
    fast = getattr(tokenizer, "_tokenizer", None)
    text = fast.to_str() if fast is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha1(text.encode()).hexdigest()


def cache_key(corpus, tokenizer, pattern: str | None) -> str:
    """By content: the files read (names and bytes), how they are read, the tokenizer; not where they lie."""
    if corpus == "stdlib":
        spec = {**STDLIB_CORPUS, "pattern": pattern or STDLIB_CORPUS["pattern"]}
    else:
        check_corpus(corpus)
        spec = {"source": str(corpus), "pattern": pattern or "*", "max_files": None}
    reading = {k: v for k, v in spec.items() if k != "source"} | {"stdlib": corpus == "stdlib"}
    key = {"version": VERSION, "reading": reading, "corpus_sha1": corpus_digest(**spec),
           "tokenizer": tokenizer_digest(tokenizer)}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def encode(tokenizer, texts: list[str]) -> np.ndarray:
    """int32 [n]: every document's ids (no special tokens), each followed by SEPARATOR."""
    fast = getattr(tokenizer, "_tokenizer", None)
    if fast is not None:
        ids = [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    lengths = np.array([len(d) + 1 for d in ids], dtype=np.int64)
    out = np.full(int(lengths.sum()), SEPARATOR, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, doc in zip(starts.tolist(), ids, strict=True):
        out[start : start + len(doc)] = doc
    return out


def load_datastore(corpus="stdlib", tokenizer=None, *, pattern: str | None = None,
                   cache_dir: str | os.PathLike = ".cache/data", log=print) -> SuffixArray:
    """The SuffixArray of ``corpus`` encoded with ``tokenizer``: read from the cache when its content key matches,
    else built and cached (module docstring). ``pattern``: the files a folder corpus reads ("*"; "*.py" for
    stdlib)."""
    check_corpus(corpus)
    if tokenizer is None:
        raise ValueError("REST's datastore is encoded with the target's tokenizer: give tokenizer=")
    path = Path(cache_dir) / f"rest-{cache_key(corpus, tokenizer, pattern)}.safetensors"
    if path.is_file():
        try:
            stored = load_safetensors(path, "REST datastore")
            return SuffixArray(stored["tokens"].numpy(), stored["sa"].numpy())
        except (ValueError, KeyError, OSError) as err:
            log(f"REST datastore {path} is unusable ({err}): building it again")
    texts = read_texts(corpus, pattern)
    if not texts:
        raise ValueError(f"REST's corpus {corpus!r} holds no text")
    log(f"building REST's datastore from {corpus} ({len(texts)} documents): encoding, then sorting its suffixes")
    index = SuffixArray.build(encode(tokenizer, texts))
    arrays = {"tokens": torch.from_numpy(index.tokens), "sa": torch.from_numpy(index.sa)}
    atomic_write(path, lambda tmp: save_file(arrays, str(tmp)))
    log(f"REST datastore: {len(index):,} tokens, cached in {path}")
    return index
