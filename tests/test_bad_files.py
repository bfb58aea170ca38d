"""Loading names the file: drafter folders and model folders that are missing, truncated, corrupt, mistyped,
linked to a device, or point outside themselves are refused with an error naming the file (and tensor or
field); nothing pickled ever runs; a model folder never loads with tensors left randomly initialised."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from treespec.heads import load
from treespec.heads.eagle import EagleModel
from treespec.heads.medusa import MedusaHeads
from treespec.reference import load_model

from tests.helpers import tiny_llama


# -- drafter folders ----------------------------------------------------------------------------------------
@pytest.fixture
def medusa_folder(tmp_path):
    target = tiny_llama(seed=0)
    MedusaHeads(32, 64, num_heads=2, lm_head=target.get_output_embeddings()).save_pretrained(tmp_path)
    return target, tmp_path


def test_corrupt_medusa_weights_are_refused(medusa_folder):
    target, folder = medusa_folder
    path = folder / "medusa.safetensors"
    weights = dict(load_file(path))
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


def test_medusa_config_that_is_not_an_object_is_named(medusa_folder):
    target, folder = medusa_folder
    (folder / "medusa_config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"medusa_config.json must hold a JSON object, got list"):
        MedusaHeads.from_pretrained(folder, target)


def test_deeply_nested_json_is_named(medusa_folder):
    target, folder = medusa_folder
    (folder / "medusa_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"medusa_config.json nests too deeply"):
        MedusaHeads.from_pretrained(folder, target)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_weights_in_a_drafter_folder_are_refused(medusa_folder, dtype):
    """int32 and bool weights were once cast to float silently."""
    target, folder = medusa_folder
    path = folder / "medusa.safetensors"
    weights = load_file(path)
    weights["blocks.0.0.linear.weight"] = weights["blocks.0.0.linear.weight"].to(dtype)
    save_file(weights, path)
    with pytest.raises(ValueError, match=r"Medusa weights in .*blocks.0.0.linear.weight .*should hold floating-point"):
        MedusaHeads.from_pretrained(folder, target)


def test_weight_file_linked_to_a_device_is_named(medusa_folder):
    target, folder = medusa_folder
    (folder / "medusa.safetensors").unlink()
    os.symlink("/dev/zero", folder / "medusa.safetensors")
    with pytest.raises(ValueError, match=r"medusa.safetensors \(a link to /dev/zero\) is not a regular file"):
        MedusaHeads.from_pretrained(folder, target)


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/elsewhere.safetensors"])
def test_shard_paths_outside_the_folder_are_refused(tmp_path, shard):
    target = tiny_llama(seed=0)
    folder = tmp_path / "upstream"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": shard}}))
    with pytest.raises(ValueError, match=r"names shards outside its folder .*shard paths must be file names inside"):
        load(folder, target)


# -- model folders (treespec.reference.load_model) ---------------------------------------------------------
@pytest.fixture
def model_folder(tmp_path):
    """A tiny Llama's folder: (the folder, its tensors)."""
    folder = tmp_path / "model"
    tiny_llama(seed=0).save_pretrained(folder)
    return folder, load_file(folder / "model.safetensors")


def edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


Q = "model.layers.0.self_attn.q_proj.weight"


def test_model_folder_with_nan_weights_is_refused(model_folder):
    folder, weights = model_folder
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"hold NaN or infinite values"):
        load_model(folder)


def test_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no folder at .*nowhere"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("damage, message", [
    (lambda w: w.pop(Q), r"missing \(transformers would leave them randomly initialised\): " + Q),
    (lambda w: w.update({Q: w[Q].int()}), r"model.safetensors holds integer or boolean tensors .*" + Q + r" \(I32\)"),
    (lambda w: w.update({Q: w[Q][:16]}), Q + r" \(16, 32\) in the file, \(32, 32\) by the config"),
])
def test_model_folder_tensors_are_checked(model_folder, damage, message):
    """A folder without one tensor once loaded with transformers' random initialisation in its place (greedy
    output changed, the only sign a load report on stderr); int32 weights were cast."""
    folder, weights = model_folder
    damage(weights)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_truncated_or_linked_model_weights_name_the_file(model_folder):
    folder, _ = model_folder
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"weight file .*model.safetensors cannot be read as safetensors"):
        load_model(folder)
    path.unlink()
    os.symlink("/dev/zero", path)
    with pytest.raises(ValueError, match=r"model.safetensors \(a link to /dev/zero\) is not a regular file"):
        load_model(folder)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": "abc"}, r"cannot load the model in .*hidden_size.*expected int, got str"),
    ({"dtype": "float99"}, r"config.json: dtype='float99' is not a floating-point torch dtype"),
])
def test_bad_model_config_fields_are_named(model_folder, fields, message):
    folder, _ = model_folder
    edit_config(folder, **fields)
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def test_bad_model_config_files_are_named(model_folder):
    folder, _ = model_folder
    (folder / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got list"):
        load_model(folder)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"config.json nests too deeply"):
        load_model(folder)


def test_load_model_dtype_is_checked(model_folder):
    with pytest.raises(ValueError, match=r"dtype must be a floating-point torch dtype .* got 'float99'"):
        load_model(model_folder[0], dtype="float99")


class Plant:
    """Unpickling this creates ``marker``: what a malicious pytorch_model.bin would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickle_payload_in_a_model_folder_is_refused_unrun(model_folder, tmp_path):
    folder, _ = model_folder
    (folder / "model.safetensors").unlink()
    torch.save({Q: Plant(tmp_path / "pwned")}, folder / "pytorch_model.bin")
    torch.load(folder / "pytorch_model.bin", weights_only=False)  # the plant works: unpickling runs it
    assert (tmp_path / "pwned").exists()
    (tmp_path / "pwned").unlink()
    with pytest.raises(ValueError, match=r"pickled weights in .* hold objects other than tensors: refused"):
        load_model(folder)
    assert not (tmp_path / "pwned").exists()


def test_model_shards_outside_the_folder_are_refused(model_folder):
    folder, weights = model_folder
    (folder / "model.safetensors").rename(folder.parent / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {k: "../outside.safetensors" for k in weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names shards outside its folder \(../outside.safetensors\)"):
        load_model(folder)


def test_a_vllm_medusa_export_missing_one_bias_is_refused(tmp_path):
    """Its config says medusa_fc_bias: a deleted bias tensor would load as zeros, silently."""
    from treespec.heads.checkpoints.export import export

    from tests.helpers import random_heads

    target = tiny_llama(seed=0)
    heads = random_heads(target, num_heads=3)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.bias.normal_(0, 0.1)
    out = export(heads, target, tmp_path / "vllm", to="vllm")
    assert json.loads((out / "config.json").read_text())["medusa_fc_bias"] is True
    assert load(out, target) is not None  # whole, it loads
    weights = dict(load_file(out / "model.safetensors"))
    del weights["blocks.2.layers.0.bias"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors.*biases are missing for head 2 block 0"):
        load(out, target)


@pytest.mark.parametrize("values, message", [
    ([[0.5, float("nan")], [0.4]], r"depth 1 holds \[nan\]"),
    ([[0.5, 0.3], [1.5]], r"depth 2 holds \[1.5\]; rank accuracies are chances in \[0, 1\]"),
    ([[0.7, 0.6]], r"depth 1's rank accuracies sum to 1.3000 > 1"),
    ([["0.5"]], r"depth 1 holds \['0.5'\]"),
])
def test_a_head_accuracy_file_out_of_range_is_refused_at_load(medusa_folder, values, message):
    from treespec.heads import load_profile

    _, folder = medusa_folder
    (folder / "head_accuracy.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match=rf"accuracy file .*head_accuracy.json: {message}"):
        load_profile(folder)


def test_a_tree_file_whose_kind_is_not_a_string_is_named(tmp_path):
    from treespec import Tree
    from treespec.planning.tree_spec import build_tree, load_tree

    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"kind": ["paths"], "paths": [[0]]}))
    for read in (Tree.load, load_tree):
        with pytest.raises(ValueError, match=r"tree.json: its kind must be a string .*, got \['paths'\]"):
            read(path)
    with pytest.raises(ValueError, match=r"kind \['chain'\] is not one of"):
        build_tree({"kind": ["chain"], "depth": 2})


def test_writing_under_a_file_names_it(tmp_path):
    from treespec import Tree

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"a-file is a file, not a folder"):
        Tree.chain(2).save(tmp_path / "a-file" / "tree.json")
    with pytest.raises(ValueError, match=r"is a folder; give a file path"):
        Tree.chain(2).save(tmp_path)
