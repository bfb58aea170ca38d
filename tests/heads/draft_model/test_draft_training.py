"""A draft model distilled from a given target (``scripts/train_heads.py drafter=draft``): its loss is the KL from the
target's distribution on the scored positions, its embedding can start from the target's principal directions, a
run exports a transformers folder that ``treespec.heads.load`` reads and that decodes losslessly, an interrupted run
resumes to the same weights, and a bad architecture is refused before any model loads. Training from stored
features: tests/train/training/test_features.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from treespec import Tree, generate
from treespec.heads import load, load_profile
from treespec.heads.checkpoints import local_profile
from treespec.heads.draft_model.network import draft_config, new_draft_model, principal_embedding
from treespec.heads.draft_model.objective import draft_loss
from treespec.heads.registry import detect
from treespec.planning.autotree import measure_cost_curve
from treespec.planning.chain_tau import DEPTH
from treespec.reference import load_model
from treespec.sampling import Sampling
from treespec.train.training import drafter_job as train_heads

from tests.helpers import (
    TINY_DRAFT,
    compose_cfg,
    conversations,
    heads_cfg,
    hf_greedy,
    tiny_chat_target,
    tiny_llama,
    write_jsonl,
)

ARCH = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2}


def test_loss_is_the_kl_on_scored_positions_and_vanishes_for_the_target_itself():
    target = tiny_llama(vocab=64, hidden=32, seed=0)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 7:9] = True
    torch.manual_seed(1)
    draft = new_draft_model(target, ARCH)
    loss, metrics = draft_loss(target, draft, {"input_ids": ids, "loss_mask": mask}, ce_weight=0.5)
    with torch.no_grad():  # by hand: position j predicts token j + 1, scored where token j + 1 is trained on
        log_p = torch.log_softmax(target(input_ids=ids[:, :-1]).logits, -1)[mask[:, 1:]]
        log_q = torch.log_softmax(draft(input_ids=ids[:, :-1]).logits, -1)[mask[:, 1:]]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ce = -log_q.gather(1, ids[:, 1:][mask[:, 1:]][:, None]).mean()
    assert log_p.shape[0] == 8
    torch.testing.assert_close(loss, kl + 0.5 * ce, atol=1e-5, rtol=1e-5)
    assert metrics["kl"] == pytest.approx(kl.item(), abs=1e-5) and metrics["ce"] == pytest.approx(ce.item(), abs=1e-5)
    loss.backward()
    assert draft.get_input_embeddings().weight.grad.abs().sum() > 0

    # a draft holding the target's own weights: nothing to learn, every argmax agrees
    arch = {k: getattr(target.config, k) for k in (*ARCH, "tie_word_embeddings")}
    same = LlamaForCausalLM(draft_config(target, arch))
    same.load_state_dict(target.state_dict())
    loss, metrics = draft_loss(target, same, ids)
    assert abs(loss.item()) < 1e-5 and metrics["top1"] == 1.0


def test_draft_takes_the_targets_vocabulary_and_special_tokens():
    target = tiny_llama(vocab=80, hidden=32)
    target.config.bos_token_id, target.config.eos_token_id, target.config.pad_token_id = 1, [2, 3], 0
    config = new_draft_model(target, ARCH).config
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id) == (80, 1, [2, 3], 0)
    assert config.tie_word_embeddings and config.max_position_embeddings == target.config.max_position_embeddings


def test_target_embeddings_start_from_the_principal_directions():
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(300, 8, generator=g) @ torch.randn(8, 8, generator=g)  # correlated directions
    projected = principal_embedding(embedding, 3)  # [300, 3]
    centred = (embedding - embedding.mean(0)).double()
    variances = torch.linalg.eigvalsh(centred.T @ centred).flip(0)
    cov = projected.double().T @ projected.double()  # uncorrelated columns, the three largest variances in order
    torch.testing.assert_close(cov, torch.diag(variances[:3]), atol=1e-3 * variances[0].item(), rtol=0)
    full = principal_embedding(embedding, 8).double()  # every direction: a rotation of the centred rows
    torch.testing.assert_close(full @ full.T, centred @ centred.T, atol=1e-3, rtol=1e-4)  # inner products kept

    target = tiny_llama(vocab=64, hidden=32)
    narrow = new_draft_model(target, ARCH, "target_embeddings")
    torch.testing.assert_close(narrow.get_input_embeddings().weight,
                               principal_embedding(target.get_input_embeddings().weight, 16))
    assert narrow.get_output_embeddings().weight is narrow.get_input_embeddings().weight  # tied
    same_width = new_draft_model(target, {**ARCH, "hidden_size": 32}, "target_embeddings")
    assert torch.equal(same_width.get_input_embeddings().weight, target.get_input_embeddings().weight)
    with pytest.raises(ValueError, match=r"init=target_embeddings needs drafter.arch.hidden_size <= the target's "
                                         r"hidden size 32, got 64: use init=random"):
        new_draft_model(target, {**ARCH, "hidden_size": 64}, "target_embeddings")


@pytest.mark.parametrize("override, message", [
    ("drafter.arch.hidden_size=30", r"hidden_size=30 must be a multiple of num_attention_heads=4"),
    ("drafter.arch.num_key_value_heads=3", r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ("drafter.arch.num_hidden_layers=0", r"drafter.arch.num_hidden_layers must be an integer >= 1, got 0"),
    ("+drafter.arch.vocab_size=5", r"unknown key\(s\) vocab_size; it takes hidden_size.*vocabulary and special token"),
    ("~drafter.arch.intermediate_size", r"drafter.arch needs intermediate_size"),
    ("drafter.init=pca", r"drafter.init must be one of random, target_embeddings, got 'pca'"),
    ("drafter.ce_weight=-1", r"drafter.ce_weight must be a number >= 0"),
    ("drafter.export_dtype=int8", r"drafter.export_dtype must be float32, bfloat16 or float16"),
    ("+drafter.arch.max_position_embeddings=64", r"max_position_embeddings=64 is below trainer.seq_len=256"),
])
def test_bad_draft_configs_are_refused_before_any_model_loads(override, message):
    with pytest.raises(ValueError, match=message):
        train_heads.check_config(compose_cfg("train_heads", ["drafter=draft", "target=/no/such/target", override]))


def test_a_run_exports_a_model_folder_that_loads_and_decodes_losslessly_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    # the export's cost curves (three sizes: heads_cfg) briefly timed: most of a run's time otherwise
    monkeypatch.setattr(local_profile, "measure_cost_curve", lambda model, sizes, past_len, before=None:
                        measure_cost_curve(model, sizes, past_len=8, repeats=2, before=before))
    target_dir = tiny_chat_target(tmp_path / "target")
    source = write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    common = [*TINY_DRAFT, "trainer.max_steps=8", "optim.lr=1e-2", "eval.expected_tau=null"]
    train_heads.run(heads_cfg(tmp_path / "a", target_dir, source, *common, "trainer.stop_after=3", drafter="draft"))
    resumed = train_heads.run(heads_cfg(tmp_path / "a", target_dir, source, *common, "resume=true", drafter="draft"))
    whole = train_heads.run(heads_cfg(tmp_path / "b", target_dir, source, *common, drafter="draft"))
    assert whole["steps"] == resumed["steps"] == 8
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    final = tmp_path / "b" / "final"
    assert detect(final).format == "transformers"
    assert {"config.json", "tokenizer_config.json", "head_accuracy.json", "cost_curve.json", "chain_tau.json"} <= \
        {p.name for p in final.iterdir()}
    # its cost model and its sampled chains' τ, for tree=auto: load_profile on this machine reads them as they are
    target, _ = load_model(target_dir)
    monkeypatch.setattr(local_profile, "measure_cost_model", lambda *a, **k: pytest.fail("measured again"))
    profile = load_profile(final, target, log=lambda *_: None)
    assert profile.costs.draft_cost_per_depth > 0 and set(profile.costs.curve) == {1, 2, 4}
    assert [m.sampling for m in profile.chain_taus()] == [Sampling(1.0)]
    assert all(len(t) == DEPTH + 1 for t in profile.chain_taus()[0].tau.values())  # γ = 0..8
    accuracy = json.loads((final / "head_accuracy.json").read_text())
    assert len(accuracy) == 2 and whole["depth1_top1"] == pytest.approx(accuracy[0][0])
    assert "a draft model is a transformers model folder already" in whole["export_formats"]["vllm"]
    draft_alone, tokenizer = load_model(final)  # a folder that loads on its own: the target's tokenizer beside it
    assert len(tokenizer) == draft_alone.config.vocab_size
    # the distillation moved the draft towards the target on the training data
    rows = [json.loads(line).get("metrics", {}) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["train/kl"] for r in rows if "train/kl" in r]
    assert kl[-1] < kl[0]

    target, _ = load_model(target_dir)
    drafter = load(final, target)
    prompt = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = hf_greedy(target, prompt, 12)
    for tree in (Tree.chain(3), Tree.full(2, 2)):
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=12)
        assert torch.equal(out.sequences, expected), tree
