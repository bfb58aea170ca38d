"""Self-generated requests (train/training/magpie.py) and the regeneration job answering them
(data.chat.source=magpie): the user-turn prefix, uniqueness, length bounds, excluded benchmark questions, a
resume equal to an uninterrupted run, and a model that repeats itself stopping."""

import gzip
import json
import os

import pytest

from treespec.reference import load_model
from treespec.train.training import magpie
from treespec.train.training.chat import ChatRenderer
from treespec.train.training.completions import EmbeddedBackend
from treespec.train.training.magpie_tasks import TASKS
from treespec.train.training.regeneration import run as regenerate_job

from tests.helpers import ROOT, chat_tokenizer, compose_cfg, tiny_chat_target


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    target, tok = load_model(tiny_chat_target(tmp_path_factory.mktemp("target")))
    renderer = ChatRenderer(tok)
    return EmbeddedBackend(target, tok, renderer.end_marker), tok, renderer


def requests(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_prefix_is_the_templates_user_turn_up_to_its_content():
    renderer = ChatRenderer(chat_tokenizer())
    assert magpie.user_prefix(renderer).endswith("<|im_start|>user\n")
    with_system = magpie.user_prefix(renderer, "Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.") and with_system.endswith("<|im_start|>user\n")


def test_requests_are_unique_bounded_and_never_excluded(chat_target, tmp_path):
    backend, tok, renderer = chat_target
    common = {"count": 6, "batch_size": 4, "max_new_tokens": 8, "min_chars": 5, "max_chars": 60, "progress": False}
    counts = magpie.generate_requests(backend, renderer, tmp_path / "a.jsonl", **common)
    rows = requests(tmp_path / "a.jsonl")
    texts = [r["messages"][0]["content"] for r in rows]
    assert counts["requests"] == len(rows) == 6 and [r["row"] for r in rows] == list(range(6))
    assert len({magpie.request_key(t) for t in texts}) == 6 and all(5 <= len(t) <= 60 for t in texts)
    assert all(r["messages"][0]["role"] == "user" for r in rows)
    # a benchmark's question is dropped even when the model writes it (the same seeds write it again here)
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [texts[0].upper() + "  "]}) + "\n")
    exclude = magpie.excluded_texts(bench)
    counts = magpie.generate_requests(backend, renderer, tmp_path / "b.jsonl", exclude=exclude, **common)
    kept = [r["messages"][0]["content"] for r in requests(tmp_path / "b.jsonl")]
    assert counts["dropped"]["excluded"] >= 1 and texts[0] not in kept and len(kept) == 6


def test_a_killed_run_resumes_to_the_same_file(chat_target, tmp_path):
    backend, tok, renderer = chat_target
    common = {"count": 7, "batch_size": 3, "max_new_tokens": 8, "min_chars": 3, "progress": False}
    magpie.generate_requests(backend, renderer, tmp_path / "whole.jsonl", **common)
    whole = (tmp_path / "whole.jsonl").read_text()
    lines = whole.splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text("".join(lines[:4]) + lines[4][:15])  # killed mid-write
    magpie.generate_requests(backend, renderer, tmp_path / "cut.jsonl", **common)
    assert (tmp_path / "cut.jsonl").read_text() == whole


def test_rows_holding_unicode_line_separators_resume(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw; str.splitlines() cut such a row in two, so a
    resume of 5,200 SmolLM2 requests failed on row 5091 (and the answers' resume would have redone the row)."""
    from treespec.train.training.regeneration import _done_rows

    rows = [{"row": i, "batch": i, "messages": [{"role": "user", "content": f"line one\u2028line\x85two {i}"}]}
            for i in range(3)]
    out = tmp_path / "requests.jsonl"
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert "\u2028" in out.read_text(encoding="utf-8")  # written raw, as the jobs write it
    assert magpie._written(out) == (rows, 2)
    assert _done_rows(out) == {0, 1, 2}


def test_a_model_that_repeats_itself_stops(chat_target, tmp_path):
    backend, tok, renderer = chat_target
    counts = magpie.generate_requests(backend, renderer, tmp_path / "same.jsonl", count=5, batch_size=4,
                                      temperature=1e-4, max_new_tokens=6, min_chars=1, max_batches=3,
                                      progress=False)
    assert counts["stopped_early"] and counts["requests"] == 1 and counts["dropped"]["duplicate"] == 11


def test_the_regeneration_job_answers_its_own_requests(tmp_path):
    target_dir = tiny_chat_target(tmp_path / "target")
    out = tmp_path / "magpie.jsonl"
    cfg = compose_cfg("train_heads", [
        "data=chat", "data.chat.source=magpie", f"target={target_dir}", f"data.regenerate.out={out}",
        f"data.cache_dir={tmp_path / 'cache'}", "data.magpie.conversations=4", "data.magpie.batch_size=4",
        "data.magpie.min_chars=1", "data.magpie.max_new_tokens=6", "data.regenerate.max_new_tokens=3"])
    counts = regenerate_job(cfg)
    rows = requests(out)
    assert counts["written"] == 4 and len(rows) == 4
    asked = [r["messages"][0]["content"] for r in requests(tmp_path / "magpie.jsonl.requests.jsonl")]
    assert [r["messages"][0]["content"] for r in rows] == asked
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)


def test_task_kinds_ask_for_each_kind_batch_by_batch(chat_target, tmp_path):
    backend, tok, renderer = chat_target
    tasks = ["translation", "math"]
    magpie.generate_requests(backend, renderer, tmp_path / "t.jsonl", count=6, batch_size=3, max_new_tokens=6,
                             min_chars=1, max_chars=400, tasks=tasks, progress=False)
    rows = requests(tmp_path / "t.jsonl")
    assert len(rows) == 6
    for r in rows:
        kind = tasks[r["batch"] % 2]
        assert r["category"] == kind
        # the request starts with one of its kind's openers (the model continues it)
        assert any(r["messages"][0]["content"].startswith(o) for o in TASKS[kind].openers if o)
    # each kind's batch was sampled under its own system prompt: the prompts differ by kind
    assert magpie.user_prefix(renderer, TASKS["math"].system) != magpie.user_prefix(renderer, TASKS["qa"].system)


def test_follow_ups_add_second_turns_and_a_killed_run_resumes_to_the_same_file(tmp_path):
    target_dir = tiny_chat_target(tmp_path / "target")
    common = ["data=chat", "data.chat.source=magpie", f"target={target_dir}", f"data.cache_dir={tmp_path / 'cache'}",
              "data.magpie.conversations=6", "data.magpie.batch_size=3", "data.magpie.min_chars=1",
              "data.magpie.max_new_tokens=6", "data.regenerate.max_new_tokens=3", "data.regenerate.batch_size=2",
              "data.magpie.second_turns=0.5", "data.magpie.tasks=[qa,coding]"]
    whole = tmp_path / "whole.jsonl"
    counts = regenerate_job(compose_cfg("train_heads", [*common, f"data.regenerate.out={whole}"]))
    rows = requests(whole)
    chosen = [r for r in rows if len(r["messages"]) == 4]
    assert counts["written"] == 6 and counts["assistant_tokens"] > 0
    # the chosen share got a follow-up request (a new user turn) and its answer; the rest one turn
    assert chosen and len(chosen) < 6 and all(len(r["messages"]) in (2, 4) for r in rows)
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"] for r in chosen)
    assert all(r["category"] in ("qa", "coding") for r in rows)
    # a kill mid-write: the cut line is dropped and the rerun writes what an uninterrupted run wrote
    killed = tmp_path / "killed.jsonl"
    (tmp_path / "killed.jsonl.requests.jsonl").write_bytes((tmp_path / "whole.jsonl.requests.jsonl").read_bytes())
    lines = whole.read_text().splitlines(keepends=True)
    killed.write_text("".join(lines[:2]) + lines[2][:20])
    regenerate_job(compose_cfg("train_heads", [*common, f"data.regenerate.out={killed}"]))
    assert killed.read_text() == whole.read_text()


@pytest.mark.parametrize("override, message", [
    ("data.magpie.tasks=[poetry]", r"data.magpie.tasks: unknown task kind\(s\) \['poetry'\]"),
    ("data.magpie.second_turns=2", r"data.magpie.second_turns"),
    ("data.magpie.min_chars=2000", r"min_chars=2000 exceeds data.magpie.max_chars"),
    ("data.magpie.exclude=/nonexistent/q.jsonl", r"data.magpie.exclude=/nonexistent/q.jsonl: no such file"),
    ("data.magpie.temperature=0", r"data.magpie.temperature"),
])
def test_bad_magpie_settings_are_refused_before_any_model_loads(tmp_path, override, message):
    cfg = compose_cfg("train_heads", ["data=chat", "data.chat.source=magpie", "target=/nonexistent/model",
                                      f"data.regenerate.out={tmp_path / 'o.jsonl'}", override])
    with pytest.raises(ValueError, match=message):
        regenerate_job(cfg)


SHIPPED = ROOT / "treespec" / "models" / "smollm2" / "magpie.jsonl"


def test_the_shipped_smollm2_conversations_are_whole_and_unique():
    """treespec/models/smollm2/magpie.jsonl: one answered request per row, every request unique."""
    rows = requests(SHIPPED)
    asked = [r["messages"][0]["content"] for r in rows]
    assert len(rows) == 600 and [r["row"] for r in rows] == list(range(600))
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] and r["messages"][1]["content"].strip()
               for r in rows)
    assert len({magpie.request_key(a) for a in asked}) == len(asked)


CHAT = ROOT / "treespec" / "models" / "smollm2" / "chat.jsonl.gz"


def chat_rows() -> list[dict]:
    with gzip.open(CHAT, "rt") as f:
        return [json.loads(line) for line in f]


def test_the_shipped_task_conditioned_conversations_are_whole_varied_and_new():
    """treespec/models/smollm2/chat.jsonl.gz: 10,400 rows in order, every request unique and none of magpie.jsonl's,
    twelve task kinds, second turns on about a quarter, every turn answered but one (DATA.md says which)."""
    rows = chat_rows()
    assert len(rows) == 10400 and [r["row"] for r in rows] == list(range(10400))
    firsts = [magpie.request_key(r["messages"][0]["content"]) for r in rows]
    assert len(set(firsts)) == len(firsts)
    assert not set(firsts) & {magpie.request_key(r["messages"][0]["content"]) for r in requests(SHIPPED)}
    assert len({r["category"] for r in rows}) == 12
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert all(x in (["user", "assistant"], ["user", "assistant"] * 2) for x in roles)
    assert 0.2 < sum(len(x) == 4 for x in roles) / len(rows) < 0.3
    empty = [r["row"] for r in rows for m in r["messages"] if m["role"] == "assistant" and not m["content"].strip()]
    assert len(empty) == 1


@pytest.mark.skipif(not os.environ.get("TREESPEC_SPEC_BENCH"), reason="TREESPEC_SPEC_BENCH (Spec-Bench's "
                    "question.jsonl, not in the repository) is not set")
def test_the_shipped_smollm2_conversations_hold_no_benchmark_question():
    """No training request (either shipped file, every user turn) is one of Spec-Bench's questions (either turn),
    compared as Magpie's exclusion does."""
    asked = {magpie.request_key(r["messages"][0]["content"]) for r in requests(SHIPPED)}
    asked |= {magpie.request_key(m["content"]) for r in chat_rows() for m in r["messages"] if m["role"] == "user"}
    questions = magpie.excluded_texts(os.environ["TREESPEC_SPEC_BENCH"])
    assert len(questions) > 400 and not asked & questions


def test_a_corrupt_requests_or_exclude_file_is_named_with_its_line(tmp_path):
    # each was a bare JSONDecodeError, KeyError or AttributeError, naming neither the file nor the line
    good = json.dumps({"row": 0, "batch": 0, "messages": [{"role": "user", "content": "write a poem"}]})
    for second in ("GARBAGE", json.dumps({"row": 1, "batch": 0}), json.dumps({"row": 1, "messages": []})):
        (tmp_path / "requests.jsonl").write_text(f"{good}\n{second}\n")
        with pytest.raises(ValueError, match=r"requests file .*requests.jsonl, line 2: not a request this job wrote"):
            magpie._written(tmp_path / "requests.jsonl")
    for row in ("[1, 2]", '"text"'):
        (tmp_path / "exclude.jsonl").write_text(f'{{"prompt": "a question"}}\n{row}\n')
        with pytest.raises(ValueError, match=r"exclude file .*exclude.jsonl, line 2: not a JSON object"):
            magpie.excluded_texts(tmp_path / "exclude.jsonl")
    (tmp_path / "exclude.jsonl").write_text('{"messages": ["hi", {"role": "user", "content": "a question"}]}\n')
    assert magpie.excluded_texts(tmp_path / "exclude.jsonl") == {"a question"}
    with pytest.raises(ValueError, match=r"data.magpie.batch_size must be an integer >= 1, got 0"):  # ZeroDivisionError
        magpie.generate_requests(None, None, tmp_path / "r.jsonl", count=2, batch_size=0, progress=False)
