"""generate(): greedy equals transformers' greedy token for token, for every drafter and tree shape."""

import pytest
import torch

from treespec import Tree, generate
from treespec.drafter import Committed
from treespec.heads import DraftModel, PromptLookup

from tests.helpers import hf_greedy, perturbed, tiny_llama

TREES = {
    "chain": Tree.chain(3),
    "full": Tree.full(2, 2),
    "paths": Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]),
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def drafts(target):
    return {"self": target, "perturbed": perturbed(target), "unrelated": tiny_llama(seed=7)}


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("draft_name", ["self", "perturbed", "unrelated"])
def test_greedy_equals_transformers(target, drafts, prompt, tree_name, draft_name):
    expected = hf_greedy(target, prompt, 40)
    out = generate(target, prompt, drafter=DraftModel(drafts[draft_name]), tree=TREES[tree_name], max_new_tokens=40)
    assert torch.equal(out.sequences, expected)
    assert sum(out.accept_lengths) == 40 - 1  # the prefill commits the first token
    if draft_name == "self":  # a perfect draft: every candidate path is accepted in full
        assert all(n == TREES[tree_name].depth + 1 for n in out.accept_lengths[:-1])
    elif draft_name == "perturbed":  # agrees with the target often: some candidates are accepted
        assert out.mean_accept_length > 1.0


def test_vanilla_is_one_token_per_pass(target, prompt):
    out = generate(target, prompt, max_new_tokens=12)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12))
    assert out.accept_lengths == [1] * 11 and out.target_passes == 11


def test_empty_tree_is_vanilla_and_never_calls_the_drafter(target, prompt):
    # tree=auto may choose no candidates: the drafter is then not prefilled or asked anything
    class Untouchable(DraftModel):
        def prefill(self, *args):
            raise AssertionError("an empty tree must not prefill the drafter")

    out = generate(target, prompt, drafter=Untouchable(target), tree=Tree.chain(0), max_new_tokens=12)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12)) and out.draft_time == 0.0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7, 11])
def test_max_new_tokens_lands_mid_path(target, prompt, max_new_tokens):
    out = generate(target, prompt, drafter=DraftModel(target), tree=Tree.full(2, 3), max_new_tokens=max_new_tokens)
    assert out.new_tokens == max_new_tokens
    assert torch.equal(out.sequences, hf_greedy(target, prompt, max_new_tokens))


@pytest.mark.parametrize("eos_index", [0, 3, 6])
def test_eos_mid_tree(target, prompt, eos_index):
    reference = hf_greedy(target, prompt, 20)
    eos = int(reference[0, prompt.shape[1] + eos_index])
    expected = hf_greedy(target, prompt, 20, eos_token_id=eos)
    out = generate(target, prompt, drafter=DraftModel(target), tree=Tree.chain(5), max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert int(out.sequences[0, -1]) == eos


def test_prompt_lookup_greedy(target):
    pattern = torch.tensor([[5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9]])
    for tree in (Tree.chain(4), Tree.full(2, 2)):
        out = generate(target, pattern, drafter=PromptLookup(), tree=tree, max_new_tokens=30)
        assert torch.equal(out.sequences, hf_greedy(target, pattern, 30))


def test_prompt_lookup_proposes_continuations():
    lookup = PromptLookup(max_ngram=2)
    committed = torch.tensor([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2]])
    proposal = lookup.propose(Committed(committed, [10]), None, Tree.full(2, 2), None).row(0)
    # "1 2" was followed by 5 (most recent) then 3; after "2 5" comes 6, after "2 3" comes 4
    assert proposal.tree.paths == ((0,), (1,), (0, 0), (1, 0))
    assert proposal.tokens.tolist() == [5, 3, 6, 4]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementations(attn, prompt):
    target = tiny_llama(seed=0, attn=attn)
    out = generate(target, prompt, drafter=DraftModel(perturbed(target)), tree=Tree.full(2, 2), max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 16))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": 300}, "exceeds the target's 256 positions"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"tree": Tree.chain(2), "drafter": None}, "no drafter was given"),
])
def test_bad_arguments(target, prompt, kwargs, message):
    kwargs = {"max_new_tokens": 4, "drafter": DraftModel(target), **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(target, prompt, **kwargs)


def test_bad_inputs(target, prompt):
    with pytest.raises(ValueError, match="pads on the right"):
        generate(target, prompt.repeat(2, 1), attention_mask=torch.tensor([[1] * 9, [1] * 8 + [0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(target, prompt[:, :0], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"draft model vocabulary \(80 tokens\) differs from the target's \(64"):
        generate(target, prompt, drafter=DraftModel(tiny_llama(vocab=80)), max_new_tokens=4)
    with pytest.raises(ValueError, match="tree path"):
        Tree.from_paths([(0,), (0, 1, 2)])


def test_flash_attention_is_refused_with_advice(prompt):
    model = tiny_llama()
    model.config._attn_implementation = "flash_attention_2"  # as loaded with attn_implementation=...
    with pytest.raises(ValueError, match="'flash_attention_2' cannot take a tree mask.*sdpa"):
        generate(model, prompt, max_new_tokens=4)


def test_static_drafters_refuse_dynamic_trees(target, prompt):
    from treespec.dynamic_tree import DynamicTree

    with pytest.raises(ValueError, match="PromptLookup cannot grow DynamicTree"):
        generate(target, prompt, drafter=PromptLookup(), tree=DynamicTree(8, 3, 2), max_new_tokens=4)


def test_timing_is_an_observer_that_alone_synchronises(target, drafts, prompt, monkeypatch):
    # production decoding never waits for the device; a StepTimer (what the comparison passes) waits at every
    # boundary and splits the wall time into target, drafter and engine time
    from treespec.timing import StepTimer

    waits = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    kwargs = dict(drafter=DraftModel(drafts["perturbed"]), tree=Tree.full(2, 2), max_new_tokens=16)
    plain = generate(target, prompt, **kwargs)
    assert waits == [] and plain.target_time == plain.draft_time == 0.0 and plain.wall_time > 0
    timed = generate(target, prompt, observer=StepTimer(synchronize=True), **kwargs)
    assert torch.equal(timed.sequences, plain.sequences)
    # two per target forward (prefill + one per pass), per walk (one per pass) and per drafter call (prefill,
    # then propose and accept on every pass with a tree left to draft: all but the last few), and two for the
    # wall clock
    passes = timed.target_passes
    waits_for_drafter = len(waits) - 2 * (1 + passes) - 2 * passes - 2
    assert 2 * (1 + 2 * (passes - 2)) <= waits_for_drafter <= 2 * (1 + 2 * passes)
    assert timed.target_time > 0 and timed.draft_time > 0 and timed.overhead_time > timed.walk_time > 0
    waits.clear()
    generate(target, prompt, observer=StepTimer(synchronize=False), **kwargs)
    assert waits == []


def test_observer_charges_a_drafters_update_apart_from_its_proposals(target, prompt):
    """A drafter updated from every verified pass (Token Recycling's matrix) is charged that update apart, as part
    of its drafter time; a bench Row splits a pass's wall time into parts that add up to it."""
    from treespec.heads import TokenRecycling
    from treespec.planning.bench import Measured, rows_of, step_parts
    from treespec.timing import StepTimer

    timed = generate(target, prompt, drafter=TokenRecycling(), tree=Tree.chain(3), max_new_tokens=24,
                     observer=StepTimer(synchronize=False))
    assert 0 < timed.update_time < timed.draft_time
    vanilla = generate(target, prompt, max_new_tokens=24, observer=StepTimer(synchronize=False))
    assert vanilla.update_time == 0.0
    rows = rows_of({"vanilla": [Measured.of(vanilla)], "recycling": [Measured.of(timed)]})
    parts = step_parts(rows[1])
    assert parts["update"] > 0 and parts["draft"] > 0 and parts["target"] > 0
    # the prefill is no pass's: kept apart (its target forward and the drafter's prefill), left out of the split
    assert 0 < timed.prefill_target_time < timed.prefill_time < timed.wall_time
    assert 0 <= timed.prefill_draft_time < timed.draft_time and vanilla.prefill_draft_time == 0.0
    passes = timed.target_passes
    assert parts["target"] == pytest.approx(1e3 * (timed.target_time - timed.prefill_target_time) / passes, rel=1e-3)
    assert sum(parts.values()) == pytest.approx(1e3 * (timed.wall_time - timed.prefill_time) / passes, rel=1e-3)
    untimed = generate(target, prompt, max_new_tokens=4)
    assert 0 < untimed.prefill_time < untimed.wall_time and untimed.prefill_target_time == 0.0
