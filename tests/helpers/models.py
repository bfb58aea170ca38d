"""Tiny random-weight causal LMs and drafters for tests (built from configs: nothing is downloaded), and the
hydra configs composed as the scripts compose them."""

from __future__ import annotations

from pathlib import Path

import torch

from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map
from treespec.heads.hydra import HydraHeads
from treespec.heads.medusa import MedusaHeads
from treespec.train.checks.lossless import hf_greedy, perturbed  # noqa: F401 - the suite's references, re-exported


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, attn: str = "sdpa",
               max_positions: int = 256, init_std: float = 0.2):
    # init_std well above the usual 0.02 makes the logits peaked, so greedy argmax has no near-ties that
    # 1e-7 numerical differences between tree and sequential attention could flip.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         initializer_range=init_std, attn_implementation=attn,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


ROOT = Path(__file__).resolve().parents[2]  # the repository: tests at any depth find its files from here
CONF = str(ROOT / "conf")


def compose_cfg(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def train_tiny_lm(tmp_path, monkeypatch) -> tuple[Path, str]:
    """A tiny LM trained for 60 steps through the LM entry (wandb offline): (its folder, the data-cache
    override that heads runs should share). Tests take it from the ``tiny_trained_target`` fixture
    (tests/conftest.py), which trains it once per worker process and hands each test its own copy."""
    from treespec.train.training import lm_job as lm

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    lm.run(compose_cfg("train_lm", ["debug=tiny_lm", f"run_dir={tmp_path / 'lm'}", cache, "trainer.max_steps=60"]))
    return tmp_path / "lm" / "final", cache


# -- random drafters for a target ----------------------------------------------------------------------
def random_eagle(target, feature_layers=(-1,), seed=0):
    torch.manual_seed(seed)
    return EagleModel(target, feature_layers=feature_layers).eval()


def random_eagle3(target, draft_vocab=None, seed=0, aux_layers=None, layer="llama"):
    """A random drafter; ``draft_vocab`` < V picks a random reduced vocabulary."""
    g = torch.Generator().manual_seed(seed + 100)
    vocab = target.config.vocab_size
    vocab_map = build_vocab_map(torch.randint(0, 1000, (vocab,), generator=g), draft_vocab) if draft_vocab else None
    torch.manual_seed(seed)
    return Eagle3Model(target, aux_layers=aux_layers, vocab_map=vocab_map, layer=layer).eval()


def random_heads(target, num_heads=3, share=True, seed=0, scale=0.5):
    """Heads with random (non-zero) residual weights, so their candidates are sometimes right, often wrong."""
    torch.manual_seed(seed)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=num_heads,
                        share_lm_head=share, lm_head=target.get_output_embeddings())
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, scale)
    return heads.eval()


def random_hydra(target, num_heads=3, num_layers=1, prefix_attention=False, share=True, seed=0, scale=0.5):
    """Hydra heads with random weights everywhere (their path columns, blocks and prefix gate too), so each node's
    children depend on its path and are sometimes right, often wrong."""
    torch.manual_seed(seed)
    heads = HydraHeads(target, num_heads=num_heads, num_layers=num_layers, share_lm_head=share,
                       prefix_attention=prefix_attention)
    with torch.no_grad():
        for head in heads.heads:
            head.input.weight.add_(torch.randn_like(head.input.weight) * scale)  # the path columns matter
            for block in head.blocks:
                block.linear.weight.normal_(0, scale)
        if heads.prefix_gate is not None:
            heads.prefix_gate.fill_(1.0)
    return heads.eval()
