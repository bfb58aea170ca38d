"""Every bad argument of generate() found by the reliability probes fails at the door with a message naming
the problem, or works as a user would expect; plus fuzz tests: any value for one argument (a named error or a
well-formed result), and random trees, prompts and sampling settings (greedy equals transformers). Bad files:
tests/test_bad_files.py; bad job settings and resumes: tests/test_bad_configs.py."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec import Tree, generate
from treespec.drafter import Proposal
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, Medusa, MedusaHeads, PromptLookup
from treespec.sampling import GREEDY
from treespec.walker import walk

from tests.helpers import hf_greedy, perturbed, tiny_llama

PROMPT = torch.tensor([[3, 7, 1, 9, 4, 2]])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("form", [int, np.int64, torch.tensor, lambda t: torch.tensor([t]), lambda t: [t],
                                  lambda t: (63 - t, t), lambda t: {t, 63 - t}, lambda t: frozenset([t])])
def test_eos_in_every_reasonable_form_stops_decoding(target, form):
    full = generate(target, PROMPT, max_new_tokens=30).sequences[0, PROMPT.shape[1]:].tolist()
    eos = full[3]  # a token greedy decoding emits, so stopping is observable
    first = full.index(eos)
    out = generate(target, PROMPT, max_new_tokens=30, eos_token_id=form(eos)).sequences[0, PROMPT.shape[1]:].tolist()
    assert out == full[: first + 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"eos_token_id": "</s>"}, r"eos_token_id must be token ids .* got '</s>'"),
    ({"eos_token_id": 2.0}, r"eos_token_id must be token ids"),
    ({"max_new_tokens": 4.0}, r"max_new_tokens must be an integer >= 1, got 4.0"),
    ({"max_new_tokens": None}, r"max_new_tokens must be an integer >= 1, got None"),
    ({"generator": 0}, r"generator must be a torch.Generator or None, got 0"),
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"temperature": float("inf")}, r"temperature must be a finite number"),
    ({"tree": [(0,), (1,)], "drafter": PromptLookup()}, r"tree must be a Tree, a DynamicTree, a TreesByBatch or a"),
    ({"tree": {"kind": "chain", "depht": 3}, "drafter": PromptLookup()}, r"lacks depth"),
    ({"tree": Tree.from_paths([(0,), (70,)]), "drafter": PromptLookup()}, r"rank 70 but the vocabulary has 64"),
    ({"acceptance": "greedy"}, r"unknown acceptance mode 'greedy'"),
    ({"drafter": "eagle"}, r"drafter must implement treespec.drafter.Drafter"),
])
def test_bad_arguments_are_named(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(target, PROMPT, **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("input_ids, message", [
    (PROMPT.float(), r"input_ids must hold integer token ids, got a torch.float32 tensor"),
    (torch.tensor([[3, 64]]), r"input_ids must lie in \[0, 64\).*from 3 to 64"),
    (torch.tensor([[-1, 3]]), r"input_ids must lie in \[0, 64\)"),
    ([[1.5, 2.0]], r"input_ids must be token ids"),
])
def test_bad_input_ids_are_named(target, input_ids, message):
    with pytest.raises(ValueError, match=message):
        generate(target, input_ids, max_new_tokens=4)


def test_list_and_1d_input_ids_are_normalised(target):
    expected = generate(target, PROMPT, max_new_tokens=6).sequences
    assert torch.equal(generate(target, PROMPT[0].tolist(), max_new_tokens=6).sequences, expected)
    assert torch.equal(generate(target, PROMPT[0], max_new_tokens=6).sequences, expected)
    assert torch.equal(generate(target, PROMPT.tolist(), max_new_tokens=6).sequences, expected)  # [[...]]: one row
    assert torch.equal(generate(target, PROMPT.numpy(), max_new_tokens=6).sequences, expected)


def test_several_prompts_are_a_batch_not_concatenated(target):
    """A list of prompts once decoded as their concatenation; it is a batch, each row decoded as if alone."""
    out = generate(target, [[3, 7, 1], [9, 4, 2]], max_new_tokens=4)
    assert out.sequences.shape == (2, 3 + 4)
    for row, prompt in zip(out.sequences, ([3, 7, 1], [9, 4, 2]), strict=True):
        assert torch.equal(row, generate(target, prompt, max_new_tokens=4).sequences[0])
    with pytest.raises(ValueError, match=r"input_ids must be a flat sequence of token ids, got a nested one"):
        generate(target, [3, [7, 1]], max_new_tokens=4)


@pytest.mark.parametrize("drafter", [None, "draft"])
def test_greedy_decoding_of_nan_logits_is_an_error(drafter):
    """Greedy decoding once one-hot encoded the argmax of NaN logits and emitted token 0; sampling raised."""
    model = tiny_llama(seed=0)
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")  # every position's logit of token 5 is NaN
    draft = DraftModel(tiny_llama(seed=1)) if drafter else None
    with pytest.raises(ValueError, match=r"cannot decode greedily: the target's logits hold NaN or infinite"):
        generate(model, PROMPT, drafter=draft, tree=Tree.full(2, 2) if draft else None, max_new_tokens=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_greedy_walk_refuses_non_finite_logits(bad):
    tree = Tree.full(2, 1)
    logits = torch.randn(tree.num_nodes, 8)
    logits[1] = -float("inf") if bad == -float("inf") else logits[1]  # a row of -inf only has no argmax
    logits[1, 3] = bad
    with pytest.raises(ValueError, match=r"cannot decode greedily"):
        walk(logits, Proposal(tree, torch.tensor([1, 2])), GREEDY)


@pytest.mark.parametrize("make, message", [
    (lambda: Tree.chain(2.5), r"chain depth must be an integer, got 2.5"),
    (lambda: Tree.full(2, 2.0), r"full tree depth must be an integer, got 2.0"),
    (lambda: Tree([(0,), (0, 0.5)]), r"tree path \(0, 0.5\): a rank must be an integer"),
    (lambda: DynamicTree("4", 2, 2), r"dynamic tree total_tokens must be an integer, got '4'"),
    (lambda: DynamicTree(4.7, 2.9, 2.2), r"dynamic tree total_tokens must be an integer, got 4.7"),
    (lambda: DynamicTree(4, 2, True), r"dynamic tree top_k must be an integer, got True"),
])
def test_tree_sizes_are_integers_never_rounded(make, message):
    """DynamicTree(4.7, 2.9, 2.2) once became (4, 2, 2) without a word."""
    with pytest.raises(ValueError, match=message):
        make()


def alibi_models():
    from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM

    return [BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).eval(),
            FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           alibi=True)).eval()]


def test_alibi_models_are_refused_at_the_door():
    for model in alibi_models():
        with pytest.raises(ValueError, match=r"uses ALiBi position biases, which treespec's tree masks do not carry"):
            generate(model, PROMPT, drafter=PromptLookup(), tree=Tree.full(2, 2), max_new_tokens=4)


def test_a_target_without_lm_head_or_config_is_named():
    from transformers import LlamaConfig, LlamaModel

    base = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2)).eval()
    with pytest.raises(ValueError, match=r"target LlamaModel has no LM head .* AutoModelForCausalLM"):
        generate(base, PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"target must be a transformers causal LM .* got Linear"):
        generate(torch.nn.Linear(4, 4), PROMPT, max_new_tokens=4)


def test_a_drafter_serves_one_generation_at_a_time(target):
    """Two threads sharing one drafter once failed inside torch (a size mismatch, KeyError: 0); the second is now
    refused while the first decodes, and the drafter is free again afterwards."""
    drafter = DraftModel(perturbed(target, 0.1))
    inside, release = threading.Event(), threading.Event()
    propose = drafter.propose

    def slow_propose(*args, **kwargs):
        inside.set()
        release.wait(10)
        return propose(*args, **kwargs)

    drafter.propose = slow_propose
    first = {}
    thread = threading.Thread(target=lambda: first.update(out=generate(target, PROMPT, drafter=drafter,
                                                                       max_new_tokens=6)))
    thread.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match=r"already decoding in another generate\(\) call.* one generation at a time"):
        generate(target, PROMPT, drafter=drafter, max_new_tokens=6)
    release.set()
    thread.join(10)
    expected = hf_greedy(target, PROMPT, 6)
    assert torch.equal(first["out"].sequences, expected)
    assert torch.equal(generate(target, PROMPT, drafter=drafter, max_new_tokens=6).sequences, expected)


def test_tree_spec_dict_is_accepted_wherever_a_tree_is(target):
    draft = DraftModel(perturbed(target, 0.1))
    a = generate(target, PROMPT, drafter=draft, tree={"kind": "full", "width": 2, "depth": 2}, max_new_tokens=10)
    b = generate(target, PROMPT, drafter=draft, tree=Tree.full(2, 2), max_new_tokens=10)
    assert torch.equal(a.sequences, b.sequences) and a.accept_lengths == b.accept_lengths


@pytest.mark.parametrize("temperature", [1e-38, 5e-172, 5e-324])
def test_tiny_temperature_is_the_greedy_limit(target, temperature):
    """temperature=1e-38 used to overflow logits / T to inf and emit garbage, and one below float32's range to
    divide by 0; now both are argmax decoding."""
    out = generate(target, PROMPT, max_new_tokens=12, temperature=temperature,
                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 12))


def test_training_mode_target_is_refused():
    model = tiny_llama(seed=0).train()
    with pytest.raises(ValueError, match=r"target is in training mode .* call target.eval\(\)"):
        generate(model, PROMPT, max_new_tokens=4)


def test_flex_attention_is_refused_on_cpu():
    model = tiny_llama(seed=0)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"flex_attention runs on CUDA only"):
        generate(model, PROMPT, drafter=PromptLookup(), tree=Tree.full(2, 2), max_new_tokens=4)


def test_draft_model_position_limit_is_checked(target):
    short = tiny_llama(seed=1, max_positions=16)
    with pytest.raises(ValueError, match=r"exceeds the DraftModel's 16 positions"):
        generate(target, PROMPT, drafter=DraftModel(short), max_new_tokens=20)


def test_medusa_heads_follow_the_target_dtype():
    target = tiny_llama(seed=0)
    heads = MedusaHeads(32, 64, num_heads=2, lm_head=target.get_output_embeddings())
    target = target.to(torch.bfloat16)
    heads.to(torch.float32)  # built for fp32, used with a bf16 target
    out = generate(target, PROMPT, drafter=Medusa(heads), tree=Tree.chain(2), max_new_tokens=6)
    assert out.sequences.shape == (1, PROMPT.shape[1] + 6)


# -- fuzz: random trees, prompts and sampling settings ---------------------------------------------------
@st.composite
def random_trees(draw):
    paths = [()]
    for _ in range(draw(st.integers(0, 8))):
        parent = draw(st.sampled_from(paths))
        if len(parent) < 4:
            rank = sum(1 for p in paths if p[:-1] == parent and len(p) == len(parent) + 1)
            paths.append((*parent, rank))
    return Tree(paths[1:]) if len(paths) > 1 else Tree.chain(0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=random_trees(), prompt=st.lists(st.integers(0, 63), min_size=1, max_size=12),
       new=st.integers(1, 12), temperature=st.sampled_from([0.0, 0.5, 1.0]), top_p=st.sampled_from([1.0, 0.9]),
       seed=st.integers(0, 3))
def test_fuzz_generate(target, tree, prompt, new, temperature, top_p, seed):
    """Greedy equals transformers' greedy; sampling returns well-formed results."""
    draft = DraftModel(perturbed(target, 0.1, seed=seed + 1))
    out = generate(target, torch.tensor([prompt]), drafter=draft if len(tree) else None, tree=tree,
                   max_new_tokens=new, temperature=temperature, top_p=top_p,
                   generator=torch.Generator().manual_seed(seed))
    assert out.sequences.shape == (1, len(prompt) + new) and sum(out.accept_lengths) == new - 1
    assert all(1 <= n <= tree.depth + 1 for n in out.accept_lengths)
    assert int(out.sequences.min()) >= 0 and int(out.sequences.max()) < 64
    if temperature == 0:
        assert torch.equal(out.sequences, hf_greedy(target, torch.tensor([prompt]), new))


# -- fuzz: anything at the door of generate() -------------------------------------------------------------------
VALID = {"input_ids": PROMPT, "max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "eos_token_id": None,
         "tree": None, "acceptance": "rejection"}
# what an error about each argument names
NAMED = {"input_ids": ("input_ids", "prompt"), "max_new_tokens": ("max_new_tokens",), "temperature": ("temperature",),
         "top_p": ("top_p",), "eos_token_id": ("eos_token_id",), "acceptance": ("acceptance",),
         "tree": ("tree", "Tree", "spec", "depth", "width", "rank", "paths", "nodes", "total_tokens", "top_k")}
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 80), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-2, 70), max_size=4), st.sets(st.integers(0, 70), max_size=3),
    st.lists(st.lists(st.integers(0, 63), max_size=3), max_size=3), st.lists(st.floats(0, 10), max_size=3),
    st.builds(torch.tensor, st.lists(st.integers(0, 63), min_size=1, max_size=4)),
    st.builds(lambda v: torch.tensor(v).float(), st.lists(st.integers(0, 63), min_size=1, max_size=4)),
    st.fixed_dictionaries({"kind": st.sampled_from(["chain", "full", "dynamic", "paths", "auto", "bogus"]),
                           "depth": st.one_of(st.integers(-1, 3), st.floats(0, 3), st.text(max_size=2))}),
    st.builds(Tree.chain, st.integers(0, 3)), st.builds(DynamicTree, st.integers(1, 6), st.integers(1, 3),
                                                         st.integers(1, 2)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argument=st.sampled_from(sorted(VALID)), value=ANYTHING, drafted=st.booleans())
def test_fuzz_the_door_of_generate(target, argument, value, drafted):
    """One argument replaced by anything: a ValueError that names that argument, or a well-formed result."""
    kwargs = {**VALID, argument: value}
    drafter = DraftModel(target) if drafted else None  # the target as its own draft: every candidate accepted
    try:
        out = generate(target, kwargs.pop("input_ids"), drafter=drafter, **kwargs)
    except ValueError as err:
        assert any(word in str(err) for word in NAMED[argument]), (argument, value, str(err))
        return
    prompt = out.prompt_length
    assert out.sequences.dtype == torch.long and out.sequences.shape[0] == len(out.rows) >= 1  # a list: a batch
    for row in out.rows:
        assert 1 <= row.new_tokens <= kwargs["max_new_tokens"] and sum(row.accept_lengths) == row.new_tokens - 1
    assert int(out.sequences.min()) >= 0 and int(out.sequences.max()) < 64 and prompt >= 1


@pytest.mark.parametrize("pad_value", [-100, 64, 10**9])
def test_padding_may_hold_any_id(target, pad_value):
    """Masked positions never reach the embedding: -100 (a label's ignore index), the vocabulary size or any id
    in a padded batch, and a list of prompts padded with such a pad_token_id, decode as each row alone."""
    rows = [torch.tensor([3, 7, 1, 9]), torch.tensor([5, 2])]
    alone = [generate(target, r[None], max_new_tokens=5).sequences[0, len(r):] for r in rows]
    ids = torch.tensor([[3, 7, 1, 9], [pad_value, pad_value, 5, 2]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    out = generate(target, ids, attention_mask=mask, drafter=PromptLookup(), max_new_tokens=5)
    assert torch.equal(out.sequences[:, :4], ids)  # the prompts as given, padding kept
    assert all(torch.equal(out.sequences[b, 4:], alone[b]) for b in range(2))
    listed = generate(target, rows, pad_token_id=pad_value, max_new_tokens=5)
    assert all(torch.equal(listed.sequences[b, 4:], alone[b]) for b in range(2))


def test_a_float_attention_mask_is_told_its_dtype(target):
    ids = torch.tensor([[0, 3, 7], [5, 2, 4]])
    for mask in (torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), torch.tensor([[0, 1, 1], [1, 1, 1]]).half()):
        with pytest.raises(ValueError, match=rf"attention_mask must be an integer or bool tensor of 0 and 1, got a "
                                             rf"{mask.dtype} tensor: convert it with .long\(\)"):
            generate(target, ids, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_draft_distribution_is_refused_when_sampling(target, bad):
    """Sampling, rejection against a q_draft holding NaN or inf does not give the target's distribution: the step
    that meets one raises (it once decoded on, with a warning at the end)."""
    import dataclasses

    class BadDraft(DraftModel):
        def propose(self, *args, **kwargs):
            proposals = super().propose(*args, **kwargs)
            return dataclasses.replace(proposals, q_draft=torch.full_like(proposals.q_draft, bad))

    sampled = dict(tree=Tree.chain(3), max_new_tokens=12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"BadDraft proposed draft probabilities \(q_draft\) holding NaN or inf at "
                                         r"verification pass 1 \(temperature 1.0\)"):
        generate(target, PROMPT, drafter=BadDraft(perturbed(target), candidates="sample"), **sampled)
    broken = perturbed(target)  # the case as found: a draft model with NaN weights
    with torch.no_grad():
        for weight in broken.parameters():
            weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"DraftModel proposed .*NaN or inf at verification pass 1"):
        generate(target, PROMPT, drafter=DraftModel(broken, candidates="sample"), **sampled)
    out = generate(target, PROMPT, drafter=DraftModel(perturbed(target), candidates="sample"), **sampled)
    assert out.new_tokens == 12  # a finite q decodes as before
