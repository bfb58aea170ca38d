"""Every bad input found by the reliability probe fails at the door with a message naming the problem, or
works as a user would expect; plus a fuzz test over random trees, prompts and sampling settings."""

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from treespec import Tree, generate
from treespec.heads import DraftModel, Medusa, MedusaHeads, PromptLookup
from treespec.heads.eagle import EagleModel
from treespec.reference import load_model

from .tiny_models import hf_greedy, perturbed, tiny_llama

PROMPT = torch.tensor([[3, 7, 1, 9, 4, 2]])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("form", [int, np.int64, torch.tensor, lambda t: torch.tensor([t]), lambda t: [t],
                                  lambda t: (63 - t, t)])
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
    ({"tree": [(0,), (1,)], "drafter": PromptLookup()}, r"tree must be a Tree, a DynamicTree or a tree-spec dict"),
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


def test_tree_spec_dict_is_accepted_wherever_a_tree_is(target):
    draft = DraftModel(perturbed(target, 0.1))
    a = generate(target, PROMPT, drafter=draft, tree={"kind": "full", "width": 2, "depth": 2}, max_new_tokens=10)
    b = generate(target, PROMPT, drafter=draft, tree=Tree.full(2, 2), max_new_tokens=10)
    assert torch.equal(a.sequences, b.sequences) and a.accept_lengths == b.accept_lengths


def test_tiny_temperature_is_the_greedy_limit(target):
    """temperature=1e-38 used to overflow logits / T to inf and emit garbage; now it is argmax decoding."""
    out = generate(target, PROMPT, max_new_tokens=12, temperature=1e-38, generator=torch.Generator().manual_seed(0))
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


# -- loading: files are named, corrupt weights refused --------------------------------------------------
@pytest.fixture
def medusa_folder(tmp_path):
    target = tiny_llama(seed=0)
    MedusaHeads(32, 64, num_heads=2, lm_head=target.get_output_embeddings()).save_pretrained(tmp_path)
    return target, tmp_path


def test_corrupt_medusa_weights_are_refused(medusa_folder):
    target, folder = medusa_folder
    path = folder / "medusa.safetensors"
    weights = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(path))
    name = next(iter(weights))
    weights[name][..., 0] = float("nan")
    save_file(weights, path)
    with pytest.raises(ValueError, match=rf"medusa.safetensors.*{name}.*non-finite"):
        MedusaHeads.from_pretrained(folder, target)


def test_truncated_weights_name_the_file(medusa_folder):
    target, folder = medusa_folder
    path = folder / "medusa.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"medusa.safetensors cannot be read"):
        MedusaHeads.from_pretrained(folder, target)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("num_heads"), r"missing num_heads"),
    (lambda c: c.update(dropout=0.1), r"unknown dropout"),
    (lambda c: c.update(hidden_size="32"), r"bad hidden_size='32' \(expected int\)"),
])
def test_bad_medusa_config_is_named(medusa_folder, edit, message):
    target, folder = medusa_folder
    path = folder / "medusa_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        MedusaHeads.from_pretrained(folder, target)


def test_broken_json_names_the_file(medusa_folder):
    target, folder = medusa_folder
    (folder / "medusa_config.json").write_text('{"drafter": "medusa", "hidden')
    with pytest.raises(ValueError, match=r"medusa_config.json is not valid JSON"):
        MedusaHeads.from_pretrained(folder, target)


def test_eagle_config_without_fields_is_named(tmp_path):
    target = tiny_llama(seed=0)
    EagleModel(target).save_pretrained(tmp_path)
    (tmp_path / "eagle_config.json").write_text(json.dumps({"drafter": "eagle"}))
    with pytest.raises(ValueError, match=r"EAGLE config in .* needs 'feature_layers'"):
        EagleModel.from_pretrained(tmp_path, target)


def test_model_folder_with_nan_weights_is_refused(tmp_path):
    model = tiny_llama(seed=0)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"hold NaN or infinite values"):
        load_model(tmp_path)


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no folder at .*nowhere"):
        load_model(tmp_path / "nowhere")


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
