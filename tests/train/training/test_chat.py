"""Chat data: ShareGPT and OpenAI conversations rendered with a chat template, loss masks on assistant tokens
only, bad rows counted and skipped, every source kind read through ``datasets``, batches a function of
(seed, step), and regenerated responses (resumable)."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from treespec.train.training.chat import ChatRenderer, SampleBatches, encode_conversations, prepare_chat
from treespec.train.training.completions import EmbeddedBackend
from treespec.train.training.conversations import load_rows, normalize
from treespec.train.training.data import train_tokenizer
from treespec.train.training.regeneration import regenerate

from tests.helpers import (
    BAD_ROWS,
    WORDS,
    chat_tokenizer,
    compose_cfg,
    conversations,
    run_killed,
    tiny_chat_target,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_sharegpt_and_openai_render_alike_with_assistant_only_masks(tok):
    renderer = ChatRenderer(tok)
    assert (renderer.header, renderer.end_marker) == ("<|im_start|>assistant", "<|im_end|>")
    sharegpt = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "how are you"},
                                  {"from": "gpt", "value": "fine thanks"}, {"from": "human", "value": "and the cat"},
                                  {"from": "gpt", "value": "the cat sat on a mat"}]}
    openai = {"messages": [{"role": t["from"].replace("human", "user").replace("gpt", "assistant"),
                            "content": t["value"]} for t in sharegpt["conversations"]]}
    a, b = renderer.encode(normalize(sharegpt)), renderer.encode(normalize(openai))
    assert a == b
    ids, mask, text = a
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert masked_text(tok, ids, mask) == "fine thanks<|im_end|>the cat sat on a mat<|im_end|>"
    # nothing of the system, user turns or assistant headers is trained on
    first = mask.index(True)
    assert "how are you" in tok.decode(ids[:first]) and tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def test_reasoning_blocks_are_trained_on_or_not_as_configured(tok):
    row = {"messages": [{"role": "user", "content": "why"},
                        {"role": "assistant", "content": "<think>maybe no</think> yes"}]}
    ids, mask, _ = ChatRenderer(tok, reasoning="include").encode(normalize(row))
    assert masked_text(tok, ids, mask) == "<think>maybe no</think> yes<|im_end|>"
    ids, mask, _ = ChatRenderer(tok, reasoning="exclude").encode(normalize(row))
    assert masked_text(tok, ids, mask) == " yes<|im_end|>"  # the token " yes" carries its space


@pytest.mark.parametrize("which", ["tests' chat tokenizer", "reference target + chatml"])
@pytest.mark.parametrize("answer", ["a", "end", "assistant", "im"])
def test_a_short_answer_is_masked_where_it_is_not_inside_a_marker(tok, which, answer):
    # The answer was searched from the end of the user's turn, so "a" was found inside <|im_start|>, "end"
    # inside the user's <|im_end|>: the drafter trained on a marker instead of the answer.
    if which == "tests' chat tokenizer":
        renderer = ChatRenderer(tok)
    else:  # the language-model job's tokenizer (the reference target's), which has no ChatML tokens of its own
        from transformers import AutoTokenizer

        from treespec import reference
        with pytest.warns(UserWarning, match="split into ordinary tokens"):
            renderer = ChatRenderer(AutoTokenizer.from_pretrained(reference.path("target")), "chatml")
    row = {"messages": [{"role": "user", "content": "Pick a or b"}, {"role": "assistant", "content": answer}]}
    ids, mask, _ = renderer.encode(normalize(row))
    assert masked_text(renderer.tokenizer, ids, mask) == f"{answer}<|im_end|>"


def test_template_file_and_tokenizer_without_template(tmp_path, tok):
    plain = train_tokenizer([" ".join(WORDS)] * 2, 280)
    plain.chat_template = None  # (a tokenizer trained here has ChatML's: tests/train/training/test_train.py)
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(plain)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    renderer = ChatRenderer(plain, str(template))
    ids, mask, text = renderer.encode(normalize({"messages": [{"role": "user", "content": "hello"},
                                                              {"role": "assistant", "content": "fine thanks"}]}))
    assert text == "user: hello\nassistant: fine thanks\n"
    assert masked_text(plain, ids, mask).strip() == "fine thanks"


def test_bad_rows_are_counted_and_skipped(tok):
    rows = conversations(10) + BAD_ROWS
    data = encode_conversations(rows, ChatRenderer(tok), max_length=96, val_fraction=0.0)
    counts = {k: v["count"] for k, v in data.skipped.items()}
    assert counts == {"unknown role": 1, "empty turn": 2, "no assistant turn": 1, "over max_length": 1,
                      "no conversation": 1}
    assert len(data.train) == 10 and data.rows == 16
    assert "skipped 6" in data.summary() and "unknown role" in data.summary()
    truncated = encode_conversations(rows, ChatRenderer(tok), max_length=96, overlong="truncate", val_fraction=0.0)
    assert len(truncated.train) == 11 and int(truncated.train.lengths().max()) == 96


@pytest.mark.parametrize("max_length", [0, 1, -5, 2.5, "96"])
def test_an_impossible_max_length_is_named(tok, max_length):
    # max_length=0 used to skip every row as "no assistant token", naming neither max_length nor its value
    with pytest.raises(ValueError, match=r"data\.chat\.max_length .* got " + repr(max_length).replace(".", r"\.")):
        encode_conversations(conversations(4), ChatRenderer(tok), max_length=max_length, val_fraction=0.0)


# Qwen3's template renders an empty reasoning block between the header and the last answer
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n\n</think>\n\n"
            "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")


@pytest.mark.parametrize("answer", ["hi", "in", "k", "think"])
def test_a_short_answer_after_a_rendered_reasoning_block_is_masked_whole(tmp_path, tok, answer):
    # the answer was searched forwards from the header, so "hi" was found inside "<think>": the mask covered
    # "<think" and missed the answer
    (tmp_path / "thinking.jinja").write_text(THINKING)
    renderer = ChatRenderer(tok, str(tmp_path / "thinking.jinja"))
    row = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": answer}]}
    ids, mask, _ = renderer.encode(normalize(row))
    assert masked_text(tok, ids, mask) == f"<think>\n\n</think>\n\n{answer}<|im_end|>"


@pytest.mark.parametrize("setting, message", [
    ({"val_fraction": 2.0}, r"data\.chat\.val_fraction must be a finite number in \[0, 1\), got 2\.0"),
    ({"val_fraction": -1}, r"data\.chat\.val_fraction must be a finite number in \[0, 1\), got -1"),
    ({"max_conversations": -1}, r"data\.chat\.max_conversations must be an integer >= 0 or null, got -1"),
])
def test_an_impossible_split_or_row_limit_is_named(tok, setting, message):
    # each once read no row at all: "no usable conversation among 4 rows: " with no reason given
    with pytest.raises(ValueError, match=message):
        encode_conversations(conversations(4), ChatRenderer(tok), max_length=96, **{"val_fraction": 0.0, **setting})


def test_every_source_kind_reads_the_same_rows(tmp_path):
    rows = conversations(6)
    jsonl = write_jsonl(tmp_path / "c.jsonl", rows)
    as_json = tmp_path / "c.json"
    as_json.write_text(json.dumps(rows))
    ds = load_rows(str(jsonl), cache_dir=tmp_path / "cache")  # (Dataset.from_list keeps the first row's schema)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    gz = tmp_path / "gz" / "c.jsonl.gz"  # how treespec/models/smollm2/chat.jsonl.gz ships
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    expected = [normalize(r) for r in rows]
    for source in (jsonl, as_json, tmp_path / "c.parquet", tmp_path / "saved", gz):
        got = [normalize(r) for r in load_rows(str(source), cache_dir=tmp_path / "cache")]
        assert got == expected, source
    with pytest.raises(ValueError, match="matches no file"):
        load_rows(str(tmp_path / "missing*.jsonl"))


def test_prepared_chat_data_is_cached_and_batches_depend_only_on_step(tmp_path, tok):
    source = write_jsonl(tmp_path / "c.jsonl", conversations(30) + BAD_ROWS)
    cfg = compose_cfg("train_heads", ["data=chat", f"data.chat.source={source}", "trainer.seq_len=96"])
    data = prepare_chat(cfg.data.chat, tok, tmp_path / "cache", progress=False)
    again = prepare_chat(cfg.data.chat, tok, tmp_path / "cache", progress=False)  # from the cache
    assert torch.equal(data.train.input_ids, again.train.input_ids) and data.skipped == again.skipped
    # the over-long bad row is truncated (overlong: truncate, the default) and counted, not dropped
    assert len(data.train) + len(data.val) == 31 and len(data.val) >= 1 and data.truncated["count"] == 1
    a, b = SampleBatches(data.train, 4, seed=3), SampleBatches(data.train, 4, seed=3)
    x, y = a.batch(7), b.batch(7)
    assert all(torch.equal(x[k], y[k]) for k in x)
    lengths = x["attention_mask"].sum(1)
    assert int(lengths.max()) == x["input_ids"].shape[1]  # padded to the longest row, on the right
    for row, n in enumerate(lengths.tolist()):
        assert x["attention_mask"][row, :n].all() and not x["loss_mask"][row, n:].any()
    # an edited source is encoded again, never served from the stale cache
    write_jsonl(source, conversations(31) + BAD_ROWS)
    edited = prepare_chat(cfg.data.chat, tok, tmp_path / "cache", progress=False)
    assert len(edited.train) + len(edited.val) == 32


def test_regenerate_replaces_assistant_turns_and_resumes(tmp_path):
    target_dir = tiny_chat_target(tmp_path / "target")
    from treespec.reference import load_model

    target, tok = load_model(target_dir)
    rows = conversations(5)
    rows[1] = {**rows[1], "id": "q1", "category": "explain"}  # a workload's fields survive regeneration
    source = write_jsonl(tmp_path / "c.jsonl", rows + BAD_ROWS[:1])
    cfg = compose_cfg("train_heads", ["data=chat", f"data.chat.source={source}"])
    out = tmp_path / "regen.jsonl"
    backend = EmbeddedBackend(target, tok, "<|im_end|>")
    first = regenerate(backend, cfg.data.chat, out, batch_size=2, max_new_tokens=3, progress=False)
    assert first["written"] == 5 and first["bad_rows"] == {"unknown role": 1}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in lines] == [0, 1, 2, 3, 4]
    assert (lines[1]["id"], lines[1]["category"]) == ("q1", "explain") and "category" not in lines[0]
    original = [normalize(r) for r in conversations(5)]
    for row, old in zip(lines, original, strict=True):
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in old]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == \
               [m["content"] for m in old if m["role"] == "user"]
    # a kill mid-write: the cut line is dropped and only the missing rows are generated again
    out.write_text("\n".join(out.read_text().splitlines()[:2]) + '\n{"row": 2, "mess')
    again = regenerate(backend, cfg.data.chat, out, batch_size=2, max_new_tokens=3, progress=False)
    assert again["written"] == 3 and again["already_done"] == 2
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == [0, 1, 2, 3, 4]


@pytest.mark.slow  # a fresh Python process (torch, transformers) for the killed run
def test_regeneration_killed_with_sigkill_resumes_to_the_uninterrupted_output(tmp_path):
    from treespec.train.training import regeneration

    target_dir = tiny_chat_target(tmp_path / "target")
    source = write_jsonl(tmp_path / "c.jsonl", conversations(7))
    common = ["data=chat", f"data.chat.source={source}", f"target={target_dir}", f"data.cache_dir={tmp_path / 'c'}",
              "data.regenerate.batch_size=2", "data.regenerate.max_new_tokens=4", "data.regenerate.temperature=1.0"]
    whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
    regeneration.run(compose_cfg("train_heads", [*common, f"data.regenerate.out={whole}"]))
    # killed after its second batch, lock left behind; the rerun takes the lock over and finishes the rest
    assert run_killed("treespec.train.training.regeneration:run", [*common, f"data.regenerate.out={killed}"], 2) == -9
    assert len(killed.read_text().splitlines()) == 4 and Path(f"{killed}.lock").exists()
    regeneration.run(compose_cfg("train_heads", [*common, f"data.regenerate.out={killed}"]))
    assert killed.read_text() == whole.read_text()
