"""Completing rendered chat prompts: the backends the data jobs (train/training/regeneration.py,
train/training/magpie.py) write requests and answers with.

Both take prompts already rendered with the target's chat template (text ending in the assistant header, or in
a user header for Magpie's requests) and return the text the target wrote after each, cut at the template's
end-of-turn marker, with the number of tokens it took.

- ``EmbeddedBackend`` (the default): treespec's own batched decoding loop (``treespec.generate``) on the
  loaded target, left-padded rows that retire as they finish. Greedy rows are the target's greedy answer to
  that prompt; sampled rows draw from one generator seeded per call, so a resumed job draws alike.
- ``ServerBackend`` (train/training/server_backend.py, ``data.regenerate.backend=server``): an OpenAI-compatible
  server (``vllm serve``, SGLang) already serving the target, ``concurrency`` requests in flight.

A backend is a small strategy object, not a second job: the jobs call ``complete`` and never know which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec import generate


@dataclass(frozen=True)
class Completion:
    text: str        # what the target wrote after the prompt, cut at the end-of-turn marker (leading space kept:
    #                  a request's opener is continued by it)
    tokens: int      # tokens it generated (the end marker included when it ended on one)
    ids: tuple[int, ...] | None = None  # those tokens' ids, when the backend knows them (the token-agreement check)


def stop_ids(tokenizer, end_marker: str | None) -> list[int]:
    """Token ids that end an answer: the tokenizer's eos, and the template's end-of-turn marker when that is one
    token (``<|im_end|>``). A marker split over several tokens is cut from the text afterwards instead."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if end_marker:
        marker = tokenizer.encode(end_marker, add_special_tokens=False)
        if len(marker) == 1 and marker[0] not in ids:
            ids.append(int(marker[0]))
    return ids


def cut(text: str, end_marker: str | None) -> str:
    """The text before the end-of-turn marker, trailing space removed."""
    return (text.split(end_marker)[0] if end_marker else text).rstrip()


class EmbeddedBackend:
    """Completions from treespec's own decoding loop on ``target`` (module docstring)."""

    name = "embedded"

    def __init__(self, target, tokenizer, end_marker: str | None = None):
        self.target, self.tokenizer, self.end_marker = target, tokenizer, end_marker or None
        self.stop = stop_ids(tokenizer, self.end_marker)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.stop or [0])[0]

    @torch.no_grad()
    def complete(self, prompts: list[str], *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[Completion]:
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:
            enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            self.tokenizer.padding_side = side
        device = next(self.target.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        out = generate(self.target, enc.input_ids.to(device), attention_mask=enc.attention_mask.to(device),
                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                       eos_token_id=self.stop or None, pad_token_id=self.pad, generator=generator)
        width = enc.input_ids.shape[1]
        completions = []
        for row, ids in zip(out.rows, out.sequences[:, width:].cpu(), strict=True):
            text = self.tokenizer.decode(ids[: row.new_tokens], skip_special_tokens=True)
            completions.append(Completion(cut(text, self.end_marker), row.new_tokens,
                                          tuple(ids[: row.new_tokens].tolist())))
        return completions
