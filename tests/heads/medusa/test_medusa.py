"""Medusa heads: lossless decoding (greedy and sampled), load-time checks, the hydra training entry."""

import json

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate
from treespec.heads import registry
from treespec.heads.medusa import Medusa, MedusaHeads
from treespec.heads.medusa.objective import medusa_loss
from treespec.planning.analysis import grow_tree
from treespec.reference import load_model
from treespec.sampling import Sampling
from treespec.train.training.data import TokenBatches

from tests.helpers import (
    PROMPT,
    RUNS,
    VOCAB,
    chi2_pvalue,
    compose_cfg,
    exact_distribution,
    hf_greedy,
    random_heads,
    sampled_counts,
    tiny_llama,
    wandb_run_contains,
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("tree", [Tree.chain(3), Tree.full(2, 2), grow_tree([[0.5, 0.2, 0.1], [0.3, 0.1], [0.2]], 6)])
@pytest.mark.parametrize("share", [True, False])
def test_medusa_greedy_equals_vanilla(target, tree, share):
    prompt = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(5))
    out = generate(target, prompt, drafter=Medusa(random_heads(target, share=share)), tree=tree, max_new_tokens=30)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 30))


def test_untrained_shared_heads_repeat_the_base_prediction(target):
    """Zero-initialised blocks are the identity: every head predicts what the base lm_head predicts."""
    heads = MedusaHeads(32, 64, num_heads=2, lm_head=target.get_output_embeddings())
    hidden = torch.randn(5, 32)
    assert torch.equal(heads(hidden)[1], target.get_output_embeddings()(hidden))
    assert heads.blocks[0][0] is not heads.blocks[1][0]  # distinct modules, not one block repeated


def test_medusa_sampling_is_lossless():
    small = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)
    sampling = Sampling(1.0)
    counts = sampled_counts(small, Medusa(random_heads(small, num_heads=2, scale=2.0)), Tree.full(2, 2), sampling)
    assert counts.sum() == RUNS
    assert chi2_pvalue(counts, exact_distribution(small, sampling)) > 1e-3


def test_mismatched_heads_are_refused(target, tmp_path):
    random_heads(target).save_pretrained(tmp_path)
    other = tiny_llama(hidden=48, seed=1)
    with pytest.raises(ValueError, match=r"Medusa drafter was trained for another target: hidden_size 32 \(drafter\) "
                                         r"vs 48 \(target\).*available\.<name>\.source"):
        MedusaHeads.from_pretrained(tmp_path, other)
    with pytest.raises(ValueError, match=r"vocab_size 64 \(drafter\) vs 80 \(target\)"):
        MedusaHeads.from_pretrained(tmp_path, tiny_llama(vocab=80, seed=1))
    loaded = MedusaHeads.from_pretrained(tmp_path, target)
    # refused at the door, naming the tree as given, also when max_new_tokens would cut it to a depth that fits,
    # and (once left unsaid) the number of heads and how to have more
    for budget in (8, 2):
        with pytest.raises(ValueError, match=r"tree Tree\(nodes=4, depth=4, width=1\) is deeper than the 3 levels "
                                             r"Medusa can fill: its 3 heads fill one depth each; give a tree of depth "
                                             r"<= 3, or train more heads \(drafter.num_heads in conf/drafter/"
                                             r"medusa.yaml: scripts/train_heads.py drafter=medusa\)"):
            generate(target, PROMPT, drafter=Medusa(loaded), tree=Tree.chain(4), max_new_tokens=budget)


def test_training_entry_lowers_loss_resumes_and_logs_acceptance(tmp_path, tiny_trained_target):
    from treespec.train.training import drafter_job as heads_training

    target_dir, cache = tiny_trained_target
    common = ["debug=tiny_heads", f"target={target_dir}", cache, "tree=accuracy", "tree.nodes=6"]

    # interrupted after 15 steps, then resumed: the same heads as one uninterrupted run
    heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "trainer.stop_after=15"]))
    resumed = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "resume=true"]))
    whole = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'b'}", "logger=none"]))
    assert whole["steps"] == resumed["steps"] == 60

    a, b = (load_file(tmp_path / r / "final" / "medusa.safetensors") for r in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    assert resumed["eval_tree_nodes"] == 6 and resumed["eval_mean_accept_length"] > 1.0

    # the loss on a fixed batch of the (self-distilled) training data went down
    target, _ = load_model(str(target_dir))
    stream = load_file(next((tmp_path / "cache").glob("distill-*.safetensors")))["tokens"]
    batch = TokenBatches(stream, 32, 8).batch(0)
    untrained = MedusaHeads(32, target.config.vocab_size, num_heads=4, lm_head=target.get_output_embeddings())
    trained = MedusaHeads.from_pretrained(tmp_path / "b" / "final", target)
    with torch.no_grad():
        before = medusa_loss(target, untrained, batch, 0.8)[0]
        after = medusa_loss(target, trained, batch, 0.8)[0]
    assert after < before - 0.5

    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    hist = [r["histogram"]["eval/accept_length"] for r in rows if "histogram" in r]
    assert hist and sum(hist[0]) / len(hist[0]) == pytest.approx(whole["eval_mean_accept_length"])
    assert wandb_run_contains(tmp_path / "a", "eval/accept_length")
    assert (tmp_path / "b" / "final" / "head_accuracy.json").is_file()


def test_medusa2_trains_the_target_with_its_heads_and_decodes_losslessly(tmp_path, tiny_trained_target):
    """drafter=medusa2: heads warm up alone, then train with the target; the export holds the heads and the
    fine-tuned target, the original stays as it was, and decoding with the pair equals the fine-tuned target's
    own greedy decoding. An interrupted run (stopped after the warm-up's end) resumes to the same weights."""
    from treespec.train.training import drafter_job as heads_training

    target_dir, cache = tiny_trained_target
    common = ["debug=tiny_heads", "drafter=medusa2", f"target={target_dir}", cache, "tree=accuracy", "tree.nodes=6",
              "drafter.heads_warmup_steps=20", "trainer.max_steps=40", "logger=none", "eval.expected_tau=null"]
    heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "trainer.stop_after=20"]))
    original, _ = load_model(str(target_dir))
    warmed = load_file(tmp_path / "a" / "ckpt-20" / "state.safetensors")  # the heads-only stage's end
    backbone = {k[len("model.backbone."):]: v for k, v in warmed.items() if k.startswith("model.backbone.")}
    assert backbone and all(torch.equal(v, original.state_dict()[k]) for k, v in backbone.items())  # untouched
    resumed = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'a'}", "resume=true"]))
    whole = heads_training.run(compose_cfg("train_heads", [*common, f"run_dir={tmp_path / 'b'}"]))
    assert whole["steps"] == resumed["steps"] == 40 and whole["drafter"] == "medusa2"  # the recipe names its run
    assert registry.detect(tmp_path / "b" / "final").kind == "medusa"  # its folder holds Medusa heads
    for name in ("medusa.safetensors", "target/model.safetensors"):
        a, b = (load_file(tmp_path / r / "final" / name) for r in "ab")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    tuned, _ = load_model(str(tmp_path / "b" / "final" / "target"))  # a stock model folder, tokenizer included
    before, after = original.state_dict(), tuned.state_dict()
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)  # the target was trained
    assert whole["target_lm_loss_before"] > 0 and whole["kl_to_original"] >= 0

    heads = MedusaHeads.from_pretrained(tmp_path / "b" / "final", tuned)
    prompt = torch.randint(0, tuned.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    for tree in (Tree.chain(3), Tree.full(2, 2)):
        out = generate(tuned, prompt, drafter=Medusa(heads), tree=tree, max_new_tokens=24)
        assert torch.equal(out.sequences, hf_greedy(tuned, prompt, 24))


def test_medusa2_is_a_medusa_training_recipe_not_a_kind():
    """drafter=medusa2 composes a Medusa config with the joint recipe; its run keeps its own folder, the registry
    lists no medusa2 kind, and a recipe Medusa does not have is refused before anything loads."""
    from treespec.train.training import drafter_job as heads_training

    cfg = compose_cfg("train_heads", ["drafter=medusa2"])
    assert (cfg.drafter.name, cfg.drafter.recipe) == ("medusa", "medusa2") and cfg.run_dir.endswith("heads/medusa2")
    assert compose_cfg("train_heads", ["drafter=medusa"]).run_dir.endswith("heads/medusa")
    assert "medusa2" not in [k.name for k in registry.KINDS] and "medusa2" in registry.get("medusa").recipes
    with pytest.raises(ValueError, match="unknown drafter 'medusa2'"):
        registry.get("medusa2")
    with pytest.raises(ValueError, match=r"drafter.recipe='medusa3': drafter 'medusa' has the recipes medusa2"):
        heads_training.check_config(compose_cfg("train_heads", ["drafter=medusa2", "drafter.recipe=medusa3"]))
    with pytest.raises(ValueError, match=r"drafter.recipe='medusa2': drafter 'eagle' has no recipe besides its own"):
        heads_training.check_config(compose_cfg("train_heads", ["drafter=eagle", "+drafter.recipe=medusa2"]))


def test_medusa2_refuses_settings_it_cannot_train():
    from treespec.train.training import drafter_job as heads_training

    with pytest.raises(ValueError, match="leaves no joint step"):
        heads_training.check_config(compose_cfg("train_heads", ["drafter=medusa2", "trainer.max_steps=100",
                                                                "drafter.heads_warmup_steps=100"]))
    with pytest.raises(ValueError, match="stored target features"):
        heads_training.check_config(compose_cfg("train_heads", ["drafter=medusa2", "data.features=/tmp/x"]))
    with pytest.raises(ValueError, match=r"lm_weight=0 and drafter.distill_weight=0: nothing would hold"):
        heads_training.check_config(compose_cfg("train_heads", ["drafter=medusa2", "drafter.lm_weight=0",
                                                                "drafter.distill_weight=0"]))
