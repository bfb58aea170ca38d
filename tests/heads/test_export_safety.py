"""An export never replaces what it did not write (heads/checkpoints/export.py): a user's model folder is refused unless
``overwrite``; a re-export into its own folder (its manifest) replaces its files, the other layout's included;
paths under a file are refused naming them."""

import json

import pytest

from treespec.heads.checkpoints.export import MANIFEST, export

from tests.helpers import random_eagle3, random_heads, tiny_llama


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, random_eagle3(target)


def test_a_users_model_folder_is_never_overwritten_silently(pair, tmp_path):
    target, drafter = pair
    user = tmp_path / "my-model"
    user.mkdir()
    files = {"config.json": b'{"mine": 1}', "model.safetensors": b"weights", "tokenizer.json": b"{}"}
    for name, data in files.items():
        (user / name).write_bytes(data)
    with pytest.raises(ValueError, match=r"already holds config.json, model.safetensors, which no treespec export "
                                         r"wrote.*overwrite=True"):
        export(drafter, target, user, to="vllm")
    assert {p.name: p.read_bytes() for p in user.iterdir()} == files  # untouched
    export(drafter, target, user, to="vllm", overwrite=True)
    assert json.loads((user / MANIFEST).read_text())["files"] == sorted(["config.json", MANIFEST, "model.safetensors"])
    assert (user / "tokenizer.json").read_bytes() == b"{}"


def test_a_re_export_into_its_own_folder_replaces_its_own_files(pair, tmp_path):
    target, _ = pair
    heads = random_heads(target)
    out = tmp_path / "export"
    export(heads, target, out, to="medusa", verifier="org/target")        # medusa_lm_head.pt
    assert (out / "medusa_lm_head.pt").is_file()
    export(heads, target, out, to="vllm")         # model.safetensors; the pickle it wrote before goes
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", MANIFEST])
    assert json.loads((out / MANIFEST).read_text())["to"] == "vllm"
    (out / "other.safetensors").write_bytes(b"x")  # a foreign checkpoint beside it is still refused
    with pytest.raises(ValueError, match="already holds other.safetensors"):
        export(heads, target, out, to="vllm")


def test_paths_under_a_file_and_a_broken_manifest_are_refused(pair, tmp_path):
    target, drafter = pair
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"a-file is a file, not a folder"):
        export(drafter, target, tmp_path / "a-file" / "sub", to="vllm")
    with pytest.raises(ValueError, match=r"a-file is a file, not a folder"):
        export(drafter, target, tmp_path / "a-file", to="vllm")
    out = tmp_path / "export"
    export(drafter, target, out, to="vllm")
    (out / MANIFEST).write_text(json.dumps({"files": ["../../etc/passwd"]}))
    with pytest.raises(ValueError, match=r"export manifest .*'files' must be a list of file names"):
        export(drafter, target, out, to="vllm")
