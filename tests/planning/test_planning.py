"""Planning apart from decoding (treespec/planning/resolve.py): a tree spec is resolved before the call's own
decoding starts, and what resolving it measures (a chain τ missing at this sampling) decodes through the loop
directly, so no decoding ever runs inside another; the loop itself takes resolved trees only."""

import importlib
import inspect
import sys

import pytest
import torch

from treespec import generate
from treespec.heads import load, load_profile
from treespec.heads.checkpoints import local_profile
from treespec.heads.eagle import EagleModel
from treespec.heads.training.accuracy import write_accuracy
from treespec.planning.autotree import CostModel
from treespec.planning.resolve import plan_tree
from treespec.sampling import Sampling

from tests.helpers import tiny_llama

# the decoding loop's own code (under torch.no_grad's wrapper): what must never be active twice at once
LOOP = inspect.unwrap(importlib.import_module("treespec.generate").decode).__code__
ACC = [[0.9, 0.05], [0.8, 0.1], [0.7], [0.6]]
FLAT = CostModel({1: 1e-3, 64: 1.1e-3}, 1e-5, 1e-5, 1e-3)  # a flat curve: auto speculates


def decoding_calls(run):
    """(``run()``'s result, how many times the loop was entered, the most loop calls active at once), watched with
    a profiler hook: it sees every call, however the loop was reached."""
    active, calls, deepest = 0, 0, 0

    def hook(frame, event, arg):
        nonlocal active, calls, deepest
        if frame.f_code is LOOP and event == "call":
            active, calls = active + 1, calls + 1
            deepest = max(deepest, active)
        elif frame.f_code is LOOP and event == "return":  # on an exception too
            active -= 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        out = run()
    finally:
        sys.setprofile(previous)
    return out, calls, deepest


@pytest.fixture
def sampled_eagle(tmp_path, monkeypatch):
    """(target, an EAGLE sampling its candidates, its profile): a folder with accuracies and no chain τ, the profile
    cache empty in tmp_path (its cost model faked: measuring one is not what this checks)."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_profile, "measure_cost_model", lambda *args, **kwargs: FLAT)
    target = tiny_llama(seed=0)
    torch.manual_seed(0)
    EagleModel(target).eval().save_pretrained(tmp_path / "eagle")
    write_accuracy(tmp_path / "eagle", ACC)
    profile = load_profile(tmp_path / "eagle", target, log=lambda *_: None)
    return target, load(tmp_path / "eagle", target, candidates="sample"), profile


def test_auto_measures_a_missing_chain_tau_before_decoding_never_inside_it(sampled_eagle, tmp_path):
    """The issue's path: tree=auto at a temperature whose chain τ nothing holds measures it by decoding the target's
    own continuations; every one of those decodings ends before the call's own begins."""
    target, drafter, profile = sampled_eagle
    chain_taus = tmp_path / "cache" / "profiles" / "chain_tau"
    assert not chain_taus.exists() and profile.chain_taus() == []
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    out, calls, deepest = decoding_calls(lambda: generate(
        target, prompt, drafter=drafter, tree={"kind": "auto"}, profile=profile, temperature=0.7, acceptance="block",
        max_new_tokens=6, generator=torch.Generator().manual_seed(0)))
    assert profile.chain_tau_at(Sampling(0.7)) is not None and len(list(chain_taus.glob("*.json"))) == 1  # measured
    assert calls > 1, "the chain τ was measured without decoding: this test no longer watches the nesting"
    assert deepest == 1, f"{deepest} decodings ran at once: one ran inside another"
    assert out.tree.is_chain and out.new_tokens == 6  # what auto chose, said


def test_planning_once_then_decoding_is_what_generate_does(sampled_eagle):
    """plan_tree resolves a spec as generate() would (a caller decoding many prompts plans once); greedy output
    stays the target's own."""
    target, drafter, profile = sampled_eagle
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    tree = plan_tree(target, prompt, tree={"kind": "auto", "max_nodes": 6}, drafter=drafter, profile=profile,
                     max_new_tokens=8)
    out = generate(target, prompt, drafter=drafter, tree={"kind": "auto", "max_nodes": 6}, profile=profile,
                   max_new_tokens=8)
    assert out.tree == tree and len(tree) > 0
    assert torch.equal(out.sequences, generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=8).sequences)
    assert torch.equal(out.sequences, generate(target, prompt, max_new_tokens=8).sequences)


def test_the_loop_takes_resolved_trees_only():
    """The loop refuses a spec, naming where specs are resolved; the public generate() checks every argument before
    it plans, so a bad one is named before anything is measured."""
    decode = importlib.import_module("treespec.generate").decode
    target = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="takes a resolved tree.*treespec.planning.resolve.plan_tree"):
        decode(target, torch.tensor([[1, 2, 3]]), tree={"kind": "chain", "depth": 2}, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate(target, torch.tensor([[1, 2, 3]]), tree={"kind": "auto"}, max_new_tokens=0)
    with pytest.raises(TypeError, match="max_new_tokens"):
        generate(target, torch.tensor([[1, 2, 3]]), tree={"kind": "chain", "depth": 2})
    with pytest.raises(ValueError, match="profile must be a treespec.planning.profile.DrafterProfile"):
        generate(target, torch.tensor([[1, 2, 3]]), profile={"accuracy": ACC}, max_new_tokens=2)
