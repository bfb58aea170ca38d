"""Workloads on a chat model (train/compare/templates.py) and the comparison on them (train/compare/job.py): chat
templates and their end tokens, template files that cannot be used named, turns answered by the target itself, and
a whole run by category on a tiny chat model (with a drafter made for another target refused by name)."""

import re

import pytest
import torch
from omegaconf import OmegaConf

from treespec import generate
from treespec.heads import PromptLookup
from treespec.train.compare import job as compare
from treespec.train.compare.templates import PromptTemplate, continuation_windows, timed_prompts
from treespec.train.compare.workload import Item
from treespec.train.training.chat import CHATML

from tests.helpers import SPEC_BENCH_ROWS, compose_cfg, hf_greedy, perturbed, tiny_llama, write_jsonl


def chat_tokenizer():
    """A byte-level tokenizer (every byte one token) with ChatML's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast  # 259 tokens: bytes, <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258


def chat_target(seed: int = 0):
    return tiny_llama(vocab=259, hidden=32, seed=seed, max_positions=1024)


def stops_at_im_end(model, prompt: torch.Tensor, step: int = 2):
    """Swap lm_head rows so that greedy decoding of ``prompt`` writes <|im_end|> where it wrote its ``step``-th
    token (or earlier)."""
    plain = generate(model, prompt, max_new_tokens=step + 1).sequences[0, prompt.shape[1]:]
    w = model.lm_head.weight.data
    t = int(plain[step])
    w[[t, 258]] = w[[258, t]]
    return model


# -- templates, end tokens and turns -----------------------------------------------------------------------
def test_prompts_use_the_chat_template_and_generation_stops_at_its_end_tokens():
    tokenizer = chat_tokenizer()
    template = PromptTemplate(tokenizer, "auto", system_prompt="Be brief.")
    assert template.end_ids == [256, 258]  # eos and the template's end-of-turn marker <|im_end|>
    messages = template.messages(Item("1", "c", ("What is 2+2?",)), 1, [])
    ids = template.ids(messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[0].tolist() == expected and messages[0] == {"role": "system", "content": "Be brief."}
    model = stops_at_im_end(chat_target(), ids)
    out = generate(model, ids, drafter=PromptLookup(), max_new_tokens=16, eos_token_id=template.end_ids)
    new = out.sequences[0, ids.shape[1]:].tolist()
    assert new[-1] == 258 and len(new) <= 3
    # greedy output token for token equal to transformers' generate on the same templated ids
    assert torch.equal(out.sequences, hf_greedy(model, ids, 16, eos_token_id=template.end_ids))
    raw = PromptTemplate(tokenizer, "none")
    assert raw.end_ids == [256] and raw.ids(messages[1:])[0].tolist() == tokenizer("What is 2+2?").input_ids
    # a base model's tokenizer has no chat template: "auto" feeds raw text, and says so
    plain = PromptTemplate(tiny_tokenizer_without_template(), "auto")
    assert plain.renderer is None and "has no chat template" in plain.describe()["template"]
    with pytest.raises(ValueError, match=r"workload.template='nope.jinja' is none of auto, none, chatml"):
        PromptTemplate(tokenizer, "nope.jinja")


def test_a_template_file_that_is_not_utf8_or_not_jinja_or_raises_names_workload_template(tmp_path):
    tokenizer = chat_tokenizer()
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ 'café' }}".encode("latin-1"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    for path, message in ((latin, "the file is not UTF-8 text"),
                          (broken, r"the template is not valid Jinja \(line 2\)")):
        pattern = rf"workload.template='{re.escape(str(path))}': {message}"
        with pytest.raises(ValueError, match=pattern):
            PromptTemplate(tokenizer, str(path))
        with pytest.raises(ValueError, match=pattern):  # before any model loads
            compare.check_config(compose_cfg("compare", ["logger=none", f"workload.template={path}"]))
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                      "{% endif %}{{ m.content }}{% endfor %}")
    template = PromptTemplate(tokenizer, str(strict), system_prompt="Be brief.")
    with pytest.raises(ValueError, match=rf"workload.template='{re.escape(str(strict))}': the template failed .*no "
                                         "system role"):
        template.ids(template.messages(Item("1", "c", ("Hi",)), 1, []))
    with pytest.raises(ValueError, match=r"workload.system_prompt must be a string or null, got 7 \(int"):
        PromptTemplate(tokenizer, "auto", system_prompt=7)


def tiny_tokenizer_without_template():
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def test_the_second_turn_holds_the_targets_own_first_answer():
    tokenizer = chat_tokenizer()
    template = PromptTemplate(tokenizer, "auto")
    item = Item("81", "writing", ("Write a haiku.", "Now make it rhyme."))
    model = chat_target()
    lines = []
    prompts = timed_prompts(model, template, [item], lambda c: 6, log=lines.append)
    assert [(p.id, p.turn) for p in prompts] == [("81", 1), ("81/turn 2", 2)]
    # a progress line after each greedy answer (a workload's answers take minutes on a bigger target)
    answered = [line for line in lines if "greedy answers (what later turns hold) [" in line]
    assert [line.split(" · ")[0].split("[")[1] for line in answered] == ["1/2]", "2/2]"]
    assert answered[0].split(" · ")[1] == f"81: {prompts[0].answer_tokens} tokens"
    first = generate(model, prompts[0].ids, max_new_tokens=6, eos_token_id=template.end_ids)
    answer = template.answer_text(first.sequences[0, prompts[0].ids.shape[1]:])
    assert answer and prompts[0].answer_tokens == first.new_tokens
    second = tokenizer.decode(prompts[1].ids[0])
    assert second.startswith(tokenizer.decode(prompts[0].ids[0])) and f"assistant\n{answer}<|im_end|>" in second
    assert second.endswith("Now make it rhyme.<|im_end|>\n<|im_start|>assistant\n")
    held = continuation_windows(model, template, [item], new_tokens=6, log=lines.append)
    assert "held-out prompts (for accuracies) [1/1]" in lines[-1]
    # the whole prompt is the window's context (its lead), the target's own answer follows it
    assert held.leads == [prompts[0].ids.shape[1]] and torch.equal(held.windows[0], first.sequences)


# -- the whole comparison on a chat workload ------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """A tiny chat target and a draft model sharing its tokenizer, saved as model folders."""
    root = tmp_path_factory.mktemp("chat_models")
    tokenizer = chat_tokenizer()
    target = chat_target()
    for name, model in (("target", target), ("draft", perturbed(target, 0.05))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def test_comparison_on_a_chat_workload_reports_by_category(chat_models, tmp_path, monkeypatch, no_report_figures):
    monkeypatch.chdir(tmp_path)
    questions = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH_ROWS + [
        {"question_id": 85, "category": "math", "turns": ["What is 4-1?"]},
        {"question_id": 86, "category": "writing", "turns": ["Name a fruit."]}])
    cfg = compose_cfg("compare", [
        f"target={chat_models / 'target'}", f"available.draft.source={chat_models / 'draft'}",
        f"assistant={chat_models / 'draft'}", "workload=jsonl", f"workload.path={questions}",
        "workload.per_category=2", "workload.held_out=2", "workload.held_out_tokens=8", "max_new_tokens=6",
        "workload.max_new_tokens={math: 4}", "trees=[{kind: chain, depth: 2}, {kind: accuracy, nodes: 3}]",
        "cost_sizes=[1,2,4]", "logger=none", f"paths.data={tmp_path / 'cache'}"])
    # another target: the model-free drafters + given sources
    assert compare.drafter_labels(cfg) == ["prompt_lookup", "recycling", "suffix", "lookahead", "draft"]
    result = compare.run_from_config(cfg, tmp_path / "run")
    info = result["prompt_info"]
    assert {p["category"] for p in info} == {"math", "writing"}
    assert all(p["max_new_tokens"] == (4 if p["category"] == "math" else 6) for p in info)
    assert result["settings"]["end_token_ids"] == [256, 258]
    assert "held-out prompts of this workload" in result["settings"]["held_out"]
    assert set(result["accuracy"]) == {"draft"}  # measured on the held-out continuations
    w = result["stamp"]["workload"]
    assert w["held_out_items"] == 2 and w["template"] == "auto" and len(w["selected_sha1"]) == 40
    assert result["stamp"]["assistant"]["used"] is True
    assert {p["name"] for p in result["peers"]} == {"transformers greedy", "transformers assisted",
                                                    "transformers prompt lookup"}
    md = (tmp_path / "run" / "results.md").read_text()
    assert "| math speedup | math τ | writing speedup | writing τ |" in md
    assert "Accuracies (accuracy and auto trees, predictions) were measured on the target's own continuations" in md
    rows = [r for r in csv_rows(tmp_path / "run" / "by_category.csv")]
    assert {r["category"] for r in rows} == {"math", "writing", "overall"}
    # the best configuration's tree, ready for generate()
    from treespec.tree import Tree

    assert Tree.load(tmp_path / "run" / "best_tree.json") is not None
    # the reference assistant cannot assist this target: skipped, with a note
    other = OmegaConf.merge(cfg, {"assistant": "reference:draft"})
    model, note = compare.assistant_peer(other, chat_tokenizer(), "cpu", log=lambda *_: None)
    assert model is None and "vocabulary differs" in note["reason"]


def csv_rows(path):
    import csv

    return list(csv.DictReader(open(path)))


def test_a_drafter_trained_for_another_target_names_its_entry_and_the_fix(chat_models, tmp_path):
    questions = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH_ROWS)
    cfg = compose_cfg("compare", [f"target={chat_models / 'target'}", "drafters=[medusa]", "logger=none",
                                  "workload=jsonl", f"workload.path={questions}"])
    from treespec import reference

    target, _ = reference.load_model(cfg.target)
    with pytest.raises(ValueError, match=r"drafters: 'medusa' \(available.medusa.source=reference:medusa\) cannot "
                                         r"serve the target .*hidden.size 384.*drafters=\[...\] without medusa.*"
                                         r"train_heads.py target="):
        compare.load_drafters(cfg, target, lambda: None, None)
