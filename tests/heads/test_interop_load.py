"""Loading upstream drafter checkpoints (heads/checkpoints/detect.py, heads/registry.py, heads/eagle/upstream.py,
heads/medusa/upstream.py; the exports: tests/heads/test_interop_export.py).

Nothing is downloaded: every upstream checkpoint is synthesised (tests/helpers/upstream_checkpoints.py) with the
exact key names and config fields its project writes, for tiny random Llama and Qwen2 targets. Each loaded
drafter is checked against a reference forward written from the published equations (plain tensor ops, no
transformers or treespec modules): its logits, the tokens of every proposal (rank r = the reference's r-th
likeliest token) and, sampling, its q_draft; greedy generation must equal vanilla, and a loaded checkpoint
drives sampling that passes a chi-square test. Corrupt, truncated, mismatched and unknown checkpoints each get
their error.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import load, registry
from treespec.heads.checkpoints import detect as detect_module
from treespec.heads.eagle3.network import build_vocab_map
from treespec.heads.medusa import MedusaHeads
from treespec.sampling import Sampling

from tests.helpers import (
    INTEROP_PROMPT,
    UPSTREAM_CASES,
    VOCAB,
    check_proposal,
    chi2_pvalue,
    eagle1_official,
    eagle3_layer,
    eagle3_specforge,
    eagle3_speculators,
    exact_distribution,
    fresh_drafter,
    hf_greedy,
    interop_targets,
    medusa1,
    norm_w,
    proposals_of,
    recorded_run,
    rnd,
    sampled_counts,
    speculators_config,
    synthesise,
    target_hidden_states,
    tiny_llama,
    tiny_qwen2,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def targets():
    return interop_targets()


@pytest.mark.parametrize("name", list(UPSTREAM_CASES))
def test_upstream_checkpoint_matches_the_published_equations(name, tmp_path, targets):
    target, folder, reference, fmt = synthesise(name, tmp_path, targets)
    assert registry.detect(folder).format == fmt
    drafter = load(folder, target)
    assert isinstance(getattr(drafter, "model", getattr(drafter, "heads", None)), UPSTREAM_CASES[name][2])
    tree = Tree.full(2, 2) if fmt != "medusa" else Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    out, seen = recorded_run(drafter, target, tree)
    assert torch.equal(out.sequences, hf_greedy(target, INTEROP_PROMPT, 12))  # greedy equals vanilla
    assert sum(check_proposal(c, p, reference) for c, p in seen[:3]) >= 3
    if fmt != "medusa":  # the dynamic default tree too, and the logits themselves
        out, seen = recorded_run(drafter, target, DynamicTree(6, 3, 2), max_new_tokens=6)
        assert torch.equal(out.sequences, hf_greedy(target, INTEROP_PROMPT, 6))
        check_proposal(*seen[0], reference)
        model, committed = drafter.model, seen[0][0]
        states = target_hidden_states(target, committed[:, :-1])
        feats = model.fuse(torch.cat([states[i] for i in model.feature_layers], -1))
        with torch.no_grad():
            mine = model.logits(model(committed[:, 1:], feats)[0, -1])
        ref = reference(committed, [])
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(mine)) and torch.allclose(mine[finite], ref[finite], atol=1e-4)


@pytest.mark.parametrize("name", ["eagle1-official-llama", "eagle3-speculators-llama", "eagle3-specforge-qwen2"])
def test_sampled_candidates_carry_the_reference_distribution(name, tmp_path, targets):
    target, folder, reference, _ = synthesise(name, tmp_path, targets)
    drafter = load(folder, target, candidates="sample")
    sampling = Sampling(1.0)
    _, seen = recorded_run(drafter, target, Tree.full(2, 2), max_new_tokens=5, temperature=1.0,
                           generator=torch.Generator().manual_seed(0))
    assert all(p.q_draft is not None for _, p in seen)
    assert sum(check_proposal(c, p, reference, sampling) for c, p in seen[:2]) >= 4


# -- sampling is lossless (chi-square on a 4-token vocabulary) ----------------------------------------------------
def test_sampling_is_lossless_for_a_loaded_checkpoint(tmp_path):
    """A speculators EAGLE-3 checkpoint (3-of-4 draft vocabulary, norm_before_residual, sampled candidates verified
    with SpecInfer's rule) drives sampling whose output is exactly the target's distribution. 1,200 runs, as
    tests/heads/eagle3/test_eagle3.py: enough to catch a q_draft off by 0.15 (the harness's own negative control is in
    tests/test_lossless.py)."""
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=2, seed=11, init_std=0.1)
    g = torch.Generator().manual_seed(5)
    d2t, t2d = build_vocab_map(torch.tensor([0, 5, 3, 9]), 3)
    t = {"fc.weight": rnd(g, 16, 48, scale=0.5), **eagle3_layer(g, 16, 2, 2, 8, 32, prefix="layers.0."),
         "norm.weight": norm_w(g, 16), "lm_head.weight": rnd(g, 3, 16, scale=1.5), "d2t": d2t, "t2d": t2d}
    c_layer = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
               "num_key_value_heads": 2, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB}
    write_checkpoint(tmp_path / "e3", speculators_config(c_layer, 3, [1, 1, 2], True, h=16), t, "model.safetensors")
    drafter = load(tmp_path / "e3", small, candidates="sample")
    assert drafter.model.draft_ids.tolist() == [1, 2, 3] and drafter.model.norm_before_residual
    sampling = Sampling(1.0)
    counts = sampled_counts(small, drafter, Tree.full(2, 2), sampling, runs=1200)
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3



# -- errors on load ---------------------------------------------------------------------------------------------
class Boom:
    """Unpickling this would create a file; torch.load(weights_only=True) must refuse it first."""

    def __reduce__(self):
        return (Path.touch, (Path("/tmp/treespec_interop_pwned"),))


def test_broken_checkpoints_are_errors_naming_what_is_wrong(tmp_path, targets):
    llama, qwen = targets["llama"], targets["qwen2"]
    good, _, _ = eagle1_official(tmp_path / "good", llama, torch.Generator().manual_seed(0))

    def copy(name):
        folder = tmp_path / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    bad = copy("truncated-bin")
    (bad / "pytorch_model.bin").write_bytes((good / "pytorch_model.bin").read_bytes()[:500])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be read with torch\.load\(weights_only=True\)"):
        load(bad, llama)
    bad = copy("code-in-pickle")
    Path("/tmp/treespec_interop_pwned").unlink(missing_ok=True)
    torch.save({"fc.weight": torch.zeros(2), "x": Boom()}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        load(bad, llama)
    assert not Path("/tmp/treespec_interop_pwned").exists()
    bad = copy("nan")
    weights = torch.load(good / "pytorch_model.bin", weights_only=True)
    weights["fc.bias"][0] = float("nan")
    torch.save(weights, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match="'fc.bias' holds non-finite values"):
        load(bad, llama)
    bad = copy("corrupt-safetensors")
    (bad / "pytorch_model.bin").unlink()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match=r"model\.safetensors cannot be read as safetensors"):
        load(bad, llama)
    bad = copy("truncated-config")
    (bad / "config.json").write_text('{"num_attention_heads": 2, "rms_n')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load(bad, llama)
    bad = copy("bias-flag")
    (bad / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "bias": False}))
    with pytest.raises(ValueError, match=r"says fc has no bias .* fc\.bias is present"):
        load(bad, llama)
    with pytest.raises(ValueError, match=r"fc\.weight is \(32, 64\); a drafter for this target \(hidden size 48\)"):
        load(good, tiny_llama(hidden=48, layers=4))
    with pytest.raises(ValueError, match="vocabulary of 64 tokens .* the target has 80"):
        load(good, tiny_llama(vocab=80, layers=4))
    with pytest.raises(ValueError, match="format='eagle3' was asked for, but .* holds a 'eagle' checkpoint"):
        load(good, llama, format="eagle3")
    e3, _, _ = eagle3_specforge(tmp_path / "e3", qwen, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"aux layers \[1, 2, 3\] .* do not exist in a 2-layer target"):
        load(e3, tiny_qwen2(layers=2))
    weights = load_file(e3 / "model.safetensors")
    del weights["model.d2t"], weights["model.t2d"]
    save_file(weights, str(e3 / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary of 48 tokens .* needs d2t"):
        load(e3, qwen)
    spec, _, _ = eagle3_speculators(tmp_path / "spec", llama, torch.Generator().manual_seed(2))
    config = json.loads((spec / "config.json").read_text())
    del config["norm_before_residual"]
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks norm_before_residual, which vLLM reads as true"):
        load(spec, llama)
    unknown = write_checkpoint(tmp_path / "unknown", {"model_type": "gpt2"}, {"wte.weight": torch.zeros(4, 2)},
                    "model.safetensors")
    with pytest.raises(ValueError, match=r"unrecognised drafter layout \(tensors: wte\.weight\)"):
        load(unknown, llama)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no drafter weights found"):
        load(tmp_path / "empty", llama)
    with pytest.raises(FileNotFoundError, match="no such folder, and not a Hugging Face Hub repo id"):
        load(tmp_path / "missing" / "deeper", llama)
    m1, _, _ = medusa1(tmp_path / "m1", llama, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"lm_head of head 0 is \(64, 32\); this target needs \[80, 32\]"):
        load(m1, tiny_llama(vocab=80, layers=4))
    with pytest.raises(ValueError, match=r"drafter 'medusa' takes candidates in \('topk',\), got 'sample'"):
        load(m1, llama, candidates="sample")


def test_hub_ids_download_or_explain_how_to_pass_a_folder(tmp_path, targets, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    llama = targets["llama"]
    folder, _, _ = medusa1(tmp_path / "hub", llama, torch.Generator().manual_seed(0))
    asked = []

    def offline(repo_id, **kwargs):
        asked.append(repo_id)
        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic has "
                                      "been disabled.")

    monkeypatch.setattr(detect_module, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match=r"could not be fetched from the Hugging Face Hub .* pass the folder: "
                                                r"treespec\.heads\.load\('DIR', target\)"):
        load("someone/medusa-heads", llama)
    monkeypatch.setattr(detect_module, "snapshot_download", lambda repo_id, **kwargs: asked.append(repo_id) or folder)
    assert isinstance(load("someone/medusa-heads", llama).heads, MedusaHeads)
    assert asked == ["someone/medusa-heads"] * 2


# -- treespec's own formats and the registry ----------------------------------------------------------------------
def test_treespec_folders_and_the_registry(tmp_path, targets):

    llama = targets["llama"]
    model = fresh_drafter("eagle", llama)
    model.save_pretrained(tmp_path / "mine")
    saved = json.loads((tmp_path / "mine" / "eagle_config.json").read_text())
    assert saved["variant"] == "upstream" and saved["layer_overrides"] == {"num_hidden_layers": 2}
    assert registry.detect(tmp_path / "mine").format == "treespec"
    back = load(tmp_path / "mine", llama)
    assert proposals_of(back, llama) == proposals_of(registry.AUTO.make(model), llama)
    # an upstream EAGLE-3 whose layer differs from the target's (own table, norm_before_residual) round-trips too
    _, spec, _, _ = synthesise("eagle3-speculators-llama", tmp_path, targets)
    up = load(spec, llama).model
    up.save_pretrained(tmp_path / "up3")
    assert proposals_of(load(tmp_path / "up3", llama), llama) == proposals_of(registry.AUTO.make(up), llama)
    kind = registry.get("auto")
    drafter = registry.build("auto", llama, source=str(spec), candidates="sample")
    assert drafter.candidates == "sample" and kind.max_depth(drafter.model) is None
    windows = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    acc = kind.rank_accuracy(llama, drafter.model, windows, depth=2, top_k=3)
    assert len(acc) == 2 and all(len(row) == 3 for row in acc)
    medusa = registry.load_module("auto", llama, source=str(synthesise("medusa1-llama", tmp_path, targets)[1]))
    assert kind.max_depth(medusa) == 3 and kind.rank_accuracy(llama, medusa, windows, top_k=2)


def test_shipped_eagle_drafter_still_loads_as_the_treespec_variant():
    from treespec import reference

    target, _ = reference.load("target")
    model = load(reference.MODELS_DIR / "eagle", target).model
    assert model.variant == "treespec" and "variant" not in model.config
    assert not any(re.match(r"embed_tokens", k) for k in model.state_dict())



def test_norm_output_is_read_by_the_convention_of_its_writer(tmp_path, targets):
    """SpecForge's trainer reads norm_output (default true) as 'the final norm before lm_head'; SGLang's server
    and speculators (default false) as EAGLE 3.1. Absent, all mean plain EAGLE-3."""
    qwen = targets["qwen2"]
    folder, reference, _ = eagle3_specforge(tmp_path / "sf", qwen, torch.Generator().manual_seed(1))
    config = json.loads((folder / "config.json").read_text())
    plain = proposals_of(load(folder, qwen), qwen)

    def with_config(name, **fields):
        out = tmp_path / name
        out.mkdir()
        (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out

    specforge_true = with_config("sf-true", norm_output=True)
    with pytest.raises(ValueError, match=r"norm_output: true in a LlamaForCausalLMEagle3 config is ambiguous.*"
                                         r"written_by='specforge'.*written_by='serving'.*--written-by"):
        load(specforge_true, qwen)
    assert proposals_of(load(specforge_true, qwen, written_by="specforge"), qwen) == plain
    with pytest.raises(ValueError, match=r"norm_output: true \(EAGLE 3\.1"):
        load(specforge_true, qwen, written_by="serving")
    specforge_false = with_config("sf-false", norm_output=False)
    with pytest.raises(ValueError, match=r"norm_output: false \(SpecForge: lm_head on the un-normed output"):
        load(specforge_false, qwen, written_by="specforge")
    assert proposals_of(load(specforge_false, qwen, written_by="serving"), qwen) == plain
    vllm = with_config("vllm", norm_output=False, architectures=["Eagle3LlamaForCausalLM"])
    assert proposals_of(load(vllm, qwen), qwen) == plain  # vLLM's class: the serving convention, no flag needed
    with pytest.raises(ValueError, match="written_by must be one of"):
        load(vllm, qwen, written_by="sglang-ish")
    spec, _, _ = eagle3_speculators(tmp_path / "spec", targets["llama"], torch.Generator().manual_seed(2))
    spec_config = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({**spec_config, "norm_output": True}))
    with pytest.raises(ValueError, match=r"norm_output: true \(EAGLE 3\.1"):
        load(spec, targets["llama"])
    with pytest.raises(ValueError, match="written_by applies to upstream EAGLE-3 checkpoints"):
        load(synthesise("medusa1-llama", tmp_path / "m", targets)[1], targets["llama"], written_by="specforge")
