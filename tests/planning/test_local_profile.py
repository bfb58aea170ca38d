"""A drafter's profile measured once on first use and cached per machine, target and drafter
(heads/checkpoints/local_profile.py,
treespec/planning/profile_cache.py), and tree=auto with it: the cost model when the folder has none measured here, the
chain τ of sampled candidates when auto first needs it, and the error when neither is possible. Timings are faked
or only counted: nothing here asserts a speed."""

import json
from pathlib import Path

import pytest
import torch

from treespec import generate
from treespec.heads import load, load_profile
from treespec.heads.checkpoints import local_profile
from treespec.heads.eagle import EagleModel
from treespec.heads.training.accuracy import write_accuracy
from treespec.linear_kernels import use_linear_kernel
from treespec.planning import chain_tau
from treespec.planning.autotree import CostModel, EngineCost, auto_chooser, read_cost_curve, save_cost_curve
from treespec.planning.profile import DrafterProfile
from treespec.planning.profile_cache import fingerprint, machine, measured_here
from treespec.planning.tree_spec import build_tree
from treespec.sampling import Sampling
from treespec.tree import Tree

from tests.helpers import tiny_llama

ACC = [[0.9, 0.05], [0.8, 0.1], [0.7], [0.6]]
# a flat curve and a cheap drafter: auto takes a deep tree; the engine's fields ride along
FAKE = CostModel({1: 1e-3, 8: 1e-3, 64: 1.1e-3}, 1e-5, 1e-5, 1e-3, EngineCost(2e-4, 3e-4, 1e-6))


@pytest.fixture
def eagle_folder(tmp_path, monkeypatch):
    """(target, a tiny EAGLE's folder with accuracies and no cost curve); the cache in tmp_path."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(seed=0)
    torch.manual_seed(0)
    folder = tmp_path / "eagle"
    EagleModel(target).eval().save_pretrained(folder)
    write_accuracy(folder, ACC)
    return target, folder


def counting(monkeypatch, module, name, result=None):
    """Replace ``module.name`` by a counter returning ``result`` (or calling through when None)."""
    calls, real = [], getattr(module, name)

    def fake(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs) if result is None else result

    monkeypatch.setattr(module, name, fake)
    return calls


def test_a_missing_cost_curve_is_measured_once_and_auto_uses_it(eagle_folder, monkeypatch):
    target, folder = eagle_folder
    calls = counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    profile = load_profile(folder, target, log=lambda *_: None)
    assert len(calls) == 1 and profile.costs == FAKE
    again = load_profile(folder, target, log=lambda *_: None)  # cached: not measured again
    assert len(calls) == 1 and again.costs == FAKE
    assert read_cost_curve(folder) is None  # the folder is left as it was: the cache holds it
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    out = generate(target, prompt, drafter=load(folder, target), tree={"kind": "auto", "max_nodes": 6},
                   profile=again, max_new_tokens=8)
    assert out.tree == auto_chooser(FAKE)(ACC, 6) and len(out.tree) == 6  # the same numbers, the same tree
    assert torch.equal(out.sequences, generate(target, prompt, max_new_tokens=8).sequences)
    # another target (other weights) is another entry; without a target nothing is measured
    load_profile(folder, tiny_llama(seed=1), log=lambda *_: None)
    assert len(calls) == 2 and load_profile(folder).tree_chooser is None and len(calls) == 2


def test_a_folders_own_curve_is_used_only_when_measured_here(eagle_folder, monkeypatch):
    """Training writes the curve beside the drafter with the machine, the target's kernels, the target and the
    drafter's weights: such a file is used as it is; one without them (measured elsewhere, on other kernels, or before
    they were written) is measured again."""
    target, folder = eagle_folder
    calls = counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    mine = CostModel({1: 2e-3, 64: 9e-3}, 0.0, 1e-4, None, EngineCost(1e-4, 1e-4, 0.0))
    save_cost_curve(folder, mine.curve, draft_cost_per_depth=1e-4, engine=mine.engine, device="cpu")
    assert not measured_here(read_cost_curve(folder), target)
    assert load_profile(folder, target, log=lambda *_: None).costs == FAKE and len(calls) == 1
    save_cost_curve(folder, mine.curve, draft_cost_per_depth=1e-4, engine=mine.engine,
                    **local_profile.about(target, local_profile.files_fingerprint(folder)))
    assert measured_here(read_cost_curve(folder), target)
    assert load_profile(folder, target, log=lambda *_: None).costs == mine and len(calls) == 1
    # the same target on another linear kernel runs other passes: not measured here, and another cache entry
    use_linear_kernel(target, "onednn")
    try:
        assert not measured_here(read_cost_curve(folder), target)
        assert load_profile(folder, target, log=lambda *_: None).costs == FAKE and len(calls) == 2
    finally:
        use_linear_kernel(target, "torch")
    # written before drafting was timed in the decoding loop (an older cost_format, or none): not used; this
    # machine's measurement (cached when the first file was refused above) is
    older = read_cost_curve(folder)
    del older["cost_format"]
    (folder / "cost_curve.json").write_text(json.dumps(older))
    assert load_profile(folder, target, log=lambda *_: None).costs == FAKE and len(calls) == 2


def test_measuring_a_cost_model_fills_every_field(eagle_folder):
    """The real measurement (a tiny target: seconds), once: every term present and finite, keyed as it should."""
    target, folder = eagle_folder
    record = local_profile.cost_record(target, load(folder, target), folder, log=lambda *_: None)
    costs = CostModel.from_record(record)
    assert set(costs.curve) == {1, 2, 4, 8, 16, 32, 64, 128} and all(t > 0 for t in costs.curve.values())
    assert costs.draft_cost_per_depth > 0 and costs.baseline > 0
    assert all(isinstance(v, float) for v in costs.engine.record().values())
    assert record["machine"] == machine(target.device) and record["target"] == fingerprint(target)
    assert record["drafter"] == local_profile.files_fingerprint(folder)


def test_sampled_candidates_measure_their_chain_tau_once(eagle_folder, monkeypatch):
    """auto with sampled candidates needs a chain τ at the run's sampling: measured on the first prompt where none
    is saved, cached per target, drafter and sampling, then read back; a profile that can neither read nor
    measure one names what is missing."""
    target, folder = eagle_folder
    counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    measured = counting(monkeypatch, chain_tau, "measure_on_prompt")
    drafter = load(folder, target, candidates="sample")
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "generator": torch.Generator().manual_seed(0)}
    profile = load_profile(folder, target, log=lambda *_: None)
    out = generate(target, prompt, drafter=drafter, tree={"kind": "auto"}, profile=profile, acceptance="block",
                   **sampled)
    assert len(measured) == 1 and out.tree.is_chain
    held = profile.chain_tau_at(Sampling(1.0))
    assert held.sampling == Sampling(1.0) and len(held.tau["block"]) == chain_tau.DEPTH + 1
    assert out.tree == auto_chooser(FAKE)(held.source("block"), 64)  # chosen by block's τ on chains
    fresh = load_profile(folder, target, log=lambda *_: None)  # a new process: the cache, not a new measurement
    generate(target, prompt, drafter=drafter, tree={"kind": "auto"}, profile=fresh, **sampled)
    assert len(measured) == 1 and fresh.chain_tau_at(Sampling(1.0)).tau == held.tau
    # saved beside the drafter (as training saves it): read with the folder, nothing measured
    chain_tau.save_chain_tau(folder, [held])
    assert load_profile(folder).chain_tau_at(Sampling(1.0)).tau == held.tau
    # neither saved at this sampling nor measurable: the error says what is missing and how to get it
    lacking = DrafterProfile(ACC, [held], auto_chooser(FAKE))
    with pytest.raises(ValueError, match=r"chain τ at T=0.5.*measured at T=1.0.*load_profile\(source, target\)"):
        build_tree({"kind": "auto"}, profile=lacking, candidates="sample", acceptance="rejection",
                   sampling=Sampling(0.5))
    with pytest.raises(ValueError, match="no chain_tau.json beside the drafter"):
        generate(target, prompt, drafter=drafter, tree={"kind": "auto"}, profile=DrafterProfile.from_cost_curve(
            ACC, FAKE.record()), max_new_tokens=4, temperature=1.0)
    # greedy decoding samples nothing: the rank accuracies choose, no chain τ needed
    assert generate(target, prompt, drafter=drafter, tree={"kind": "auto", "max_nodes": 4}, profile=lacking,
                    max_new_tokens=4).tree == auto_chooser(FAKE)(ACC, 4)


def test_cache_keys_follow_the_weights_and_the_machine(eagle_folder):
    """A target is known by its weights, a drafter by its files' bytes, a machine by its device and threads: each
    change is another key (another measurement), the same ones the same key."""
    target, folder = eagle_folder
    key = local_profile.files_fingerprint(folder)
    assert fingerprint(target) == fingerprint(tiny_llama(seed=0)) != fingerprint(tiny_llama(seed=1))
    changed = tiny_llama(seed=0)
    with torch.no_grad():
        changed.model.norm.weight[0] += 1.0
    assert fingerprint(changed) != fingerprint(target)
    weights = next(folder.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert local_profile.files_fingerprint(folder) != key
    threads = torch.get_num_threads()
    try:
        mine = machine("cpu")
        torch.set_num_threads(threads + 1)
        assert machine("cpu") != mine and machine("cpu")["threads"] == threads + 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("entry, message", [
    ({}, r'must hold \{"curve"'),  # was a KeyError 'curve' when the profile was made
    ({**FAKE.record(), "curve": {"1": float("nan"), "8": 1e-3}}, r"cost of a pass over 1 tokens is nan"),
])
def test_a_bad_cached_cost_model_is_refused_naming_the_entry(eagle_folder, monkeypatch, entry, message):
    target, folder = eagle_folder
    counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    load_profile(folder, target, log=lambda *_: None)
    cached_file = next((Path(str(local_profile.entry("cost_model", "x"))).parent).glob("*.json"))
    cached_file.write_text(json.dumps(entry))
    with pytest.raises(ValueError, match=message) as err:
        load_profile(folder, target, log=lambda *_: None)
    assert f"{cached_file} (cached: delete it to measure again)" in str(err.value)


def test_a_measured_cost_model_is_checked_before_it_is_cached(eagle_folder, monkeypatch):
    # the engine terms are an in-loop median minus a pass alone: a busy machine once stored engine_fixed < 0
    target, folder = eagle_folder
    noisy = CostModel(FAKE.curve, 1e-5, 1e-5, 1e-3, EngineCost(2e-4, -0.00088, 1e-6))
    counting(monkeypatch, local_profile, "measure_cost_model", noisy)
    with pytest.warns(UserWarning, match=r"cached: delete it .*engine_fixed = -0.00088 s is below 0"):
        assert load_profile(folder, target, log=lambda *_: None).costs.engine.fixed == 0.0
    cached_file = next((Path(str(local_profile.entry("cost_model", "x"))).parent).glob("*.json"))
    assert json.loads(cached_file.read_text())["engine_fixed"] == 0.0


def test_chain_tau_files_round_trip_and_bad_ones_are_named(tmp_path):
    m = chain_tau.ChainTau(Sampling(0.7, 0.9), {"rejection": [1.0, 1.5], "block": [1.0, 1.6]},
                           {"rejection": [0.0, 0.1], "block": [0.0, 0.1]}, 12)
    chain_tau.save_chain_tau(tmp_path, [m])
    assert chain_tau.read_chain_tau(tmp_path) == [m] and chain_tau.read_chain_tau(tmp_path / "none") == []
    (tmp_path / chain_tau.CHAIN_TAU_FILE).write_text(json.dumps({"measurements": [{"tau": {}}]}))
    with pytest.raises(ValueError, match="chain τ file .*sampling, tau, stderr and drafts"):
        chain_tau.read_chain_tau(tmp_path)
    assert Tree.chain(0) == build_tree({"kind": "chain", "depth": 0})


# by default one drafter of each loading path (features, heads, heads beside a fine-tuned target); -m slow the rest
@pytest.mark.parametrize("name", ["eagle3", "medusa", "medusa2", *[pytest.param(n, marks=pytest.mark.slow)
                                                                   for n in ("draft", "eagle", "hydra")]])
def test_every_shipped_drafter_chooses_auto(name, tmp_path, monkeypatch):
    """generate(tree=auto) with a shipped drafter and load_profile(its source, target): its cost curve measured
    here (faked: a curve shipped from another machine is not used), its shipped accuracies; the tree it reports
    is the one the profile's cost model chooses, and greedy output stays the target's."""
    from treespec import reference

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    target = reference.load_model(reference.MODELS_DIR / "medusa2" / "target")[0] if name == "medusa2" else \
        reference.load("target")[0]
    profile = load_profile(f"reference:{name}", target, log=lambda *_: None)
    assert len(calls) == 1 and profile.costs == FAKE and profile.accuracy
    prompt = torch.tensor([reference.load("target")[1]("def fibonacci(n):\n").input_ids])
    out = generate(target, prompt, drafter=load(f"reference:{name}", target), tree={"kind": "auto", "max_nodes": 8},
                   profile=profile, max_new_tokens=8)
    assert out.tree == auto_chooser(FAKE)(profile.accuracy, 8) and len(out.tree) > 0
    assert torch.equal(out.sequences, generate(target, prompt, max_new_tokens=8).sequences)


def test_a_shipped_drafter_sampling_under_block_measures_its_chain_tau(tmp_path, monkeypatch):
    """The issue's case: a shipped EAGLE loaded with candidates="sample", tree=auto at T = 1 under block
    verification: its chain τ is measured on first use, and auto picks a chain block verifies."""
    from treespec import reference

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    target, tokenizer = reference.load("target")
    prompt = tokenizer("import os\n", return_tensors="pt").input_ids
    profile = load_profile("reference:eagle", target, log=lambda *_: None)
    out = generate(target, prompt, drafter=load("reference:eagle", target, candidates="sample"),
                   tree={"kind": "auto"}, profile=profile, max_new_tokens=8, temperature=1.0, acceptance="block",
                   generator=torch.Generator().manual_seed(0))
    held = profile.chain_tau_at(Sampling(1.0))
    assert out.tree.is_chain and out.tree == auto_chooser(FAKE)(held.source("block"), 64)
    assert held.drafts > 0 and held.tau["block"][0] == 1.0


def test_a_cost_model_measured_on_a_busy_machine_says_so_and_where_it_is_cached(eagle_folder, monkeypatch):
    """The cores other work kept busy are kept in the record; from half a core on, the log says the model is
    cached as measured and names the file to delete (a busy machine's model would steer "auto" for good)."""
    target, folder = eagle_folder
    counting(monkeypatch, local_profile, "measure_cost_model", FAKE)
    monkeypatch.setattr(local_profile, "busy_cores", lambda cores: 1.5)
    lines = []
    record = local_profile.cost_record(target, load(folder, target), folder, log=lines.append)
    assert record["busy_cores"] == 1.5
    warning = [line for line in lines if line.startswith("warning:")]
    assert len(warning) == 1 and "1.5 of" in warning[0]
    cached_file = warning[0].split("delete ")[1].split(" to measure")[0]
    assert Path(cached_file).is_file()  # the entry it names is the one written
    monkeypatch.setattr(local_profile, "busy_cores", lambda cores: 0.1)
    assert local_profile.other_work(target, Path(cached_file), log=lines.append, cores=2) == 0.1
    assert len([line for line in lines if line.startswith("warning:")]) == 1  # idle: nothing said
