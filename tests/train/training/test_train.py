"""Training the reference models: loss goes down, resume is exact, bad input gets a clear error."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from treespec.train.training.conversations import normalize
from treespec.train.training.data import TokenBatches, load_corpus, train_tokenizer
from treespec.train.training.lm_job import run

from tests.helpers import CONF


def lm_config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(
            config_name="train_lm",
            overrides=["debug=tiny_lm", f"run_dir={tmp_path}", f"data.cache_dir={tmp_path.parent / 'cache'}",
                       *overrides],
        )


def test_tiny_training_lowers_loss(tmp_path):
    summary = run(lm_config(tmp_path))
    losses = [r["metrics"]["train/loss"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))
              if "train/loss" in r.get("metrics", {})]
    assert losses[-1] < losses[0] - 0.3
    assert summary["steps"] == 30 and 0 <= summary["val_top1"] <= 1
    assert (tmp_path / "final" / "model.safetensors").is_file()
    speaks_chatml(tmp_path / "final")


def speaks_chatml(folder):
    """The tokenizer a language-model run exports applies ChatML, its markers are one special token each, and a
    chat batch (the tokenizer's own template, packed) and a chat workload's prompt build from it."""
    from transformers import AutoTokenizer

    from treespec.train.compare.templates import PromptTemplate
    from treespec.train.compare.workload import Item
    from treespec.train.training.chat import ChatRenderer, encode_conversations
    from treespec.train.training.packing import PackedBatches

    from tests.helpers import conversations

    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nfine<|im_end|>\n"
    ids = {m: tok.encode(m, add_special_tokens=False) for m in ("<|im_start|>", "<|im_end|>")}
    assert all(len(v) == 1 for v in ids.values()) and {"<|im_start|>", "<|im_end|>"} <= set(tok.all_special_tokens)
    assert tok.encode("a<|im_end|>b", add_special_tokens=False)[1:2] == ids["<|im_end|>"]  # never merged
    renderer = ChatRenderer(tok)  # data.chat.template=null: the tokenizer's own
    assert (renderer.header, renderer.end_marker) == ("<|im_start|>assistant", "<|im_end|>")
    data = encode_conversations(conversations(12), renderer, max_length=256, val_fraction=0.0)
    assert len(data.train) == 12 and not data.skipped
    batch = PackedBatches(data.train, 256, 2).batch(0)
    trained = batch["input_ids"][batch["loss_mask"]]
    assert (trained == ids["<|im_end|>"][0]).any() and (batch["input_ids"] == ids["<|im_start|>"][0]).any()
    template = PromptTemplate(tok, "auto")  # a chat workload: the end-of-turn marker stops generation
    assert ids["<|im_end|>"][0] in template.end_ids
    prompt = template.ids(template.messages(Item("q", "all", ("hello",)), 1, []))[0].tolist()
    assert prompt[0] == ids["<|im_start|>"][0] and prompt[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_a_trained_tokenizer_speaks_chatml(tmp_path):
    train_tokenizer([" ".join(["hello", "world", "def", "return"] * 20)] * 4, 300, tmp_path / "tok")
    speaks_chatml(tmp_path / "tok")


def test_resume_reproduces_uninterrupted_weights(tmp_path):
    whole = run(lm_config(tmp_path / "whole"))
    run(lm_config(tmp_path / "split", "trainer.stop_after=13"))  # interrupted after 13 steps
    assert not (tmp_path / "split" / "final").exists()
    split = run(lm_config(tmp_path / "split", "resume=true"))
    assert split["steps"] == whole["steps"] == 30
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "split" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_checkpoint_from_other_model_is_refused(tmp_path):
    run(lm_config(tmp_path, "trainer.stop_after=10"))
    with pytest.raises(ValueError, match="different configuration.*hidden_size"):
        run(lm_config(tmp_path, "resume=true", "model.hidden_size=48"))


def test_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no documents"):
        load_corpus(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="neither 'stdlib', a directory"):
        load_corpus(str(tmp_path / "missing"))


def test_vocab_below_byte_alphabet_is_refused():
    with pytest.raises(ValueError, match="below the byte alphabet"):
        train_tokenizer(["def f(): pass"], vocab_size=100)


def test_corpus_split_is_deterministic_and_jsonl_works(tmp_path):
    a, b = load_corpus(max_files=40), load_corpus(max_files=40)
    assert [n for n, _ in a.val] == [n for n, _ in b.val] and a.val
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"x = {i}\n"}) for i in range(50)))
    corpus = load_corpus(str(jsonl))
    assert len(corpus.train) + len(corpus.val) == 50


def test_a_jsonl_corpus_of_conversations_trains_a_model_on_chatml(tmp_path):
    """Conversation rows (OpenAI or ShareGPT) in a JSONL corpus are learned in ChatML, the template of the
    tokenizer the run trains; text rows mix in; a row with no usable turn is skipped and one that is neither text
    nor a conversation is an error naming its line."""
    from tests.helpers import conversations

    rows = conversations(40) + [{"text": "def f():\n    return 1\n"}, {"messages": [{"role": "robot", "content": "x"}]}]
    corpus_file = tmp_path / "chat.jsonl"
    corpus_file.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match="validation split holds .* tokens, less than one window"):
        # no row hashes into validation: the last document, the short text row, is kept for it
        run(lm_config(tmp_path / "small", f"data.corpus.source={corpus_file}", "data.corpus.val_fraction=0.0"))
    # every row is read (the debug config reads 12): a row's split follows its content, wherever tmp_path is
    run(lm_config(tmp_path / "run", f"data.corpus.source={corpus_file}", "data.corpus.val_fraction=0.3",
                  "data.corpus.max_files=null"))
    from transformers import AutoTokenizer

    from treespec.train.training.data import prepare_tokens

    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    _, train, val = prepare_tokens({"source": str(corpus_file), "pattern": "*", "val_fraction": 0.3,
                                    "max_files": None}, 300, tmp_path / "cache", tokenizer=tok)
    stream = torch.cat([train, val]).tolist()
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    turns = sum(len(r.get("messages") or r.get("conversations")) for r in rows[:40])
    assert stream.count(im_start) == stream.count(im_end) == turns  # the bad row is skipped, the text has none
    first = tok.decode(stream[: stream.index(tok.eos_token_id)])  # which row comes first: the split's hash says
    assert first in {tok.apply_chat_template(normalize(r), tokenize=False) for r in rows[:40]}
    corpus_file.write_text(json.dumps({"prompt": "hi"}))
    with pytest.raises(ValueError, match="line 1 holds no 'text' string nor conversation"):
        load_corpus(str(corpus_file), render=lambda row: "x")
    with pytest.raises(ValueError, match="line 1 holds no 'text' string"):
        load_corpus(str(corpus_file))


def test_tokenizer_round_trip_on_code(tmp_path):
    corpus = load_corpus(max_files=20)
    tok = train_tokenizer([t for _, t in corpus.train], 400, tmp_path)
    for _, text in corpus.val[:3] + corpus.train[:3]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_batches_depend_only_on_step():
    tokens = torch.arange(5000, dtype=torch.int32)
    a, b = TokenBatches(tokens, 16, 4, seed=1), TokenBatches(tokens, 16, 4, seed=1)
    assert torch.equal(a.batch(37), b.batch(37))
    assert not torch.equal(a.batch(0), a.batch(a.steps_per_epoch))  # a new epoch reshuffles
    with pytest.raises(ValueError, match="fewer than batch_size"):
        TokenBatches(tokens[:40], 16, 4)
