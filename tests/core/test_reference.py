"""The shipped reference models load by name, have the documented sizes, and tokenize code exactly."""

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.heads import DraftModel


@pytest.fixture(scope="module")
def models():
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    return target, draft, tokenizer


def test_parameter_counts(models):
    target, draft, _ = models
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 15e6 <= n_target <= 25e6
    assert 0.05 <= n_draft / n_target <= 0.15  # about a tenth
    assert target.config.max_position_embeddings >= 512
    assert type(target).__name__ == "LlamaForCausalLM"


def test_tokenizer_round_trip_on_code(models):
    *_, tokenizer = models
    for text in reference.prompts()[:5] + ["def f(x):\n\treturn {'a': x ** 2}  # ünïcode ✓\n"]:
        assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown reference model 'giant'"):
        reference.load("giant")


def test_reference_speculation_is_lossless_greedy(models):
    target, draft, tokenizer = models
    prompt = tokenizer(reference.prompts()[0], return_tensors="pt").input_ids
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
    out = generate(target, prompt, drafter=DraftModel(draft), tree=Tree.full(2, 2), max_new_tokens=32,
                   eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])
    assert out.mean_accept_length > 1.2  # a trained draft agrees with the target often


def test_shipped_medusa_heads_load_and_decode_losslessly(models):
    import json

    from treespec.heads.medusa import Medusa, MedusaHeads

    target, _, tokenizer = models
    folder = reference.MODELS_DIR / "medusa"
    heads = MedusaHeads.from_pretrained(folder, target)
    accuracy = json.loads((folder / "head_accuracy.json").read_text())
    assert len(accuracy) == heads.num_heads and accuracy[0][0] > accuracy[-1][0]  # nearer heads are better
    prompt = tokenizer(reference.prompts()[1], return_tensors="pt").input_ids
    vanilla = generate(target, prompt, max_new_tokens=24)
    out = generate(target, prompt, drafter=Medusa(heads), tree=Tree.full(2, 2), max_new_tokens=24)
    assert torch.equal(out.sequences, vanilla.sequences) and out.mean_accept_length > 1.0


def test_shipped_medusa2_pairs_heads_with_its_fine_tuned_target(models):
    """Medusa-2's heads decode losslessly against ITS target (transformers' greedy of the fine-tuned model), which
    was trained: its weights differ from the reference target's, its size does not."""
    from treespec.heads import load

    target, _, tokenizer = models
    tuned, _ = reference.load_model("reference:medusa2/target")
    assert sum(p.numel() for p in tuned.parameters()) == sum(p.numel() for p in target.parameters())
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    drafter = load("reference:medusa2", tuned)
    prompt = tokenizer(reference.prompts()[2], return_tensors="pt").input_ids
    expected = tuned.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    out = generate(tuned, prompt, drafter=drafter, tree=Tree.full(2, 2), max_new_tokens=24,
                   eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]]) and out.mean_accept_length > 1.0


def test_shipped_eagle_loads_and_decodes_losslessly(models):
    import json

    from treespec.dynamic_tree import DynamicTree
    from treespec.heads.eagle import Eagle, EagleModel

    target, _, tokenizer = models
    folder = reference.MODELS_DIR / "eagle"
    eagle = EagleModel.from_pretrained(folder, target)
    accuracy = json.loads((folder / "head_accuracy.json").read_text())
    assert len(accuracy) >= 4 and accuracy[0][0] > 0.5  # a feature-level drafter agrees with the target often
    prompt = tokenizer(reference.prompts()[1], return_tensors="pt").input_ids
    vanilla = generate(target, prompt, max_new_tokens=24)
    for tree in (Tree.full(2, 2), DynamicTree(8, 4, 3)):
        out = generate(target, prompt, drafter=Eagle(eagle), tree=tree, max_new_tokens=24)
        assert torch.equal(out.sequences, vanilla.sequences) and out.mean_accept_length > 1.5


def test_shipped_eagle3_loads_and_decodes_losslessly(models):
    from treespec.dynamic_tree import DynamicTree
    from treespec.heads import registry
    from treespec.heads.training.accuracy import read_accuracy

    target, _, tokenizer = models
    folder = reference.MODELS_DIR / "eagle3"
    drafter = registry.build("eagle3", target, "reference:eagle3")  # the same public path as the others
    accuracy = read_accuracy(folder)
    assert len(accuracy) >= 4 and accuracy[0][0] > 0.4
    assert drafter.model.draft_vocab_size < drafter.model.vocab_size  # a reduced draft vocabulary
    prompt = tokenizer(reference.prompts()[1], return_tensors="pt").input_ids
    vanilla = generate(target, prompt, max_new_tokens=24)
    for tree in (Tree.full(2, 2), DynamicTree(8, 4, 3)):
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=24)
        assert torch.equal(out.sequences, vanilla.sequences) and out.mean_accept_length > 1.3


def test_load_reads_every_shipped_drafter_including_the_draft_model():
    """``treespec.heads.load`` detects each shipped folder's kind; the draft model is a transformers folder
    (format "transformers") and decodes losslessly once loaded so."""
    from treespec.heads import Eagle, Eagle3, Hydra, Medusa, load, registry

    target, tokenizer = reference.load("target")
    expected = {"draft": ("transformers", DraftModel), "eagle": ("treespec", Eagle), "eagle3": ("treespec", Eagle3),
                "medusa": ("treespec", Medusa), "hydra": ("treespec", Hydra)}
    for name, (fmt, cls) in expected.items():
        assert registry.detect(reference.resolve(f"reference:{name}")).format == fmt
        assert type(load(f"reference:{name}", target)) is cls
    ids = tokenizer(reference.prompts()[0][:300], return_tensors="pt").input_ids
    vanilla = generate(target, ids, max_new_tokens=24).sequences
    out = generate(target, ids, drafter=load("reference:draft", target), tree=Tree.full(2, 2), max_new_tokens=24)
    assert torch.equal(out.sequences, vanilla)
