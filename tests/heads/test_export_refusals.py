"""What an export refuses, before anything is written (heads/checkpoints/export.py; the exports that succeed:
tests/heads/test_interop_export.py): a drafter a consumer cannot represent (its layer, biases, aux layers, norms,
tables), a folder that already holds other files, an unknown consumer, a training run whose ``export_to`` names a
consumer its drafter cannot reach (checked at start-up), and a verifier only this machine can resolve.
"""

import json

import pytest
import torch

from treespec.heads import load
from treespec.heads.checkpoints.export import export
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model
from treespec.heads.medusa import MedusaHeads

from tests.helpers import compose_cfg, fresh_drafter, interop_targets, synthesise, tiny_qwen3


@pytest.fixture(scope="module")
def targets():
    return interop_targets()

# -- what a consumer cannot represent ----------------------------------------------------------------------------------
def test_exports_that_a_consumer_cannot_represent_are_refused(tmp_path, targets):
    llama, qwen = targets["llama"], targets["qwen2"]
    torch.manual_seed(0)
    untied = MedusaHeads(32, 64, num_heads=2, num_layers=2, lm_head=llama.get_output_embeddings())
    with torch.no_grad():
        untied.blocks[0][1].linear.weight.normal_()
    cases = [
        (EagleModel(llama), llama, "sglang", "input norm on layer 0 and a final norm"),
        (EagleModel(llama, feature_layers=(1, 2, -1), variant="upstream"), llama, "vllm", "fused EAGLE drafter"),
        (EagleModel(llama, variant="upstream"), llama, "vllm", r"no fc\.bias .* nonzero"),
        (EagleModel(llama, variant="upstream"), llama, "speculators", "eagle3 format only"),
        (EagleModel(llama, variant="upstream"), llama, "medusa", "cannot be written as Medusa"),
        (Eagle3Model(qwen, layer="target"), qwen, "sglang",  # the target's own class: Qwen2's q/k/v biases
         r"no midlayer\.self_attn\.[qkv]_proj\.bias \(SGLang's EAGLE-3 q/k/v"),
        (Eagle3Model(llama), llama, "eagle", r"hard-codes aux layers \(2, L//2, L-3\)"),
        (Eagle3Model(llama, aux_layers=(0, 2, 3)), llama, "vllm", "inputs of decoder layers 1..3 only"),
        (Eagle3Model(llama), llama, "medusa", "cannot be written as Medusa"),
        (MedusaHeads(32, 64, num_heads=2, lm_head=llama.get_output_embeddings()), llama, "sglang",
         "does not load Medusa"),
        (untied, llama, "medusa", "repeats one residual block"),
    ]
    for module, target, consumer, message in cases:
        with pytest.raises(Refused, match=message):
            export(module, target, tmp_path / "x", to=consumer)
        assert not (tmp_path / "x").exists()  # nothing written
    nbr = load(synthesise("eagle3-speculators-llama", tmp_path, targets)[1], llama).model
    with pytest.raises(Refused, match="norm_before_residual"):
        export(nbr, llama, tmp_path / "y", to="sglang")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds pytorch_model.bin"):
        export(Eagle3Model(llama), llama, tmp_path / "z", to="vllm")
    with pytest.raises(ValueError, match="to must be one of"):
        export(Eagle3Model(llama), llama, tmp_path / "w", to="tgi")



# -- before training, and the verifier's name --------------------------------------------------------------------------
def test_training_checks_export_targets_at_start_up(capsys):
    from treespec.heads.eagle3 import objective as eagle3_recipe
    from treespec.train.training.exportable import check_export_targets

    qwen3 = tiny_qwen3()
    state = torch.random.get_rng_state()
    cfg = compose_cfg("train_heads", ["drafter=eagle3", "drafter.draft_vocab_size=24", "export_to=[vllm,speculators]"])
    assert {"vllm", "sglang", "speculators"} <= set(check_export_targets(cfg, qwen3, eagle3_recipe.recipe))
    assert torch.equal(state, torch.random.get_rng_state())  # the probe leaves the run's seed alone
    assert "eagle3: exportable to" in capsys.readouterr().out
    cfg = compose_cfg("train_heads", ["drafter=eagle3", "drafter.layer=target", "export_to=[vllm]"])
    with pytest.raises(ValueError, match=r"export_to names vllm, which this eagle3 drafter cannot be exported to: "
                                         r"vllm: .*q/k norms.*\(drafter\.layer=llama"):
        check_export_targets(cfg, qwen3, eagle3_recipe.recipe)


def test_the_verifier_is_a_name_another_machine_resolves(tmp_path, targets):
    """speculators records the target it verifies with; a local folder would fail on any other machine."""
    llama = targets["llama"]
    model = fresh_drafter("eagle3", llama)
    llama.config._name_or_path = str(tmp_path / "my-target")
    (tmp_path / "my-target").mkdir()
    try:
        with pytest.raises(ValueError, match=r"local folder .*my-target.* verifier='org/name' .*--verifier"):
            export(model, llama, tmp_path / "a", to="speculators")
        assert not (tmp_path / "a").exists()
        folder = export(model, llama, tmp_path / "b", to="speculators", verifier="org/target")
        assert json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] \
            == "org/target"
        export(model, llama, tmp_path / "c", to="vllm")  # vLLM's own layout records no verifier
        llama.config._name_or_path = "meta-llama/Llama-3.1-8B-Instruct"
        folder = export(model, llama, tmp_path / "d", to="speculators")
        assert json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] \
            == "meta-llama/Llama-3.1-8B-Instruct"
    finally:
        llama.config._name_or_path = ""
