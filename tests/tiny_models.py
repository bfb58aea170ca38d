"""Tiny random-weight causal LMs for tests (built from configs: nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch

from treespec.train.lossless import hf_greedy, perturbed  # noqa: F401 - the suite's references, re-exported


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


CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_cfg(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def tiny_trained_target(tmp_path, monkeypatch) -> tuple[Path, str]:
    """A tiny LM trained for 60 steps through the LM entry (wandb offline): (its folder, the data-cache
    override that heads runs should share)."""
    from treespec.train import lm

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    lm.run(compose_cfg("train_lm", ["debug=tiny_lm", f"run_dir={tmp_path / 'lm'}", cache, "trainer.max_steps=60"]))
    return tmp_path / "lm" / "final", cache


def record_proposals(drafter) -> list:
    """Wrap ``drafter.propose`` so every step's (committed [1, L], tree, proposal) of every row is kept (row after
    row within a step); returns that list."""
    seen = []
    propose = drafter.propose

    def recording(committed, feature, step_tree, sampling, generator=None):
        proposals = propose(committed, feature, step_tree, sampling, generator)
        rows = range(len(committed.lengths))
        seen.extend((committed.row(b)[None].clone(), step_tree, proposals.row(b)) for b in rows)
        return proposals

    drafter.propose = recording
    return seen
