"""experiment=specbench: Spec-Bench's questions measured the way Spec-Bench measures them (train/compare/specbench.py).

Every test writes its own tiny file in Spec-Bench's question.jsonl format; the real file is never part of the
repository (TREESPEC_SPEC_BENCH=<path> runs the one test that reads it).
"""

import csv
import json
import math
import os
import random

import pytest
import torch

from treespec.train.compare import job as compare
from treespec.train.compare.estimates import analyse
from treespec.train.compare.peers import hf_peer
from treespec.train.compare.selection import counts_of
from treespec.train.compare.specbench import COLUMN_OF, COLUMNS, MT_BENCH, table
from treespec.train.compare.workload import load_workload

from tests.helpers import WORDS, chat_tokenizer, compose_cfg, perturbed, tiny_chat_target, tiny_llama, write_jsonl

SINGLE = ("translation", "summarization", "qa", "math_reasoning", "rag")


def questions(per_category: int = 2, seed: int = 0) -> list[dict]:
    """Rows in Spec-Bench's format: MT-bench's eight categories with two turns, the other five with one."""
    rng = random.Random(seed)
    say = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6))) + "?"  # noqa: E731
    rows, qid = [], 80
    for category in (*MT_BENCH, *SINGLE):
        for _ in range(per_category):
            qid += 1
            turns = [say(), say()] if category in MT_BENCH else [say()]
            rows.append({"question_id": qid, "category": category, "turns": turns})
    return rows


# -- transformers' methods: their accept lengths ------------------------------------------------------------------
def test_transformers_methods_report_the_tokens_each_target_call_committed():
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)  # close to the target: the assistant's candidates are often accepted
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    handle = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        greedy = hf_peer(target, "greedy")(prompt, 20, 0.0, 1.0, torch.Generator().manual_seed(0))
        n_greedy = len(calls)
        assisted = hf_peer(target, "assisted", draft)(prompt, 20, 0.0, 1.0, torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    # plain decoding: one token per target call, the prefill's included
    assert greedy.new_tokens == 20 and greedy.accept_lengths == [1] * 20 and n_greedy == 20
    # assisted generation: one length per target call, summing to the tokens generated, some calls accepting more
    assert len(assisted.accept_lengths) == len(calls) - n_greedy
    assert sum(assisted.accept_lengths) == assisted.new_tokens == 20 and max(assisted.accept_lengths) > 1
    assert torch.equal(assisted.sequences, greedy.sequences)  # greedy: the same tokens, so speedup is a time ratio


# -- the table, from records ----------------------------------------------------------------------------------------
def synthetic_result(seed: int = 0) -> dict:
    """results.json's contents for two prompts per Spec-Bench category (both turns of MT-bench questions),
    vanilla, two configurations of one drafter, one of another and transformers' assisted generation in a pass
    of its own: random tokens and tokens/s per run, so every expected number is computed, never written down."""
    rng = random.Random(seed)
    info = []
    for category in (*MT_BENCH, *SINGLE):
        for q in range(2 if category not in MT_BENCH else 1):
            for turn in (1, 2) if category in MT_BENCH else (1,):
                info.append({"id": f"{category}{q}" + (f"/turn {turn}" if turn > 1 else ""), "category": category,
                             "turn": turn, "prompt_tokens": 20, "max_new_tokens": 32, "answer_tokens": 32})
    n = len(info)
    tokens = [rng.randint(8, 32) for _ in range(n)]  # greedy: every method generates these
    vanilla_tps = [rng.uniform(20, 40) for _ in range(n)]

    def lengths_for(total: int, tau: float) -> list[int]:
        out, left = [], total - 1  # treespec: the prefill commits the first token
        while left > 0:
            out.append(min(left, max(1, round(rng.gauss(tau, 0.7)))))
            left -= out[-1]
        return out

    def record(config: str, drafter: str, tree: str, faster: float, tau: float) -> dict:
        tps = [v * faster * rng.uniform(0.7, 1.3) for v in vanilla_tps]
        lengths = [lengths_for(t, tau) for t in tokens] if drafter != "none" else [[1] * (t - 1) for t in tokens]
        return {"config": config, "drafter": drafter, "tree": tree, "nodes": 4, "depth": 2, "predicted_tau": None,
                "predicted_speedup": None, "tokens_per_s": sorted(tps)[n // 2], "speedup": faster, "tau": tau,
                "target_passes": sum(map(len, lengths)), "new_tokens": sum(tokens),
                "runs": {"tokens_per_s": tps, "speedup": [a / b for a, b in zip(tps, vanilla_tps, strict=True)],
                         "accept_lengths": lengths, "new_tokens": tokens}}

    vanilla = record("vanilla", "none", "vanilla", 1.0, 1.0)
    vanilla["runs"]["tokens_per_s"] = vanilla_tps
    records = [vanilla, record("eagle | chain γ=2", "eagle", "chain γ=2", 1.2, 2.0),
               record("eagle | auto", "eagle", "auto", 1.6, 2.6), record("prompt_lookup | chain γ=4", "prompt_lookup",
                                                                         "chain γ=4", 1.1, 1.5)]
    peer_vanilla = [v * rng.uniform(0.8, 1.2) for v in vanilla_tps]
    peer_tps = [v * rng.uniform(1.0, 1.5) for v in peer_vanilla]
    peer_lengths = [[2] * (t // 2) + [1] * (t % 2) for t in tokens]  # every target call, the prefill's included
    return {"format": 3, "complete": True, "prompts_done": n, "prompt_info": info, "prompt_of_run": list(range(n)),
            "settings": {"prompts": n, "repeats": 1, "max_new_tokens": 32, "temperature": 0.0,
                         "bootstrap": {"samples": 200, "level": 0.95, "seed": 0}},
            "records": records, "best": "eagle | auto", "skipped": [],
            "peer_pass": {"vanilla": {"tokens_per_s": peer_vanilla, "speedup": [1.0] * n, "new_tokens": tokens}},
            "peers": [{"name": "transformers assisted", "tokens_per_s": 1.0, "speedup_vs_vanilla": 1.0,
                       "runs": {"tokens_per_s": peer_tps, "speedup": [a / b for a, b in zip(peer_tps, peer_vanilla,
                                                                                              strict=True)],
                                "new_tokens": tokens, "accept_lengths": peer_lengths}}]}


def spec_bench_speedup(tokens, method_tps, vanilla_tps, keep) -> float:
    """Spec-Bench's speed script: total tokens ÷ total seconds of the method ÷ the same of vanilla."""
    sel = [i for i in range(len(tokens)) if keep(i)]
    method = sum(tokens[i] for i in sel) / sum(tokens[i] / method_tps[i] for i in sel)
    base = sum(tokens[i] for i in sel) / sum(tokens[i] / vanilla_tps[i] for i in sel)
    return method / base


def test_spec_bench_table_is_computed_from_the_runs_per_column_and_mt_bench_category():
    result = synthetic_result()
    t = table(result, analyse(result))
    cats = [p["category"] for p in result["prompt_info"]]
    tokens = result["records"][0]["runs"]["new_tokens"]
    vanilla = result["records"][0]["runs"]["tokens_per_s"]
    # each drafter's row is its configuration with the highest overall speedup, then transformers' methods
    assert [r["config"] for r in t["rows"]] == ["eagle | auto", "prompt_lookup | chain γ=4", "transformers assisted"]
    by_config = {r["config"]: r for r in result["records"]}
    for row in t["rows"][:2]:
        runs = by_config[row["config"]]["runs"]
        for column in COLUMNS:
            expected = spec_bench_speedup(tokens, runs["tokens_per_s"], vanilla,
                                          lambda i, c=column: COLUMN_OF[cats[i]] == c)
            assert row["columns"][column].value == pytest.approx(expected)
        assert row["overall"].value == pytest.approx(spec_bench_speedup(tokens, runs["tokens_per_s"], vanilla,
                                                                        lambda i: True))
        assert row["overall"].lo <= row["overall"].value <= row["overall"].hi
        lengths = [n for run in runs["accept_lengths"] for n in run]
        assert row["mean_accepted"] == pytest.approx(sum(lengths) / len(lengths))
        # MT-bench's categories: both turns of each question count
        for category in MT_BENCH:
            both = spec_bench_speedup(tokens, runs["tokens_per_s"], vanilla, lambda i, c=category: cats[i] == c)
            first = spec_bench_speedup(tokens, runs["tokens_per_s"], vanilla, lambda i, c=category: cats[i] == c and
                                       result["prompt_info"][i]["turn"] == 1)
            assert row["mt_bench"][category].value == pytest.approx(both) and both != pytest.approx(first)
    # transformers' assisted generation against its own pass's vanilla runs
    peer = result["peers"][0]["runs"]
    assisted = t["rows"][2]
    assert assisted["overall"].value == pytest.approx(spec_bench_speedup(
        tokens, peer["tokens_per_s"], result["peer_pass"]["vanilla"]["tokens_per_s"], lambda i: True))
    assert assisted["mean_accepted"] == pytest.approx(sum(tokens) / sum(map(len, peer["accept_lengths"])))
    assert t["prompts"] == {c: sum(COLUMN_OF[x] == c for x in cats) for c in COLUMNS}
    assert t["prompts"]["Multi-turn Conversation"] == 16  # 8 questions × 2 turns


def test_a_run_on_other_prompts_has_no_spec_bench_table():
    result = synthetic_result()
    result["prompt_info"][0]["category"] = "library"
    assert table(result, analyse(result)) is None


# -- selection and the experiment's configuration ------------------------------------------------------------------
def test_per_category_may_name_categories_with_a_default_for_the_rest(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", questions(per_category=3))
    cfg = compose_cfg("compare", ["experiment=specbench", f"workload.path={path}", "workload.held_out=0"])
    timed = load_workload(cfg.workload).timed
    counts = {c: sum(i.category == c for i in timed) for c in (*MT_BENCH, *SINGLE)}
    assert counts == {**dict.fromkeys(MT_BENCH, 1), **dict.fromkeys(SINGLE, 3)}  # default 4 > the 3 there are
    assert all(len(i.turns) == 2 for i in timed if i.category in MT_BENCH)
    # a category filter keeps the named counts of the categories left (the others' names are no typo)
    cfg = compose_cfg("compare", ["experiment=specbench", f"workload.path={path}", "workload.held_out=0",
                                  "workload.categories=[qa,writing]"])
    assert sorted(i.category for i in load_workload(cfg.workload).timed) == ["qa"] * 3 + ["writing"]
    names = list(counts)
    assert counts_of({"default": 2, "qa": None}, names)["qa"] is None and counts_of(5, names)["rag"] == 5
    with pytest.raises(ValueError, match=r"workload.per_category: \['poetry'\] not found"):
        counts_of({"poetry": 1}, names)
    with pytest.raises(ValueError, match=r"workload.per_category: qa=0 must be an integer >= 1 or null"):
        counts_of({"qa": 0}, names)


@pytest.mark.parametrize("turns, where", [
    ([1, 2], r"line 2: turn 1 is 1 \(int\), not a string"),
    (["q1", 3], r"line 2: turn 2 is 3 \(int\), not a string"),
    ([["a", "b"]], r"line 2: turn 1 is \['a', 'b'\] \(list\), not a string"),
])
def test_a_question_whose_turns_are_not_strings_is_named_by_line_and_turn(tmp_path, turns, where):
    # such rows were refused as "no usable prompt" with only a count of them
    path = tmp_path / "question.jsonl"
    path.write_text("\n" + json.dumps({"question_id": 81, "category": "writing", "turns": turns}) + "\n")
    cfg = compose_cfg("compare", ["experiment=specbench", f"workload.path={path}", "workload.held_out=0"])
    with pytest.raises(ValueError, match=r"question.jsonl: no usable prompt \(\{'turns not a list of strings': 1\}; "
                                         r"turns not a list of strings: first at " + where):
        load_workload(cfg.workload)


@pytest.mark.parametrize("overrides, message", [
    (["baselines=[assisted]", "peers=true"], r"baselines=\['assisted'\] .*set peers=false"),
    (["baselines=[speculative]"], r"baselines: \['speculative'\] not one of greedy, assisted, prompt_lookup"),
    (["available.prompt_lookup.trees=[]"], r"available.prompt_lookup.trees must be a non-empty list"),
    (["available.prompt_lookup.trees=[{kind: full, width: 0, depth: 2}]"], r"bad tree spec \{'kind': 'full'"),
    (["workload.per_category={qa: 0}"], r"workload.per_category.qa must be an integer >= 1 or null"),
])
def test_bad_specbench_settings_are_named(overrides, message):
    cfg = compose_cfg("compare", ["experiment=specbench", "workload.path=question.jsonl", *overrides])
    with pytest.raises(ValueError, match=message):
        compare.check_config(cfg)


# -- the whole run on a tiny chat target -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny chat target and a draft model sharing its tokenizer, saved as model folders."""
    from treespec import reference

    root = tmp_path_factory.mktemp("specbench_models")
    tiny_chat_target(root / "target")
    target, _ = reference.load_model(root / "target")
    perturbed(target, 0.05).save_pretrained(root / "draft")
    chat_tokenizer(root / "draft")
    return root


def test_experiment_specbench_end_to_end_on_a_tiny_chat_target(chat_pair, tmp_path, monkeypatch, capsys,
                                                                no_report_figures):
    monkeypatch.chdir(tmp_path)
    path = write_jsonl(tmp_path / "question.jsonl", questions(per_category=2))
    cfg = compose_cfg("compare", [
        "experiment=specbench", f"workload.path={path}", f"target={chat_pair / 'target'}",
        f"available.draft.source={chat_pair / 'draft'}", f"assistant={chat_pair / 'draft'}",
        "available.medusa.source=reference:no_such_drafter",  # not in this checkout: left out with a message
        "drafters=[prompt_lookup,draft,medusa]", "workload.per_category=1", "max_new_tokens=6",
        "workload.held_out_tokens=8", "cost_sizes=[1,2,4]", "logger=none", f"paths.data={tmp_path / 'cache'}"])
    result = compare.run_from_config(cfg, tmp_path / "run")
    assert "drafter medusa left out: reference:no_such_drafter is not shipped" in capsys.readouterr().out
    assert result["stamp"]["unshipped"] == {"medusa": "reference:no_such_drafter"}
    # one configuration per method: prompt lookup's own chain, the draft model's auto tree; assisted generation
    # measured in the same pass as a peer, with its accept lengths
    assert [r["config"] for r in result["records"]] == ["vanilla", "prompt_lookup | chain γ=4", "draft | auto"]
    assert [p["name"] for p in result["peers"]] == ["transformers assisted"]
    assert set(result["peer_pass"]) == {"vanilla", "prompt_lookup | chain γ=4", "draft | auto"}
    assisted = result["peers"][0]["runs"]
    assert [sum(x) for x in assisted["accept_lengths"]] == assisted["new_tokens"]
    # each MT-bench question's two turns, in order; the other categories one turn each
    info = result["prompt_info"]
    assert sorted((p["category"], p["turn"]) for p in info) == sorted(
        [(c, t) for c in MT_BENCH for t in (1, 2)] + [(c, 1) for c in SINGLE])
    # greedy and lossless: every configuration generated vanilla's tokens, so the speedup is a ratio of times
    runs = {r["config"]: r["runs"] for r in result["records"]}
    assert runs["draft | auto"]["new_tokens"] == runs["vanilla"]["new_tokens"]
    md = (tmp_path / "run" / "results.md").read_text()
    assert ("| method | Multi-turn Conversation | Translation | Summarization | QA | Math | RAG | "
            "#Mean Accepted Tokens | Overall (95% CI) |") in md
    assert "| method | writing | roleplay | reasoning | math | coding | extraction | stem | humanities | " \
           "#Mean Accepted Tokens |" in md
    assert "drafters left out" in md and "nan" not in md.lower()
    # specbench.csv: the numbers, recomputed here from results.json's runs
    rows = list(csv.DictReader(open(tmp_path / "run" / "specbench.csv")))
    cats = [info[p]["category"] for p in result["prompt_of_run"]]
    tokens, vanilla = runs["vanilla"]["new_tokens"], runs["vanilla"]["tokens_per_s"]
    for row in rows:
        if row["method"] == "transformers assisted":
            method, base = assisted["tokens_per_s"], result["peer_pass"]["vanilla"]["tokens_per_s"]
        else:
            method, base = runs[row["config"]]["tokens_per_s"], vanilla
        keep = (lambda i: True) if row["column"] == "Overall" else (
            (lambda i, c=row["column"]: COLUMN_OF[cats[i]] == c) if row["column"] in COLUMNS else
            (lambda i, c=row["column"]: cats[i] == c))
        assert float(row["speedup"]) == pytest.approx(spec_bench_speedup(tokens, method, base, keep)), row
    assert {r["method"] for r in rows} == {"prompt_lookup", "draft", "transformers assisted"}
    assert {r["column"] for r in rows} == {*COLUMNS, *MT_BENCH, "Overall"}
    overall = {r["method"]: float(r["mean_accepted"]) for r in rows if r["column"] == "Overall"}
    lengths = [n for run in runs["draft | auto"]["accept_lengths"] for n in run]
    assert overall["draft"] == pytest.approx(sum(lengths) / len(lengths)) and not math.isnan(overall["draft"])
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["complete"] is True


@pytest.mark.skipif(not os.environ.get("TREESPEC_SPEC_BENCH"), reason="TREESPEC_SPEC_BENCH (Spec-Bench's "
                    "question.jsonl, from hemingkx/Spec-Bench data/spec_bench/question.jsonl) not set")
def test_the_real_question_file_gives_the_documented_default_budget():
    cfg = compose_cfg("compare", ["experiment=specbench", f"workload.path={os.environ['TREESPEC_SPEC_BENCH']}"])
    w = load_workload(cfg.workload)
    assert sorted(w.categories) == sorted(COLUMN_OF)  # 13: MT-bench's eight and the other five
    counts = {c: sum(i.category == c for i in w.timed) for c in COLUMN_OF}
    assert counts == {**dict.fromkeys(MT_BENCH, 1), **dict.fromkeys(SINGLE, 4)}
    assert sum(len(i.turns) for i in w.timed) == 36 and len(w.held_out) == 13  # conf/experiment/specbench.yaml
    assert not {i.key for i in w.held_out} & {i.key for i in w.timed}
    full = load_workload(compose_cfg("compare", ["experiment=specbench", f"workload.path={w.source[7:]}",
                                                 "workload.per_category=null"]).workload)
    assert len(full.timed) + len(full.held_out) == 480
