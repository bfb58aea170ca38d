"""A workload's items as the token ids the comparison decodes: chat templates, end tokens and turns.

**Templates** (``workload.template``): ``auto`` is the target tokenizer's own chat template, applied with
the generation prompt (the assistant header) as a chat server would, or raw text when the tokenizer has
none (a base or code model, such as the reference target; the stamp says so); ``chatml`` or a ``.jinja``
file replace it; ``none`` feeds the text as it is (code to continue; a second turn follows the first
answer after a blank line). ``workload.system_prompt`` goes first when an item has no system message.

**End tokens**: generation stops at every token that ends a turn: the tokenizer's eos, the model's
generation-config eos ids (Llama-3: ``<|eot_id|>`` and ``<|end_of_text|>``) and the template's own
end-of-turn marker (``<|im_end|>``, found by rendering a probe conversation, train/training/chat.py's ChatRenderer).

**Turns** (Spec-Bench's multi-turn questions): turn k's prompt holds turns 1..k-1 answered by the target
itself, greedily, in this run (once, before any timing; every configuration then decodes the same prompts).
The greedy answers' lengths are also what predictions take as each prompt's generation length.

**Held-out continuations**: the text verification sees is the target's own; the drafters' accuracies are
measured on the target's continuations of the held-out items (at the run's temperature), each window the
last ``lead`` prompt tokens and the continuation, as train/training/data.py's ``own_continuations`` does for corpus
text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec import generate
from treespec.inputs import max_positions
from treespec.train.compare.progress import Countdown
from treespec.train.compare.workload import Item
from treespec.train.training.chat import TEMPLATES, ChatRenderer


@dataclass
class TimedPrompt:
    """One prompt the comparison times: a turn of a workload item, as token ids."""

    ids: torch.Tensor            # LongTensor [1, P]
    id: str                      # the item's id, "/turn k" appended for k > 1
    category: str
    turn: int                    # 1-based
    max_new_tokens: int
    answer_tokens: int = 0       # the target's greedy answer's length (predictions' generation length)

    def describe(self) -> dict:
        return {"id": self.id, "category": self.category, "turn": self.turn, "prompt_tokens": self.ids.shape[1],
                "max_new_tokens": self.max_new_tokens, "answer_tokens": self.answer_tokens}


def check_system_prompt(value) -> None:
    """``workload.system_prompt``: a string or null."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"workload.system_prompt must be a string or null, got {value!r} ({type(value).__name__}; "
                         "quote a number on the command line: workload.system_prompt=\"'42'\")")


def _template_errors() -> tuple[type[Exception], ...]:
    """What rendering or compiling a chat template raises (Jinja's errors, raise_exception's included)."""
    try:
        import jinja2
    except ImportError:  # no Jinja, no chat template to render
        return ()
    return (jinja2.TemplateError,)


def compile_template(text: str, where: str) -> None:
    """Parse a chat template as transformers will render it: a ValueError naming ``where`` on a syntax error."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: errors then surface when rendering, still wrapped (ids())
        return
    try:
        _compile_jinja_template(text)
    except _template_errors() as err:
        line = getattr(err, "lineno", None)
        raise ValueError(f"{where}: the template is not valid Jinja{f' (line {line})' if line else ''}: "
                         f"{getattr(err, 'message', None) or err}") from None


def check_template(template) -> None:
    """``workload.template``: auto, none, a name in TEMPLATES, or a UTF-8 .jinja file that compiles."""
    if template in ("auto", "none", None) or (isinstance(template, str) and template in TEMPLATES):
        return
    if not isinstance(template, str) or not Path(template).is_file():
        raise ValueError(f"workload.template={template!r} is none of auto, none, {', '.join(TEMPLATES)} or a "
                         "template file")
    try:
        text = Path(template).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"workload.template={template!r}: the file is not UTF-8 text (byte {err.start}); save it as "
                         "UTF-8") from None
    compile_template(text, f"workload.template={template!r}")


class PromptTemplate:
    """Renders messages into prompt ids for one tokenizer (module docstring)."""

    def __init__(self, tokenizer, template: str | None = "auto", system_prompt: str | None = None,
                 extra_end_ids=()):
        check_template(template)
        check_system_prompt(system_prompt)
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.name = "none" if template in ("none", None) else str(template)
        if self.name == "auto" and not getattr(tokenizer, "chat_template", None):
            self.name = "none (auto: the target's tokenizer has no chat template)"
        self.renderer, self.text = None, ""
        if not self.name.startswith("none"):
            self.renderer = ChatRenderer(tokenizer, None if self.name == "auto" else self.name)
            self.text = self.renderer.template
            compile_template(self.text, self.where)
        self.end_ids = self._end_ids(extra_end_ids)

    @property
    def where(self) -> str:
        """The setting and the template's origin, for errors."""
        return "workload.template=auto (the target tokenizer's chat template)" if self.name == "auto" else \
            f"workload.template={self.name!r}"

    def _end_ids(self, extra) -> list[int]:
        ids = []
        for value in (self.tokenizer.eos_token_id, *extra):
            ids += list(value) if isinstance(value, (list, tuple)) else [value] if value is not None else []
        marker = self.renderer.end_marker if self.renderer is not None else ""
        if marker:
            encoded = self.tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) == 1:  # a special token (an end marker spelled in several tokens cannot be one id)
                ids.append(encoded[0])
        return sorted({int(i) for i in ids})

    def describe(self) -> dict:
        """The stamp's record: template name, sha1 of its text, system prompt, end token ids."""
        return {"template": self.name, "template_sha1": hashlib.sha1(self.text.encode()).hexdigest() if self.text
                else None, "system_prompt": self.system_prompt, "end_token_ids": self.end_ids}

    def messages(self, item: Item, turns: int, answers: list[str]) -> list[dict]:
        """The conversation of ``item``'s turn ``turns`` (1-based): context, then user/assistant turns."""
        msgs = item.messages()
        if self.system_prompt and not (msgs and msgs[0]["role"] == "system"):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        for k in range(turns):
            msgs.append({"role": "user", "content": item.turns[k]})
            if k < turns - 1:
                msgs.append({"role": "assistant", "content": answers[k]})
        return msgs

    def ids(self, messages: list[dict]) -> torch.Tensor:
        """LongTensor [1, P]: the conversation with the generation prompt (or, raw, its text)."""
        if self.renderer is None:
            text = ""
            for m in messages:  # an answer continues its prompt; anything else starts a new paragraph
                text += m["content"] if m["role"] == "assistant" or not text else "\n\n" + m["content"]
            return self.tokenizer(text, return_tensors="pt").input_ids
        try:
            text = self.renderer.render(messages, add_generation_prompt=True)
        except _template_errors() as err:  # a syntax error, or the template's own raise_exception
            raise ValueError(f"{self.where}: the template failed on a prompt's conversation (roles "
                             f"{[m['role'] for m in messages]}): {type(err).__name__}: {err}") from None
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    def first_turn_tokens(self, item: Item) -> int:
        """Prompt tokens of the item's first turn (what ``max_prompt_tokens`` is checked against first)."""
        return self.ids(self.messages(item, 1, [])).shape[1]

    def answer_text(self, new_ids: torch.Tensor) -> str:
        """An answer's text without its end token (it goes back into the next turn's conversation)."""
        ids = [int(t) for t in new_ids.reshape(-1)]
        while ids and ids[-1] in self.end_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip() if self.renderer is not None else \
            self.tokenizer.decode(ids)


def fitted(ids: torch.Tensor, budget: int, positions: int | None, name: str, log=print) -> torch.Tensor:
    """[1, P'] ``ids``' last tokens that leave ``budget`` new ones inside the target's ``positions`` (raw code is cut
    anywhere; a templated prompt never is); unchanged when they fit, or when the budget alone does not."""
    if positions is not None and ids.shape[1] + budget > positions > budget:
        log(f"{name}: keeps its last {positions - budget} of {ids.shape[1]} tokens (the target has {positions} "
            f"positions, {budget} of them for new tokens)")
        return ids[:, -(positions - budget):]
    return ids


def timed_prompts(target, template: PromptTemplate, items: list[Item], max_new_tokens_of, *,
                  max_prompt_tokens: int | None = None, skipped=None, cut_to_fit: bool = False,
                  log=print) -> list[TimedPrompt]:
    """Every turn of every item as a TimedPrompt, turn k holding the target's greedy answers to turns 1..k-1
    (module docstring). ``max_new_tokens_of(category)``: the generation budget. A later turn that grows past
    ``max_prompt_tokens`` is skipped (with the turns after it) and counted in ``skipped``."""
    out = []
    device = target.device
    positions = max_positions(target.config)  # a small target's context can be shorter than a prompt + answer
    # the target answers every turn greedily before anything is timed: minutes on a bigger target, so say how far
    progress = Countdown("the target's greedy answers (what later turns hold)", sum(len(i.turns) for i in items), log)
    for item in items:
        answers: list[str] = []
        budget = int(max_new_tokens_of(item.category))
        for turn in range(1, len(item.turns) + 1):
            ids = template.ids(template.messages(item, turn, answers))
            if cut_to_fit:
                ids = fitted(ids, budget, positions, item.id, log)
            reason = ("over max_prompt_tokens" if max_prompt_tokens is not None and ids.shape[1] > max_prompt_tokens
                      else "past the target's positions" if positions is not None and ids.shape[1] + budget > positions
                      else None)
            if reason is not None:
                if skipped is not None:
                    skipped[reason] += len(item.turns) - turn + 1
                for later in range(turn, len(item.turns) + 1):
                    progress(f"{item.id} turn {later}: skipped ({reason})")
                break
            greedy = generate(target, ids.to(device), max_new_tokens=budget, eos_token_id=template.end_ids or None)
            new = greedy.sequences[0, ids.shape[1]:].cpu()
            answers.append(template.answer_text(new))
            out.append(TimedPrompt(ids.to(device), item.id if turn == 1 else f"{item.id}/turn {turn}", item.category,
                                   turn, budget, answer_tokens=int(new.numel())))
            progress(f"{out[-1].id}: {int(new.numel())} tokens")
    log(f"workload: {len(out)} timed prompts from {len(items)} items, each turn's prompt holding the target's own "
        "greedy answers to the turns before it")
    if not out:
        raise ValueError(f"no timed prompt: all {len(items)} selected items were skipped ({dict(skipped or {})}); "
                         "raise workload.max_prompt_tokens, lower max_new_tokens, or pick shorter prompts")
    return out


@dataclass
class HeldOutText:
    """The target's own text that accuracies, chain τ and FR-Spec's counts are measured on: ``windows`` (one
    [n, S] tensor, or [1, S_i] each) opening with ``leads`` tokens of context (an int for all, or one per window)
    that decoding never drafts, the rest the target's continuation; ``prompts`` ([1, P] each, or None): the held-out
    prompts those continuations were decoded from, whole, which a dry run decodes as a timed prompt is
    (train/compare/dry_runs.py)."""

    windows: torch.Tensor | list[torch.Tensor]
    leads: int | list[int]
    prompts: list[torch.Tensor] | None = None

    def pairs(self) -> list[tuple[torch.Tensor, int]]:
        """(window, lead) per tensor: the one [n, S] tensor, or each [1, S_i] window."""
        windows = [self.windows] if isinstance(self.windows, torch.Tensor) else list(self.windows)
        leads = [self.leads] * len(windows) if isinstance(self.leads, int) else list(self.leads)
        return list(zip(windows, leads, strict=True))

    def to(self, device) -> HeldOutText:
        prompts = None if self.prompts is None else [p.to(device) for p in self.prompts]
        if isinstance(self.windows, torch.Tensor):
            return HeldOutText(self.windows.to(device), self.leads, prompts)
        return HeldOutText([w.to(device) for w in self.windows], self.leads, prompts)


def continuation_windows(target, template: PromptTemplate, items: list[Item], *, new_tokens: int = 128,
                         temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                         max_prompt_tokens: int | None = None, cut_to_fit: bool = False, log=print) -> HeldOutText:
    """[1, P_i + n] windows: each held-out item's whole first-turn prompt (P_i tokens, its lead: the context decoding
    drafts in) and the target's own continuation (up to ``new_tokens``, stopping at an end token; sampled at
    ``temperature``/``top_p``). Windows whose continuation has fewer than 2 tokens, and over-long prompts, are left
    out. The whole prompt, not its last few tokens: the target's features and choices along its answer depend on
    the question, and a drafter is scored on the states decoding gives it. ``cut_to_fit``: as the timed prompts are
    (``fitted``)."""
    windows, leads = [], []
    positions = max_positions(target.config)
    progress = Countdown("the target's continuations of the held-out prompts (for accuracies)", len(items), log)
    for i, item in enumerate(items):
        ids = template.ids(template.messages(item, 1, []))
        if cut_to_fit:
            ids = fitted(ids, new_tokens, positions, item.id, lambda _: None)
        if max_prompt_tokens is not None and ids.shape[1] > max_prompt_tokens:
            progress(f"{item.id}: skipped (over max_prompt_tokens)")
            continue
        gen = torch.Generator().manual_seed(seed + i)
        out = generate(target, ids.to(target.device), max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                       eos_token_id=template.end_ids or None, generator=gen)
        if out.new_tokens >= 2:
            windows.append(out.sequences.cpu())
            leads.append(ids.shape[1])
        progress(f"{item.id}: {out.new_tokens} tokens")
    return HeldOutText(windows, leads, [w[:, :lead] for w, lead in zip(windows, leads, strict=True)])


def token_counts(held: HeldOutText, vocab: int) -> torch.Tensor:
    """[V] counts of the continuation tokens (each window past its lead): FR-Spec's ranking on the workload."""
    tokens = [row[lead:] for w, lead in held.pairs() for row in w.cpu() if row.shape[0] > lead]
    flat = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
    return torch.bincount(flat.long(), minlength=vocab)
