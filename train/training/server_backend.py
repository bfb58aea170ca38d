"""Completions from an OpenAI-compatible server (``data.regenerate.backend=server``): the regeneration job
(train/training/regeneration.py) and Magpie's requests (train/training/magpie.py) written by a server already
serving the target — ``vllm serve <target>``, ``python -m sglang.launch_server --model-path <target>`` — instead
of treespec's own decoding loop (train/training/completions.py's ``EmbeddedBackend``). The job then loads only the
tokenizer.

Each prompt is one ``POST <url>/v1/completions`` with the prompt as raw text, already rendered with the chat
template by treespec (so the template is applied exactly once, and ``add_special_tokens: false``: no second BOS),
``max_tokens``, ``temperature``, ``top_p``, a seed per prompt (sampled rows only), and the template's end-of-turn
marker as ``stop`` (its token also as ``stop_token_ids``: a special token never shows in the text a ``stop``
string is matched against). ``concurrency`` requests are in flight at once (a thread pool): the server batches
them continuously. An answer's token count is its ``usage.completion_tokens``; vLLM's ``return_token_ids`` adds
the token ids (``Completion.ids``) and the prompt's, which must equal the target tokenizer's (a server serving
another model is refused).

**Failures.** A request the server does not answer within ``timeout_s``, an HTTP 5xx, 408 or 429, a connection
refused or reset, an answer cut short (a body shorter than announced, not JSON, no single choice, no token count,
a ``finish_reason`` other than ``stop`` or ``length``) is retried ``retries`` times with a doubling backoff. Other
4xx answers (a prompt over the server's context length, an unknown model) are not: they would fail again. What
still fails raises ``CompletionError`` once the call's other requests are done, naming the server and each failed
prompt's reason; the regeneration job names them by row. Nothing is skipped silently. ``finish_reason: length`` is
a normal answer, cut at the token budget as the embedded backend cuts it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

from omegaconf import OmegaConf

from treespec.train.training import config_checks
from treespec.train.training.completions import Completion, cut, stop_ids

BACKENDS = ("embedded", "server")
KEY = "data.regenerate.server"
FINISHED = ("stop", "length")  # an answer that ended at the end marker or eos, or at the token budget
RETRIED_STATUS = (408, 429)    # and every 5xx; other 4xx answers would fail again


class CompletionError(RuntimeError):
    """Prompts a server left unanswered after its retries: ``failures`` maps a prompt's index in the call to the
    reason. ``named(labels)``: the same error naming each prompt by its label (a row) instead."""

    def __init__(self, url: str, failures: dict[int, str], labels: list[str] | None = None):
        self.url, self.failures, self.labels = url, dict(failures), labels
        name = (lambda i: labels[i]) if labels else (lambda i: f"prompt {i} of the batch")
        lines = "\n".join(f"  {name(i)}: {reason}" for i, reason in sorted(self.failures.items()))
        super().__init__(f"the server at {url} left {len(self.failures)} request(s) unanswered:\n{lines}")

    def named(self, labels: list[str]) -> CompletionError:
        return CompletionError(self.url, self.failures, labels)


class _Retry(Exception):
    """A failure worth another try (the module docstring)."""


class _Fail(Exception):
    """A failure another try would repeat."""


def check_backend(r) -> dict | None:
    """``data.regenerate.backend`` and, for ``server``, ``data.regenerate.server`` (checked before any model
    loads) → the server settings, or None for the embedded backend."""
    backend = r.get("backend", "embedded")
    config_checks.choice(backend, "data.regenerate.backend", BACKENDS)
    if backend == "embedded":
        return None
    settings = check_settings(r.get("server"))
    if r.get("batch_size", 8) < settings["concurrency"]:
        warnings.warn(f"data.regenerate.batch_size={r.get('batch_size', 8)} is below {KEY}.concurrency="
                      f"{settings['concurrency']}: a batch's turns are sent together, so at most batch_size "
                      "requests are in flight; raise batch_size (a few times concurrency)", stacklevel=2)
    return settings


def check_settings(settings, key: str = KEY) -> dict:
    """The server settings (``url``, ``model``, ``concurrency``, ``timeout_s``, ``retries``, ``api_key_env``), each
    checked with an error naming ``key.<name>``; the API key read from its environment variable."""
    s = OmegaConf.to_container(settings) if OmegaConf.is_config(settings) else settings or {}
    if not isinstance(s, dict):
        raise ValueError(f"{key} must be a mapping of url, model, concurrency, ... (conf/data/chat.yaml), got {s!r}")
    url = s.get("url")
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        raise ValueError(f"{key}.url must be the server's http(s) address (http://127.0.0.1:8000), got {url!r}")
    if s.get("model") is not None and (not isinstance(s["model"], str) or not s["model"].strip()):
        raise ValueError(f"{key}.model must be the name the server serves the target under, or null (the one "
                         f"model it serves), got {s['model']!r}")
    config_checks.integer(s.get("concurrency", 16), f"{key}.concurrency")
    config_checks.number(s.get("timeout_s", 600), f"{key}.timeout_s", 0, low_open=True)
    config_checks.integer(s.get("retries", 3), f"{key}.retries", 0)
    env = s.get("api_key_env")
    if env is not None and (not isinstance(env, str) or not os.environ.get(env)):
        raise ValueError(f"{key}.api_key_env={env!r}: no such environment variable is set (it holds the server's "
                         "API key; null: no key)")
    return {"url": url, "model": s.get("model"), "concurrency": s.get("concurrency", 16),
            "timeout_s": float(s.get("timeout_s", 600)), "retries": s.get("retries", 3),
            "api_key": os.environ[env] if env else None}


class ServerBackend:
    """Completions from an OpenAI-compatible server at ``url`` (module docstring); ``model``: the name it serves
    the target under (None: the one model it serves). Asks the server for its models at once, so a wrong
    address or name fails before any work."""

    name = "server"

    def __init__(self, url: str, tokenizer, end_marker: str | None = None, *, model: str | None = None,
                 concurrency: int = 16, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 1.0,
                 api_key: str | None = None):
        check_settings({"url": url, "model": model, "concurrency": concurrency, "timeout_s": timeout_s,
                        "retries": retries})  # retries=-1 once failed at the first request (UnboundLocalError)
        self.url = url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.end_marker = tokenizer, end_marker or None
        self.stop = stop_ids(tokenizer, self.end_marker)
        self.concurrency, self.timeout_s, self.retries, self.backoff_s = concurrency, timeout_s, retries, backoff_s
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.model = self._served_model(model)

    @classmethod
    def from_settings(cls, settings: dict, tokenizer, end_marker: str | None = None) -> ServerBackend:
        """From ``check_settings``' dict."""
        return cls(settings["url"], tokenizer, end_marker, model=settings["model"],
                   concurrency=settings["concurrency"], timeout_s=settings["timeout_s"], retries=settings["retries"],
                   api_key=settings["api_key"])

    def _served_model(self, model: str | None) -> str:
        try:
            listed = json.loads(self._send("/v1/models", None))["data"]
            names = [m["id"] for m in listed]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{KEY}.url={self.url}: no OpenAI-compatible server answers there (GET /v1/models: "
                             f"{_reason(err)}); start one first (docs/training.md)") from None
        if model is None and len(names) != 1:
            raise ValueError(f"the server at {self.url} serves {names}: name one with {KEY}.model")
        if model is not None and model not in names:
            raise ValueError(f"{KEY}.model={model!r}: the server at {self.url} serves {names} only")
        return model or names[0]

    def _send(self, path: str, body: dict | None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=self.headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return response.read()

    def complete(self, prompts: list[str], *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[Completion]:
        """One completion per prompt, ``concurrency`` requests in flight; ``CompletionError`` when any is left
        unanswered after its retries (the others are finished first)."""
        body = {"model": self.model, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "stop": [self.end_marker] if self.end_marker else None, "stop_token_ids": self.stop,
                "add_special_tokens": False, "skip_special_tokens": True, "return_token_ids": True}

        def one(i: int) -> Completion | str:
            # sampled prompts each draw from their own seed: one seed for all would repeat one sample
            request = {**body, "prompt": prompts[i], **({"seed": (seed * 1_000_003 + i) % 2**31}
                                                        if temperature > 0 else {})}
            try:
                return self._with_retries(request)
            except _Fail as err:
                return str(err)

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            results = list(pool.map(one, range(len(prompts))))
        failures = {i: r for i, r in enumerate(results) if isinstance(r, str)}
        if failures:
            raise CompletionError(self.url, failures)
        return results

    def _with_retries(self, request: dict) -> Completion:
        for attempt in range(self.retries + 1):
            try:
                return self._parse(self._post(request), request)
            except _Retry as err:
                reason = str(err)
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        tries = self.retries + 1
        raise _Fail(f"{reason} (tried {tries} time{'s' * (tries > 1)})")

    def _post(self, request: dict) -> bytes:
        try:
            return self._send("/v1/completions", request)
        except urllib.error.HTTPError as err:
            detail = f"HTTP {err.code}: {_body(err)}"
            if err.code >= 500 or err.code in RETRIED_STATUS:
                raise _Retry(detail) from None
            raise _Fail(f"{detail} (not retried: the same request would fail again)") from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, a body cut short (IncompleteRead)
            if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
                raise _Retry(f"no answer within timeout_s={self.timeout_s:g} s") from None
            raise _Retry(_reason(err)) from None

    def _parse(self, raw: bytes, request: dict) -> Completion:
        """The answer's Completion; ``_Retry`` for an answer cut short or malformed."""
        try:
            data = json.loads(raw)
        except ValueError:
            raise _Retry(f"a malformed answer, not JSON ({len(raw)} bytes: {raw[:80]!r})") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise _Retry(f"a malformed answer: no single choice ({str(data)[:120]})")
        choice, usage = choices[0], data.get("usage")
        usage = usage if isinstance(usage, dict) else {}  # a list once escaped the retries as an AttributeError
        text, tokens, ids = choice.get("text"), usage.get("completion_tokens"), choice.get("token_ids")
        if choice.get("finish_reason") not in FINISHED:
            raise _Retry(f"an answer cut short: finish_reason {choice.get('finish_reason')!r}")
        if not isinstance(text, str) or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise _Retry(f"a malformed answer: text {type(text).__name__}, usage.completion_tokens {tokens!r}")
        if ids is not None and (not isinstance(ids, list) or len(ids) != tokens
                                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise _Retry(f"a malformed answer: token_ids {str(ids)[:40]} for {tokens} completion tokens")
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids is not None and not isinstance(prompt_ids, list):
            raise _Retry(f"a malformed answer: prompt_token_ids {str(prompt_ids)[:40]}, not a list")
        if prompt_ids is not None:
            ours = self.tokenizer.encode(request["prompt"], add_special_tokens=False)
            at = first_difference(ours, prompt_ids)
            if at is not None:
                raise _Fail(f"the server tokenized the prompt differently from the target's tokenizer (first "
                            f"difference at token {at} of {len(ours)}): is it serving {self.model!r} with the "
                            "target's tokenizer?")
        return Completion(cut(text, self.end_marker), tokens, None if ids is None else tuple(ids))


def first_difference(a, b) -> int | None:
    """The first position where two token sequences differ (the shorter one's length when one is the other's
    prefix), or None when they are equal."""
    at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return None if at == len(a) == len(b) else at


def _body(err: urllib.error.HTTPError) -> str:
    try:
        return " ".join(err.read().decode("utf-8", "replace").split())[:300] or err.reason
    except (OSError, http.client.HTTPException):
        return str(err.reason)


def _reason(err: Exception) -> str:
    if isinstance(err, urllib.error.URLError) and not isinstance(err, urllib.error.HTTPError):
        err = err.reason if isinstance(err.reason, Exception) else err
    if isinstance(err, http.client.IncompleteRead):
        return f"an answer cut short ({len(err.partial)} bytes read, {err.expected} more expected)"
    return f"{type(err).__name__}: {err}"[:300]
