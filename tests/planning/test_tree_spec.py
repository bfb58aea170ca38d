"""Tree specifications from configs: every kind builds, bad specifications name themselves."""

import pytest

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.planning.tree_spec import build_tree, check_tree_spec


def test_kinds_build():
    assert build_tree({"kind": "chain", "depth": 3}) == Tree.chain(3)
    assert build_tree({"kind": "full", "width": 2, "depth": 2}) == Tree.full(2, 2)
    assert build_tree({"kind": "paths", "paths": [[0], [1], [0, 0]]}) == Tree.from_paths([(0,), (1,), (0, 0)])
    acc = [[0.6, 0.2], [0.4, 0.1]]
    tree = build_tree({"kind": "accuracy", "nodes": 3}, accuracy=acc)
    assert len(tree) == 3 and set(tree.paths) == {(0,), (1,), (0, 0)}
    assert build_tree(Tree.chain(2)) == Tree.chain(2)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "chain"}, r"lacks depth"),
    ({"kind": "ladder", "depth": 2}, r"kind 'ladder' is not one of"),
    ({"kind": "full", "width": 0, "depth": 2}, r"bad tree spec .*'width': 0"),
    ({"kind": "paths", "paths": [[0, 1]]}, r"\(0, 1\) has no parent"),
    ({"kind": "accuracy", "nodes": 4}, r"needs the drafter's measured per-depth top-k accuracies"),
    ({"kind": "auto"}, r"needs the drafter's measured"),
    ({"kind": "chain", "depth": 2.5}, r"2.5 is not an integer"),
    ({"kind": "dynamic", "total_tokens": 4, "depth": 2, "top_k": 0}, r"top_k >= 1"),
])
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        build_tree(spec)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "accuracy", "nodes": 4, "depth": 3}, r"unknown key\(s\) depth for kind 'accuracy'"),
    ({"kind": "dynamic", "total_tokens": 16, "depth": 5, "top_k": 4, "nodes": 6}, r"unknown key\(s\) nodes"),
    ({"kind": "full", "width": 2}, r"lacks depth"),
    ({"kind": "auto", "max_nodes": 0}, r"max_nodes must be an integer >= 1"),
    ({"kind": "accuracy", "nodes": "8"}, r"nodes must be an integer >= 1"),
    ([("chain", 3)], r"a tree spec is a dict"),
    ({"depth": 3}, r"kind None is not one of"),
])
def test_check_refuses_what_build_would_misread(spec, message):
    """check_tree_spec is what jobs call at start-up: a misspelled key fails there, not after training."""
    with pytest.raises(ValueError, match=message):
        check_tree_spec(spec)


def test_check_fills_defaults_and_passes_trees_through():
    assert check_tree_spec({"kind": "auto"}) == {"kind": "auto", "max_nodes": 64}
    assert check_tree_spec({"kind": "accuracy", "nodes": 8}) == {"kind": "accuracy", "nodes": 8}
    assert check_tree_spec(Tree.chain(3)) == Tree.chain(3)
    assert check_tree_spec(DynamicTree(4, 2, 2)) == DynamicTree(4, 2, 2)


def test_auto_uses_the_chooser():
    acc = [[0.6, 0.2], [0.4, 0.1]]
    chosen = []
    tree = build_tree({"kind": "auto", "max_nodes": 2}, accuracy=acc,
                      choose=lambda a, n: chosen.append((a, n)) or Tree.chain(n))
    assert tree == Tree.chain(2) and chosen == [(acc, 2)]


def test_auto_under_block_verification_chooses_among_chains(tmp_path):
    """Block verification verifies chains: "auto" must never hand it the branching tree its accuracies favour
    (as it did for a drafter with top-k accuracies only), in build_tree and in generate."""
    import torch

    from treespec import generate
    from treespec.heads import DraftModel
    from treespec.planning.autotree import auto_chooser
    from treespec.planning.profile import DrafterProfile

    from tests.helpers import tiny_llama

    # second ranks almost as good as the first, and a flat cost curve: the best tree branches
    profile = DrafterProfile(accuracy=[[0.45, 0.4, 0.1], [0.45, 0.4, 0.1], [0.45, 0.4]],
                             tree_chooser=auto_chooser({1: 1.0, 64: 1.0}))
    free = build_tree({"kind": "auto", "max_nodes": 8}, profile=profile)
    assert not free.is_chain
    chain = build_tree({"kind": "auto", "max_nodes": 8}, profile=profile, acceptance="block")
    assert chain.is_chain and len(chain) == 3
    target = tiny_llama(seed=0)
    out = generate(target, torch.tensor([[3, 7, 1, 9]]), drafter=DraftModel(tiny_llama(seed=1)),
                   tree={"kind": "auto", "max_nodes": 8}, profile=profile, max_new_tokens=6, temperature=1.0,
                   acceptance="block", generator=torch.Generator().manual_seed(0))
    assert out.new_tokens == 6 and out.tree.is_chain and len(out.tree) == 3
    # sampled candidates are predicted from their chain τ, which this profile neither holds nor can measure
    with pytest.raises(ValueError, match="chain τ at T=1.0.*no chain_tau.json"):
        generate(target, torch.tensor([[3, 7, 1, 9]]), drafter=DraftModel(tiny_llama(seed=1), candidates="sample"),
                 tree={"kind": "auto", "max_nodes": 8}, profile=profile, max_new_tokens=6, temperature=1.0,
                 acceptance="block")


def test_accuracy_and_auto_trees_in_generate_with_a_trained_drafter(tmp_path):
    """A trained drafter's folder holds its accuracies and the device's cost curve: generate() grows both kinds."""
    import torch

    from treespec import generate
    from treespec.heads import load, load_profile
    from treespec.heads.eagle import EagleModel
    from treespec.heads.training.accuracy import write_accuracy
    from treespec.planning.autotree import auto_chooser, measure_cost_curve, save_cost_curve

    from tests.helpers import tiny_llama

    target = tiny_llama(seed=0)
    torch.manual_seed(0)
    EagleModel(target).eval().save_pretrained(tmp_path)
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
    write_accuracy(tmp_path, acc)
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    vanilla = generate(target, prompt, max_new_tokens=8)
    drafter, profile = load(tmp_path, target), load_profile(tmp_path)
    assert profile.accuracy == acc and profile.tree_chooser is None
    with pytest.raises(ValueError, match=r"needs the drafter's measured.*load_profile"):
        generate(target, prompt, drafter=drafter, tree={"kind": "accuracy", "nodes": 4}, max_new_tokens=8)
    out = generate(target, prompt, drafter=drafter, tree={"kind": "accuracy", "nodes": 4}, profile=profile,
                   max_new_tokens=8)
    assert torch.equal(out.sequences, vanilla.sequences)
    with pytest.raises(ValueError, match=r"needs this device's cost curve.*load_profile\(source, target\)"):
        generate(target, prompt, drafter=drafter, tree={"kind": "auto"}, profile=profile, max_new_tokens=8)
    save_cost_curve(tmp_path, measure_cost_curve(target, (1, 2, 4, 8), past_len=8, repeats=2))
    profile = load_profile(tmp_path)
    assert profile.tree_chooser is not None
    out = generate(target, prompt, drafter=drafter, tree={"kind": "auto", "max_nodes": 6}, profile=profile,
                   max_new_tokens=8)
    assert torch.equal(out.sequences, vanilla.sequences)
    assert out.tree == build_tree({"kind": "auto", "max_nodes": 6}, profile=profile)  # what auto chose, said
    assert vanilla.tree == Tree.chain(0)
    # a flat curve (verifying more tokens is free) makes auto take every node it may
    profile.tree_chooser = auto_chooser({1: 1.0, 8: 1.0})
    assert len(build_tree({"kind": "auto", "max_nodes": 6}, profile=profile)) == 6
