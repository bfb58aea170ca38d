"""Chat data for tests: a small ChatML tokenizer, random well-formed conversations in both styles, malformed
rows, Spec-Bench-style question rows, a tiny chat target saved as a transformers folder, and a train_heads config
on that data."""

import json
import random
from pathlib import Path

import torch

from treespec.train.training.chat import CHATML
from treespec.train.training.data import train_tokenizer

from .models import compose_cfg

WORDS = ("the cat sat on a mat while dogs ran past quick brown foxes jumping over lazy rivers def return "
         "print value list items sorted yes no maybe hello there how are you fine thanks").split()

# Spec-Bench's question.jsonl rows, in its own format: categories, one or two turns
SPEC_BENCH_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Name a colour."]},
    {"question_id": 83, "category": "math", "turns": ["What is 2+2?"]},
    {"question_id": 84, "category": "math", "turns": ["What is 3*3?"]},
]


def chat_tokenizer(folder=None):
    """A 300-token byte-level BPE with ChatML's special tokens and chat template."""
    tok = train_tokenizer([" ".join(WORDS)] * 4 + ["<think> </think> 0123456789 ?!.,:\n"], 400)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    if folder is not None:
        tok.save_pretrained(folder)
    return tok


def sentence(rng, n=None) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n or rng.randint(3, 8)))


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n well-formed rows, alternating ShareGPT and OpenAI styles, one or two exchanges each."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns += [("user", sentence(rng)), ("assistant", sentence(rng))]
        if i % 2:
            rows.append({"messages": [{"role": r, "content": c} for r, c in turns]})
        else:
            rows.append({"conversations": [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c}
                                           for r, c in turns]})
    return rows


BAD_ROWS = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "alien", "value": "zork"}]},   # unknown role
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]},         # empty turn
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},       # empty turn
    {"messages": [{"role": "user", "content": "only a question"}]},                             # no assistant
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": " ".join(["value"] * 400)}]},                # over max_length
    {"text": "not a conversation"},                                                             # no conversation
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_chat_target(folder: Path, vocab_extra: int = 0) -> Path:
    """A tiny random Llama with the chat tokenizer, saved as a transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = chat_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, bos_token_id=None, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# a draft model small enough for the tiny chat target (hidden 32): width 16, one layer
TINY_DRAFT = ["drafter.arch.hidden_size=16", "drafter.arch.intermediate_size=32", "drafter.arch.num_hidden_layers=1",
              "drafter.arch.num_attention_heads=2", "drafter.arch.num_key_value_heads=2"]


def heads_cfg(tmp: Path, target: Path, source: Path, *overrides, drafter: str = "eagle"):
    """train_heads on chat data with a tiny target: tiny batches, no wandb, short evaluations."""
    depth = [] if drafter == "medusa" else ["drafter.accuracy_depth=2"]
    return compose_cfg("train_heads", [
        f"drafter={drafter}", "data=chat", f"data.chat.source={source}", f"target={target}", f"run_dir={tmp}",
        f"data.cache_dir={tmp.parent / 'cache'}", "logger=none", "trainer.seq_len=96", "trainer.batch_size=4",
        "trainer.max_steps=3", "trainer.eval_every=2", "trainer.eval_windows=4", "trainer.ckpt_every=2",
        "trainer.log_every=1", "trainer.progress=false", "optim.warmup_steps=1", "optim.lr=1e-3",
        "eval.prompts=1", "eval.max_new_tokens=4", "eval.profile.cost_sizes=[1,2,4]", "eval.profile.engine_rounds=1",
        "eval.profile.chain_windows=2", *depth, *overrides])


def stopped_run_resumes_exactly(tmp: Path, drafter: str, *overrides) -> Path:
    """train_heads ``drafter`` on chat data (``heads_cfg``, ``overrides``): stopped at step 2 and resumed to step 3
    equals a run to step 3 (the weights in both ckpt-3) → the uninterrupted run's folder."""
    from safetensors.torch import load_file

    from treespec.train.training import drafter_job

    target = tiny_chat_target(tmp / "target")
    source = write_jsonl(tmp / "chat.jsonl", conversations(24))
    common = [*overrides, "trainer.max_steps=4", "trainer.ckpt_every=1", "eval.expected_tau=null"]
    drafter_job.run(heads_cfg(tmp / "a", target, source, *common, "trainer.stop_after=2", drafter=drafter))
    drafter_job.run(heads_cfg(tmp / "a", target, source, *common, "trainer.stop_after=1", "resume=true",
                              drafter=drafter))
    drafter_job.run(heads_cfg(tmp / "b", target, source, *common, "trainer.stop_after=3", drafter=drafter))
    a, b = (load_file(tmp / r / "ckpt-3" / "state.safetensors") for r in "ab")
    weights = [k for k in a if k.startswith("model.")]
    assert weights and all(torch.equal(a[k], b[k]) for k in weights)
    return tmp / "b"
