"""Workloads read and selected (train/compare/workload.py, train/compare/selection.py): every prompt format,
datasets folders and parquet files, text folders, bad lines and files named, seeded selection stable as a file
grows, over-long prompts and categories, the start-up check of every workload config. Chat templates, turns and a
whole comparison on a workload: tests/train/compare/test_workload_chat.py."""

import codecs
import gzip
import json

import pytest
from omegaconf import OmegaConf

from treespec.train.compare import job as compare
from treespec.train.compare.selection import select
from treespec.train.compare.workload import Item, load_workload, read_dataset, read_jsonl, read_texts

from tests.helpers import SPEC_BENCH_ROWS, compose_cfg, write_jsonl

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


# -- reading ----------------------------------------------------------------------------------------------
def test_every_jsonl_format_is_read_and_counted(tmp_path):
    rows = SPEC_BENCH_ROWS + OTHER_FORMATS + SPEC_BENCH_ROWS[:1]
    items, skipped, formats = read_jsonl(write_jsonl(tmp_path / "q.jsonl", rows))
    assert formats == {"spec-bench": 4, "openai": 1, "sharegpt": 1, "prompt": 1, "text": 1}
    gz = tmp_path / "q.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "q.jsonl").read_bytes()))
    assert read_jsonl(gz) == (items, skipped, formats)
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
    w = OmegaConf.create({"source": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH_ROWS)),
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
    path = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH_ROWS)
    cfg = compose_cfg("compare", ["workload=jsonl", f"workload.path={path}", "workload.seed=abc"])
    with pytest.raises(ValueError, match=r"workload.seed must be an integer >= 0, got 'abc'"):
        load_workload(cfg.workload)


def test_reference_workload_has_code_categories():
    cfg = compose_cfg("compare", [])
    w = load_workload(cfg.workload, prompts=cfg.prompts)
    assert w.categories == ["library", "repetitive", "tests"] and len(w.timed) == 8 and len(w.held_out) == 24
    assert [i.category for i in w.timed].count("tests") == 2
    assert len(load_workload(cfg.workload, prompts=24).timed) == 24


def test_reference_held_out_prompts_are_later_lines_of_the_timed_files_in_their_category():
    """The accuracies' text is prompts.jsonl's held_out split: each timed file's later lines, never its timed ones,
    in that file's category; the category filter and held_out=0 apply to it as to any workload."""
    cfg = compose_cfg("compare", [])
    w = load_workload(cfg.workload, prompts=24)
    timed = {i.id: i for i in w.timed}
    for item in w.held_out:
        source = item.id.removesuffix(" (later lines)")
        assert source in timed and item.category == timed[source].category
        text, timed_text = item.turns[0], timed[source].turns[0]
        assert text.strip() and text not in timed_text and timed_text not in text
    tests_only = load_workload(OmegaConf.merge(cfg.workload, {"categories": ["tests"], "held_out": 3}), prompts=24)
    assert len(tests_only.held_out) == 3 and {i.category for i in tests_only.held_out} == {"tests"}
    assert not load_workload(OmegaConf.merge(cfg.workload, {"held_out": 0})).held_out
