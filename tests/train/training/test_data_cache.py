"""Caches keyed by content: the token cache by the corpus files' bytes, the self-distillation cache by
the target's weights and the prompt stream; neither is ever unpickled."""

import json
import os
import time

import torch

from treespec.corpus import corpus_files, load_corpus
from treespec.io import weights_digest
from treespec.train.training import data
from treespec.train.training.data import corpus_digest, prepare_tokens, self_distill

from tests.helpers import tiny_llama


def make_corpus(root):
    root.mkdir()
    for i in range(6):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i}\n" * 20)
    return {"source": str(root), "pattern": "*.py", "val_fraction": 0.2, "max_files": None}


def count_loads(monkeypatch) -> list:
    calls, real = [], data.load_corpus
    monkeypatch.setattr(data, "load_corpus", lambda **kw: calls.append(kw) or real(**kw))
    return calls


def test_token_cache_is_keyed_by_file_contents(tmp_path, monkeypatch, forbid_unpickling):
    forbid_unpickling()
    cfg, cache = make_corpus(tmp_path / "corpus"), tmp_path / "cache"
    loads = count_loads(monkeypatch)
    _, train1, val1 = prepare_tokens(cfg, 300, cache)
    _, train2, val2 = prepare_tokens(cfg, 300, cache)
    assert len(loads) == 1 and torch.equal(train1, train2) and torch.equal(val1, val2)  # a cache hit
    assert train1.dtype == torch.int32
    assert [p.name for p in cache.glob("tokens-*/*") if p.is_file()] == ["tokens.safetensors"]

    # an edit that keeps size and mtime: only the contents say the corpus changed
    victim = tmp_path / "corpus" / "m0.py"
    stat, text = victim.stat(), victim.read_text()
    victim.write_text(text.replace("return x * 0", "return y * 0"))
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert victim.stat().st_size == stat.st_size and victim.stat().st_mtime_ns == stat.st_mtime_ns
    tok, train3, val3 = prepare_tokens(cfg, 300, cache)
    assert len(loads) == 2
    assert "y * 0" in tok.decode(torch.cat([train3, val3]).tolist())

    # a grown file
    with open(victim, "a") as f:
        f.write("z = 1\n")
    tok, train4, val4 = prepare_tokens(cfg, 300, cache)
    assert len(loads) == 3 and "z = 1" in tok.decode(torch.cat([train4, val4]).tolist())


def test_corrupt_token_cache_is_rebuilt(tmp_path, monkeypatch, capsys):
    cfg, cache = make_corpus(tmp_path / "corpus"), tmp_path / "cache"
    _, train1, _ = prepare_tokens(cfg, 300, cache)
    (tokens_file,) = cache.glob("tokens-*/tokens.safetensors")
    tokens_file.write_bytes(tokens_file.read_bytes()[:-20])
    loads = count_loads(monkeypatch)
    _, train2, _ = prepare_tokens(cfg, 300, cache)
    assert len(loads) == 1 and torch.equal(train1, train2)
    assert f"token cache {tokens_file} is unusable" in capsys.readouterr().out


def test_corpus_digest_sees_contents_names_and_file_sets(tmp_path):
    cfg = make_corpus(tmp_path / "corpus")
    base = corpus_digest(**cfg)
    assert corpus_digest(**cfg) == base
    (tmp_path / "corpus" / "m1.py").rename(tmp_path / "corpus" / "n1.py")
    renamed = corpus_digest(**cfg)
    assert renamed != base
    (tmp_path / "corpus" / "extra.py").write_text("")
    assert corpus_digest(**cfg) != renamed
    assert corpus_digest(**{**cfg, "max_files": 2}) != corpus_digest(**cfg)


def test_corpus_files_are_rglobs_without_site_packages(tmp_path):
    """The walk that skips site-packages folders reads exactly what rglob and the filter read: nested and hidden
    files, not a symlinked folder's, nor a folder named like a file."""
    root = tmp_path / "lib"
    for name in ("a.py", "b.txt", ".hidden.py", "x/c.py", "x/y/d.py", "site-packages/pkg/e.py", "x/site-packages/f.py",
                 "z.py/g.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (root / "linked").symlink_to(root / "x", target_is_directory=True)
    (root / "h.py").symlink_to(root / "a.py")
    rglob = sorted(p for p in root.rglob("*.py") if p.is_file() and "site-packages" not in p.parts)
    assert corpus_files(str(root), "*.py", None) == (root, rglob)
    assert [p.relative_to(root).as_posix() for p in rglob] == [".hidden.py", "a.py", "h.py", "x/c.py", "x/y/d.py"]
    assert corpus_files(str(root), "*.py", 2)[1] == rglob[:2]


def test_a_jsonl_corpus_splits_by_row_content_wherever_it_lives(tmp_path):
    """A JSONL row's split is a hash of the row itself: the same file in two folders (a test's tmp_path, a user's
    copy on another machine) holds out the same rows, and a row keeps its side when others are added before it."""
    rows = [json.dumps({"text": f"document {i}"}) for i in range(60)]
    for folder in ("a", "b/c"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "corpus.jsonl").write_text("\n".join(rows))
    held = [[t for _, t in load_corpus(str(tmp_path / f / "corpus.jsonl"), val_fraction=0.3).val] for f in ("a", "b/c")]
    assert held[0] == held[1] and 5 < len(held[0]) < 40
    (tmp_path / "a" / "corpus.jsonl").write_text("\n".join([json.dumps({"text": "new"})] + rows))
    assert set(held[0]) <= {t for _, t in load_corpus(str(tmp_path / "a" / "corpus.jsonl"), val_fraction=0.3).val}


DISTILL = dict(n_prompts=2, prompt_tokens=4, new_tokens=3, temperature=0.0, batch_size=2, seed=0, eos_token_id=1)


def test_self_distill_cache_is_keyed_by_weights_and_tokens(tmp_path, monkeypatch, forbid_unpickling):
    forbid_unpickling()
    target = tiny_llama(vocab=32, hidden=16, layers=1)
    tokens = torch.randint(0, 32, (200,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    generated, real = [], target.generate
    monkeypatch.setattr(target, "generate", lambda *a, **kw: generated.append(1) or real(*a, **kw))

    stream = self_distill(target, tokens, cache_dir=tmp_path, **DISTILL)
    assert stream.dtype == torch.int32 and len(stream) == 2 * (4 + 3 + 1)
    assert len(generated) == 1 and len(list(tmp_path.glob("distill-*.safetensors"))) == 1
    assert torch.equal(self_distill(target, tokens, cache_dir=tmp_path, **DISTILL), stream)
    assert len(generated) == 1  # served from the cache
    self_distill(target, tokens, cache_dir=tmp_path, **{**DISTILL, "temperature": 0})  # a command line's 0
    assert len(generated) == 1  # the same file: temperature 0 and 0.0 are one setting

    with torch.no_grad():  # one weight of the target changes: a new cache entry
        target.model.norm.weight[0] += 0.5
    self_distill(target, tokens, cache_dir=tmp_path, **DISTILL)
    assert len(generated) == 2

    edited = tokens.clone()  # same length, one token different
    edited[-1] = (edited[-1] + 1) % 32
    self_distill(target, edited, cache_dir=tmp_path, **DISTILL)
    assert len(generated) == 3

    self_distill(target, tokens, cache_dir=tmp_path, **{**DISTILL, "new_tokens": 4})
    assert len(generated) == 4 and len(list(tmp_path.glob("distill-*.safetensors"))) == 4

    for f in tmp_path.glob("distill-*.safetensors"):  # a cut cache file is regenerated, not trusted
        f.write_bytes(f.read_bytes()[:-8])
    self_distill(target, tokens, cache_dir=tmp_path, **{**DISTILL, "new_tokens": 4})
    assert len(generated) == 5


def test_weights_digest_sees_every_weight_and_is_fast():
    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert weights_digest(a) == weights_digest(b)
    with torch.no_grad():
        b.lm_head.weight[3, 4] += 1e-3
    assert weights_digest(b) != weights_digest(a)
    c = tiny_llama(seed=0)
    c.model.rotary_emb.inv_freq.mul_(2)  # a buffer
    assert weights_digest(c) != weights_digest(a)
    assert weights_digest(tiny_llama(seed=0).to(torch.bfloat16)) != weights_digest(a)  # a dtype

    big = torch.nn.Sequential(torch.nn.Linear(3872, 3872), torch.nn.LayerNorm(3872))  # 15M parameters
    assert sum(p.numel() for p in big.parameters()) > 15e6
    t0 = time.perf_counter()
    digest = weights_digest(big)
    assert time.perf_counter() - t0 < 1.0 and len(digest) == 40
