"""Workloads (train/compare/workload.py, train/compare/templates.py) and the comparison on them (train/compare/job.py):
every prompt format, datasets folders and parquet files, seeded selection, chat templates and end tokens, turns
answered by the target itself, and a whole run by category on a tiny chat model."""

import codecs
import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from treespec import generate
from treespec.heads import PromptLookup
from treespec.train.compare import job as compare
from treespec.train.compare.selection import select
from treespec.train.compare.templates import PromptTemplate, continuation_windows, timed_prompts
from treespec.train.compare.workload import Item, load_workload, read_dataset, read_jsonl, read_texts
from treespec.train.training.chat import CHATML

from .helpers import compose_cfg, hf_greedy, perturbed, tiny_llama, write_jsonl

SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Name a colour."]},
    {"question_id": 83, "category": "math", "turns": ["What is 2+2?"]},
    {"question_id": 84, "category": "math", "turns": ["What is 3*3?"]},
]
OTHER_FORMATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye?"},
                  {"role": "assistant", "content": "recorded answer"}], "category": "chat"},
    {"conversations": [{"from": "human", "value": "Sum 1 and 2"}, {"from": "gpt", "value": "3"}]},
    {"prompt": "Translate: chat", "category": "translation", "id": "t1"},
    {"text": "def f(x):"},
    {"neither": 1},
    {"turns": []},
]


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


# -- reading ----------------------------------------------------------------------------------------------
def test_every_jsonl_format_is_read_and_counted(tmp_path):
    items, skipped, formats = read_jsonl(write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH + OTHER_FORMATS + SPEC_BENCH[:1]))
    assert formats == {"spec-bench": 4, "openai": 1, "sharegpt": 1, "prompt": 1, "text": 1}
    assert skipped == {"unknown format": 1, "no user turn": 1, "duplicate": 1}
    by_id = {i.id: i for i in items}
    assert by_id["81"].turns == ("Write a haiku.", "Now make it rhyme.") and by_id["81"].category == "writing"
    chat = next(i for i in items if i.category == "chat")  # asked at its last user turn, the recorded answer dropped
    assert chat.turns == ("Bye?",) and chat.context == (("system", "Be brief."), ("user", "Hi"),
                                                        ("assistant", "Hello!"))
    assert next(i for i in items if i.turns == ("Sum 1 and 2",)).category == "all"
    assert by_id["t1"].category == "translation"


def test_datasets_folder_and_parquet_with_a_column_mapping(tmp_path):
    import datasets

    rows = {"question": ["What is 1+1?", "What is 2+3?", "Spell cat."], "subject": ["math", "math", "words"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "folder"))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "set.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dict"))
    for name, split in ((tmp_path / "folder", "train"), (tmp_path / "set.parquet", "train"),
                        (tmp_path / "dict", "test")):
        items, skipped, formats = read_dataset(str(name), split, {"prompt": "question", "category": "subject"})
        assert [i.turns[0] for i in items] == rows["question"] and formats == {"prompt": 3} and not skipped
        assert [i.category for i in items] == rows["subject"]
    with pytest.raises(ValueError, match=r"workload.columns names \['query'\].*its columns: question, subject"):
        read_dataset(str(tmp_path / "folder"), "train", {"prompt": "query"})


def test_an_offline_hub_id_says_how_to_pass_a_local_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"workload.name='someone/no-such-set' is not a local folder.*save_to_disk"
                                         r".*workload.name=DIR"):
        read_dataset("someone/no-such-set", "test", cache_dir=tmp_path)


def test_texts_folder_windows_by_sub_folder(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("".join(f"x{i} = {i}\n" for i in range(200)))
    (tmp_path / "notes.md").write_text("# notes\nsome text\n")
    (tmp_path / "blob.bin").write_bytes(b"\xff\xfe\x00")
    items, skipped, _ = read_texts(tmp_path, window_chars=100, windows_per_file=3)
    assert [i.category for i in items] == ["md", "src", "src", "src"] and skipped == {"not UTF-8 text": 1}
    assert all(len(i.turns[0]) <= 100 and i.turns[0].endswith("\n") for i in items if i.category == "src")


def _jsonl_bytes(rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def test_a_line_that_is_not_utf8_is_skipped_counted_and_named_and_a_bom_keeps_the_first_row(tmp_path):
    path = tmp_path / "q.jsonl"
    latin = json.dumps({"prompt": "café au lait"}, ensure_ascii=False).encode("latin-1")
    path.write_bytes(codecs.BOM_UTF8 + _jsonl_bytes([{"prompt": "first"}, latin, {"prompt": "third"}, latin]))
    with pytest.warns(UserWarning, match=r"workload.path='.*q.jsonl': lines 2 and 4 are not UTF-8 text"):
        items, skipped, _ = read_jsonl(path)
    assert [i.turns[0] for i in items] == ["first", "third"] and skipped == {"not UTF-8": 2}


def test_a_file_of_nothing_but_bad_lines_says_how_many_were_not_json(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("{oops\nnot json\n[1,\n")
    with pytest.raises(ValueError, match=r"q.jsonl: no usable prompt \(\{'not JSON': 3\}\)"):
        read_jsonl(path)


def test_json_files_hold_a_list_one_object_or_json_lines_and_a_broken_one_is_named(tmp_path):
    pretty = tmp_path / "one.json"
    pretty.write_text(json.dumps({"prompt": "only one", "category": "c"}, indent=2))
    items, skipped, _ = read_jsonl(pretty)
    assert [(i.turns[0], i.category) for i in items] == [("only one", "c")] and not skipped
    lines = tmp_path / "lines.json"
    lines.write_bytes(_jsonl_bytes([{"prompt": "a"}, {"prompt": "b"}]))
    assert [i.turns[0] for i in read_jsonl(lines)[0]] == ["a", "b"]
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=1))
    assert len(read_jsonl(listed)[0]) == 2
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"prompt": "a"},\n {"prompt": "b",}\n]')
    with pytest.raises(ValueError, match=r"workload.path='.*broken.json': not valid JSON at line 3, column"):
        read_jsonl(broken)
    number = tmp_path / "number.json"
    number.write_text("3")
    with pytest.raises(ValueError, match=r"number.json'?: holds a JSON int, not a list of rows or one row"):
        read_jsonl(number)


def test_categories_that_are_not_strings_and_malformed_turns_are_skipped_and_counted(tmp_path):
    rows = [{"prompt": f"p{i}", "category": c} for i, c in enumerate([0, False, ["a"], {"b": 1}])]
    rows += [{"prompt": "kept", "category": ""}, {"prompt": "kept too", "category": "math"}]
    rows += [{"question_id": 1, "turns": ["q1", 3, "q3"]}, {"question_id": 2, "turns": [["a", "b"]]},
             {"question_id": 3, "turns": ["q1", " ", "q3"]}, {"question_id": 4, "turns": {"q": 1}}]
    items, skipped, _ = read_jsonl(write_jsonl(tmp_path / "q.jsonl", rows))
    assert [(i.turns, i.category) for i in items] == [(("kept",), "all"), (("kept too",), "math")]
    assert skipped == {"category not a string": 4, "turns not a list of strings": 3, "empty turn": 1}


def test_rows_sharing_an_id_get_their_own_ids_with_a_warning(tmp_path):
    rows = [{"question_id": 81, "turns": ["one"]}, {"question_id": 81, "turns": ["two"]},
            {"question_id": 81, "turns": ["three"]}, {"question_id": 81, "turns": ["one"]}]
    with pytest.warns(UserWarning, match=r"q.jsonl: 2 row\(s\) share an id.*81 → 81#2, 81 → 81#3"):
        items, skipped, _ = read_jsonl(write_jsonl(tmp_path / "q.jsonl", rows))
    assert [i.id for i in items] == ["81", "81#2", "81#3"] and skipped == {"duplicate": 1}


def test_texts_stay_inside_the_folder_and_say_why_no_file_gave_text(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "secret.txt"
    (root / "src").mkdir(parents=True)
    outside.write_text("do not read me\n")
    (root / "src" / "a.py").write_text("x = 1\n")
    (root / "src" / "link.txt").symlink_to(outside)
    for pattern in ("../*", "/etc/*", "src/../../*"):
        with pytest.raises(ValueError, match=r"workload.pattern=.* must be a glob inside workload.path"):
            read_texts(root, pattern)
    items, skipped, _ = read_texts(root)
    assert [i.turns[0] for i in items] == ["x = 1\n"] and skipped == {"outside workload.path": 1}
    binary = tmp_path / "binary"
    binary.mkdir()
    for name in ("a.bin", "b.bin"):
        (binary / name).write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match=r"none of the 2 files matching it holds text \(2 not UTF-8 text\)"):
        read_texts(binary)
    with pytest.raises(ValueError, match=r"workload.pattern='\*.py': no file matches it"):
        read_texts(binary, "*.py")
    for kw, message in (({"window_chars": -5}, "workload.window_chars must be an integer >= 1, got -5"),
                        ({"window_chars": 0}, "workload.window_chars must be an integer >= 1, got 0"),
                        ({"windows_per_file": 0}, "workload.windows_per_file must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            read_texts(root, **kw)


def test_a_per_category_budget_for_an_unknown_category_is_refused(tmp_path):
    w = OmegaConf.create({"source": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)),
                          "max_new_tokens": {"mathh": 2}, "held_out": 0})
    with pytest.raises(ValueError, match=r"workload.max_new_tokens: \['mathh'\] not found; the workload's categories "
                                         r"are math, writing"):
        load_workload(w)
    w.max_new_tokens = {"math": 2}
    assert len(load_workload(w).timed) == 4


# -- selection --------------------------------------------------------------------------------------------
def _items(n: int, category: str = "c") -> list[Item]:
    return [Item(str(i), category, (f"question {category} {i}",)) for i in range(n)]


def test_selection_is_seeded_by_content_and_stable_when_the_file_grows():
    items = _items(20, "a") + _items(20, "b")
    timed, held, names = select(items, per_category=5, held_out=4, seed=0)
    assert names == ["a", "b"] and len(timed) == 10 and len(held) == 4
    assert not {i.key for i in timed} & {i.key for i in held}  # held-out prompts are never timed
    assert select(items[::-1], per_category=5, held_out=4, seed=0) == (timed, held, names)  # file order: no effect
    assert select(items, per_category=5, held_out=4, seed=1)[0] != timed  # the seed reshuffles
    grown = items + _items(30, "a")[20:] + _items(30, "b")[20:]
    timed2, held2, _ = select(grown, per_category=5, held_out=4, seed=0)
    old = {i.key for i in items}
    # a grown file keeps the earlier choice: old items chosen now were chosen before, and every earlier choice
    # stays unless a new item ranks ahead of it
    assert {i.key for i in timed2 + held2 if i.key in old} <= {i.key for i in timed + held}
    kept = [i for i in timed + held if i in timed2 + held2]
    assert len(kept) + sum(i.key not in old for i in timed2 + held2) == 14
    # a prompt cap takes the categories in turn; a category keeps one timed prompt whatever is held out
    assert [i.category for i in select(items, prompts=3)[0]] == ["a", "a", "b"]
    timed3, held3, _ = select(_items(1, "x") + _items(3, "y"), held_out=4)
    assert [i.category for i in timed3] == ["x", "y"] and [i.category for i in held3] == ["y", "y"]


def test_over_long_prompts_are_skipped_and_counted_and_categories_filtered():
    from collections import Counter

    items = _items(6, "a") + [Item("long", "a", ("x" * 500,))] + _items(2, "b")
    skipped = Counter()
    timed, _, names = select(items, categories=["a"], length=lambda it: len(it.turns[0]), max_prompt_tokens=100,
                             skipped=skipped)
    assert names == ["a"] and len(timed) == 6 and skipped == {"over max_prompt_tokens": 1}
    with pytest.raises(ValueError, match=r"\['z'\] not found; the workload's categories are a, b"):
        select(items, categories=["z"])


@pytest.mark.parametrize("overrides, message", [
    (["workload=jsonl", "workload.path=q.jsonl", "workload.max_new_tokens={math: 256}", "workload.categories=math"],
     None),
    (["workload=dataset", "workload.name=/data/set", "workload.columns.turns=prompt"], None),
    (["workload=texts", "workload.path=/src", "workload.pattern=*.py"], None),
    (["workload=reference", "prompts=null"], None),
    (["workload=jsonl"], r"workload=jsonl needs workload.path="),
    (["workload=dataset"], r"workload=dataset needs workload.name="),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.per_category=0"], r"workload.per_category must be"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.held_out=-1"], r"workload.held_out must be"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.max_new_tokens={math: 0}"],
     r"workload.max_new_tokens.math must be"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.max_new_tokens=5"],
     r"workload.max_new_tokens must be \{category: tokens\} or null, got 5"),
    (["workload=texts", "workload.path=/src", "workload.window_chars=-5"],
     r"workload.window_chars must be an integer >= 1, got -5"),
    (["workload=texts", "workload.path=/src", "workload.window_chars=0"], r"workload.window_chars must be"),
    (["workload=texts", "workload.path=/src", "workload.windows_per_file=0"], r"workload.windows_per_file must be"),
    (["workload=texts", "workload.path=/src", "workload.pattern='../*'"], r"workload.pattern='../\*' must be a glob"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.seed=abc"],
     r"workload.seed must be an integer >= 0, got 'abc'"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.system_prompt=42"],
     r"workload.system_prompt must be a string or null, got 42"),
    (["workload=jsonl", "workload.path=q.jsonl", "workload.template=nope.jinja"],
     r"workload.template='nope.jinja' is none of auto, none, chatml"),
])
def test_every_workload_config_passes_or_fails_the_start_up_check(overrides, message):
    cfg = compose_cfg("compare", ["logger=none", *overrides])
    if message is None:
        compare.check_config(cfg)
    else:
        with pytest.raises(ValueError, match=message):
            compare.check_config(cfg)


def test_load_workload_called_directly_names_a_bad_seed(tmp_path):
    # the start-up check names it, but load_workload on its own raised a bare int() error
    path = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)
    cfg = compose_cfg("compare", ["workload=jsonl", f"workload.path={path}", "workload.seed=abc"])
    with pytest.raises(ValueError, match=r"workload.seed must be an integer >= 0, got 'abc'"):
        load_workload(cfg.workload)


def test_reference_workload_has_code_categories():
    cfg = compose_cfg("compare", [])
    w = load_workload(cfg.workload, prompts=cfg.prompts)
    assert w.categories == ["library", "repetitive", "tests"] and len(w.timed) == 8 and not w.held_out
    assert [i.category for i in w.timed].count("tests") == 2
    assert len(load_workload(cfg.workload, prompts=24).timed) == 24


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


def test_comparison_on_a_chat_workload_reports_by_category(chat_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    questions = write_jsonl(tmp_path / "question.jsonl", SPEC_BENCH + [
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
    cfg = compose_cfg("compare", [f"target={chat_models / 'target'}", "drafters=[medusa]", "logger=none",
                                  "workload=jsonl", f"workload.path={write_jsonl(tmp_path / 'q.jsonl', SPEC_BENCH)}"])
    from treespec import reference

    target, _ = reference.load_model(cfg.target)
    with pytest.raises(ValueError, match=r"drafters: 'medusa' \(available.medusa.source=reference:medusa\) cannot "
                                         r"serve the target .*hidden.size 384.*drafters=\[...\] without medusa.*"
                                         r"train_heads.py target="):
        compare.load_drafters(cfg, target, lambda: None, None)
