"""Offline target features: the frozen target run once over the training data, its hidden states stored,
so that drafter training (``data.features=DIR``) never runs the target's decoder layers again.

``scripts/prepare_features.py`` (``prepare``) writes, per split (``train``, and ``val`` for the in-training
evaluation), shards ``<split>-00000.safetensors`` of whole samples (corpus windows or conversations)::

    input_ids  [N] int32         every sample's tokens, back to back
    loss_mask  [N] uint8         chat data only: 1 on the tokens trained on
    offsets    [n + 1] int64     sample i of the shard is rows offsets[i]:offsets[i+1]
    hidden.<i> [N, h]            the target's hidden_states[i] (the input of decoder layer i; i = L is the
                                 final-norm output, whose lm_head logits are the target's logits)

beside a sidecar ``<split>-00000.json`` (its key, counts and sha1), and ``index.json`` once every shard is
done. The layers stored are the drafter's feature layers and the last one: everything its loss needs of
the target, since the target's logits are ``lm_head(hidden.L)`` and the drafter shares that lm_head (and
the embeddings) with the target, which therefore stays loaded. Shards are numbered over samples in order,
rank r of W writes shards r, r + W, ...; a shard whose sidecar exists with the same key is not computed
again, so an interrupted run resumes. Bytes per token: (layers × h × dtype size) + 5.

Training reads samples in the order ``permuted_indices`` gives, exactly as online training does, and the
recipes' losses see a ``StoredTarget`` in place of the target: the same code path, fed stored states.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from treespec.io import atomic_write, atomic_write_json, file_digest, read_json, remove_stale_temps
from treespec.train.training.data import CollatedBatches

FORMAT = "treespec-features-1"
INDEX = "index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- what is stored: samples -------------------------------------------------------------------------------
class WindowSamples:
    """Fixed-length windows (corpus text) as samples: rows of a [n, S] tensor, or a ``TokenBatches``'
    windows (read on demand); no loss mask (every position is trained on)."""

    masked = False

    def __init__(self, windows=None, *, batches=None):
        self._windows, self._batches = windows, batches
        self.width = batches.seq_len + 1 if batches is not None else windows.shape[1]
        self.n = batches.n_windows if batches is not None else windows.shape[0]

    def __len__(self) -> int:
        return self.n

    @property
    def n_tokens(self) -> int:
        return self.n * self.width

    def lengths(self) -> torch.Tensor:
        return torch.full((self.n,), self.width, dtype=torch.int64)

    def sample(self, i: int):
        row = self._batches.windows(torch.tensor([i]))[0] if self._batches is not None else self._windows[i]
        return row.long(), None

    def digest(self) -> str:
        h = hashlib.sha1(f"windows {self.n}x{self.width}".encode())
        step = max(1, self.n // 64)  # a sample of rows: enough to tell streams apart, cheap on big corpora
        for i in range(0, self.n, step):
            h.update(self.sample(i)[0].to(torch.int32).numpy().tobytes())
        return h.hexdigest()


def split_layers(layers, n_layers: int) -> list[int]:
    """hidden_states indices (negative ones from the end) → sorted non-negative ones, the last (L) included."""
    return sorted({int(i) % (n_layers + 1) for i in layers} | {n_layers})


def bytes_per_token(layers, hidden_size: int, dtype: torch.dtype, masked: bool = True) -> int:
    return len(layers) * hidden_size * torch.empty((), dtype=dtype).element_size() + 4 + (1 if masked else 0)


# -- writing ---------------------------------------------------------------------------------------------
@torch.no_grad()
def _shard(target, samples, first: int, last: int, layers, dtype, batch_size: int, pad_id: int) -> dict:
    """The tensors of one shard: samples [first, last) run through the target in length-sorted batches."""
    index = list(range(first, last))
    lengths = {i: int(samples.sample(i)[0].shape[0]) for i in index}
    order = sorted(index, key=lambda i: (lengths[i], i))
    states: dict[int, dict[int, torch.Tensor]] = {}
    for b in range(0, len(order), batch_size):
        chunk = order[b : b + batch_size]
        width = max(lengths[i] for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : lengths[i]] = samples.sample(i)[0]
        out = target.base_model(input_ids=ids.to(target.device), output_hidden_states=True)
        for row, i in enumerate(chunk):
            states[i] = {layer: out.hidden_states[layer][row, : lengths[i]].to("cpu", dtype) for layer in layers}
    tokens = [samples.sample(i) for i in index]
    tensors = {"input_ids": torch.cat([t.to(torch.int32) for t, _ in tokens]),
               "offsets": torch.tensor([0] + [lengths[i] for i in index], dtype=torch.int64).cumsum(0)}
    if samples.masked:
        tensors["loss_mask"] = torch.cat([m.to(torch.uint8) for _, m in tokens])
    for layer in layers:
        tensors[f"hidden.{layer}"] = torch.cat([states[i][layer] for i in index]).contiguous()
    return tensors


def prepare(target, splits: dict, layers, folder: str | os.PathLike, *, key: dict, dtype: str = "float32",
            batch_size: int = 8, shard_samples: int = 256, pad_id: int = 0, rank: int = 0, world_size: int = 1,
            barrier=None, progress: bool = True) -> dict | None:
    """Write the features of ``splits`` ({name: samples}) under ``folder`` (module docstring); returns the
    index (rank 0) once every shard of every rank is written (``barrier`` waits for the others)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)  # a killed run's half-written shard
    torch_dtype = DTYPES[dtype]
    layers = split_layers(layers, target.config.num_hidden_layers)
    h = target.config.hidden_size
    key = {**key, "layers": layers, "dtype": dtype, "format": FORMAT}
    key_sha1 = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    masked = any(s.masked for s in splits.values())
    per_token = bytes_per_token(layers, h, torch_dtype, masked)
    total = sum(s.n_tokens for s in splits.values())
    if rank == 0:
        free = shutil.disk_usage(folder).free
        print(f"features: {sum(map(len, splits.values()))} samples, {total} tokens × {per_token} bytes/token "
              f"(hidden_states {layers} × {h} {dtype}) ≈ {total * per_token / 1e9:.2f} GB in {folder} "
              f"({free / 1e9:.1f} GB free)")
        if total * per_token > free:
            print(f"warning: the features need {total * per_token / 1e9:.2f} GB but {folder} has "
                  f"{free / 1e9:.1f} GB free")
    jobs = []
    for name, samples in splits.items():
        for k, first in enumerate(range(0, len(samples), shard_samples)):
            jobs.append((name, k, first, min(len(samples), first + shard_samples)))
    mine = [j for i, j in enumerate(jobs) if i % world_size == rank]
    bar = tqdm(total=sum(b - a for _, _, a, b in mine), disable=not progress or rank != 0, desc="target features",
               unit="sample", dynamic_ncols=True)
    for name, k, first, last in mine:
        stem = f"{name}-{k:05d}"
        sidecar = folder / f"{stem}.json"
        if sidecar.is_file():
            try:
                if read_json(sidecar, "feature shard")["key_sha1"] == key_sha1 and (folder / f"{stem}.safetensors"
                                                                                      ).is_file():
                    bar.update(last - first)
                    continue
            except (ValueError, KeyError):
                pass
        tensors = _shard(target, splits[name], first, last, layers, torch_dtype, batch_size, pad_id)
        path = atomic_write(folder / f"{stem}.safetensors", lambda tmp, t=tensors: save_file(t, str(tmp)))
        atomic_write_json(sidecar, {"key_sha1": key_sha1, "split": name, "shard": k, "first": first,
                                    "samples": last - first, "tokens": int(tensors["offsets"][-1]),
                                    "file": path.name, "sha1": file_digest(path)}, indent=1)
        bar.update(last - first)
    bar.close()
    if barrier is not None:
        barrier()
    if rank != 0:
        return None
    index = {"format": FORMAT, "key": key, "key_sha1": key_sha1, "layers": layers, "hidden_size": h, "dtype": dtype,
             "bytes_per_token": per_token, "splits": {}}
    for name, samples in splits.items():
        shards = []
        for k in range((len(samples) + shard_samples - 1) // shard_samples):
            meta = read_json(folder / f"{name}-{k:05d}.json", "feature shard")
            if meta["key_sha1"] != key_sha1:
                raise ValueError(f"feature shard {folder / meta['file']} belongs to another preparation")
            shards.append({k2: meta[k2] for k2 in ("file", "first", "samples", "tokens", "sha1")})
        index["splits"][name] = {"samples": len(samples), "tokens": sum(s["tokens"] for s in shards),
                                 "masked": samples.masked, "digest": samples.digest(), "shards": shards}
    atomic_write_json(folder / INDEX, index, indent=1)
    return index


# -- reading ---------------------------------------------------------------------------------------------
class FeatureSplit:
    """One split of a features folder: samples by global index, read lazily from memory-mapped shards."""

    def __init__(self, folder: Path, meta: dict, layers, hidden_size: int, dtype: str):
        self.folder, self.meta, self.layers = folder, meta, list(layers)
        self.hidden_size, self.dtype = int(hidden_size), DTYPES[dtype]
        self.masked = bool(meta["masked"])
        self.n = int(meta["samples"])
        self._firsts = [int(s["first"]) for s in meta["shards"]]
        self._handles: dict[int, tuple] = {}

    def __len__(self) -> int:
        return self.n

    def lengths(self) -> torch.Tensor:
        """[n] int64: every sample's token count (from the shards' offsets; what packing plans with)."""
        pieces = []
        for k in range(len(self.meta["shards"])):
            offsets = self._shard(k)[1]
            pieces.append(offsets[1:] - offsets[:-1])
        return (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64))[: self.n]

    def first(self, k: int) -> FeatureSplit:
        """The split's first ``k`` samples (a training subset, ``data.chat.train_conversations``)."""
        if not 0 <= k <= self.n:
            raise ValueError(f"the first {k} of {self.n} stored samples")
        view = copy.copy(self)  # the same open shards
        view.n = k
        return view

    def _shard(self, k: int):
        if k not in self._handles:
            path = self.folder / self.meta["shards"][k]["file"]
            if not path.is_file():
                raise ValueError(f"feature shard {path} does not exist")
            try:
                f = safe_open(str(path), framework="pt", device="cpu")
                self._handles[k] = (f, f.get_tensor("offsets"))
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"feature shard {path} cannot be read ({err}): truncated or corrupt? Delete it and "
                                 "its .json sidecar and rerun scripts/prepare_features.py to write it again") from None
        return self._handles[k]

    def sample(self, i: int) -> dict:
        """Sample ``i``: {"input_ids" [n] long, "loss_mask" [n] bool (chat), "hidden.<l>" [n, h]}."""
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        k = max(j for j, first in enumerate(self._firsts) if first <= i)
        f, offsets = self._shard(k)
        a, b = int(offsets[i - self._firsts[k]]), int(offsets[i - self._firsts[k] + 1])
        out = {"input_ids": f.get_slice("input_ids")[a:b].long()}
        if self.masked:
            out["loss_mask"] = f.get_slice("loss_mask")[a:b].bool()
        for layer in self.layers:
            out[f"hidden.{layer}"] = f.get_slice(f"hidden.{layer}")[a:b]
        return out

    def collate(self, indices, pad_id: int = 0) -> dict:
        """Rows ``indices`` right-padded to the longest, as ``chat.Samples.collate`` plus the stored states."""
        rows = [self.sample(int(i)) for i in torch.as_tensor(indices).reshape(-1)]
        width = max((r["input_ids"].shape[0] for r in rows), default=0)
        n = len(rows)
        out = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long)}
        if self.masked:
            out["loss_mask"] = torch.zeros(n, width, dtype=torch.bool)
            out["attention_mask"] = torch.zeros(n, width, dtype=torch.bool)
        for layer in self.layers:
            out[f"hidden.{layer}"] = torch.zeros(n, width, self.hidden_size, dtype=self.dtype)
        for row, r in enumerate(rows):
            m = r["input_ids"].shape[0]
            for name, value in r.items():
                out[name][row, :m] = value
            if self.masked:
                out["attention_mask"][row, :m] = True
        return out

    def input_ids(self) -> list[torch.Tensor]:
        return [self.sample(i)["input_ids"] for i in range(self.n)]

    def trained_tokens(self) -> torch.Tensor:
        """Tokens under the loss mask (all of them for corpus windows): a draft vocabulary's statistics."""
        pieces = []
        for k in range(len(self.meta["shards"])):
            if self._firsts[k] >= self.n:
                break
            f, offsets = self._shard(k)
            end = int(offsets[min(self.n - self._firsts[k], len(offsets) - 1)])  # a subset may end inside a shard
            ids = f.get_slice("input_ids")[:end]
            pieces.append(ids[f.get_slice("loss_mask")[:end].bool()] if self.masked else ids)
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)


class FeatureStore:
    """A features folder written by ``prepare``: its index, checked against the run that reads it."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index_path = self.folder / INDEX
        if not index_path.is_file():
            raise ValueError(f"{index_path} does not exist: {self.folder} is not a finished features folder "
                             "(run scripts/prepare_features.py with the same overrides; it resumes where it stopped)")
        self.index = read_json(index_path, "features index", dict)
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{index_path}: format {self.index.get('format')!r}, expected {FORMAT!r}")
        self.layers = list(self.index["layers"])

    def split(self, name: str) -> FeatureSplit:
        if name not in self.index["splits"]:
            raise ValueError(f"features in {self.folder} have splits {sorted(self.index['splits'])}, not {name!r}")
        return FeatureSplit(self.folder, self.index["splits"][name], self.layers, self.index["hidden_size"],
                            self.index["dtype"])

    def check(self, key: dict, layers) -> None:
        """Raise ValueError unless these features were computed by the same target on the same data and hold
        every hidden state in ``layers``."""
        saved = self.index["key"]
        diff = sorted(k for k in key if json.dumps(saved.get(k), sort_keys=True, default=str)
                      != json.dumps(key[k], sort_keys=True, default=str))
        if diff:
            details = "; ".join(f"{k}: stored {saved.get(k)!r}, now {key[k]!r}" for k in diff)
            raise ValueError(f"features in {self.folder} were prepared for another run ({details[:600]}); prepare "
                             "them again with scripts/prepare_features.py and the same overrides as training")
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise ValueError(f"features in {self.folder} hold hidden_states {self.layers}; this drafter also needs "
                             f"{missing}: prepare them again for this drafter")


class FeatureBatches(CollatedBatches):
    """Deterministic batches of stored samples: the same ``permuted_indices`` as online training."""

    def __init__(self, split: FeatureSplit, batch_size: int, seed: int = 0, pad_id: int = 0):
        super().__init__(split, batch_size, seed, pad_id, what="stored training samples")


