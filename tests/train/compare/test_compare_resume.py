"""A killed comparison keeps every finished (prompt run, configuration) and resume=true continues from them
(train/compare/journal.py): the resumed run's counts equal an uninterrupted run's, each run is measured once, a
torn last line is measured again, other damage and other settings are refused by name. Also what a user watching
it sees: the progress line and the threads default."""

import json
import math

import pytest
import torch

from treespec.heads import DraftModel, PromptLookup
from treespec.heads.draft_model.drafter import rank_accuracy
from treespec.planning.bench import Config, Measured, measure
from treespec.train.compare import harness
from treespec.train.compare import progress as progress_module
from treespec.train.compare.configurations import DrafterSpec
from treespec.train.compare.harness import run_comparison
from treespec.train.compare.job import journal_config, run_job
from treespec.train.compare.journal import JOURNAL, Journal, precheck
from treespec.train.compare.progress import Progress, default_threads
from treespec.train.compare.report import write_outputs
from treespec.train.compare.results_file import save_result
from treespec.tree import Tree

from tests.helpers import compose_cfg, perturbed, run_killed, tiny_llama

RUNS_PER_PROMPT_RUN = 5  # vanilla + draft × (chain 1, chain 2) + prompt lookup × (chain 1, chain 2)
PEERS_PER_PROMPT_RUN = 6  # vanilla, each drafter's best, transformers greedy, assisted, prompt lookup
PROMPT_RUNS = 4  # 2 prompts × 2 repeats


class Killed(Exception):
    pass


def compare(out_dir, *, kill_at: int | None = None, resume: bool = False, temperature: float = 1.0,
            seen: list | None = None, trees: list[dict] | None = None, own_trees: dict | None = None, **options):
    """A tiny sampled comparison: two drafters × three trees (accuracy 1 is the draft's chain γ=1, measured once),
    two prompts with two budgets, two repeats, the peers. ``kill_at``: raise after that run is journaled;
    ``seen`` keeps the log; ``trees``, ``own_trees`` ({drafter: its own trees}) and ``options`` (run_comparison's)
    replace the defaults."""
    target = tiny_llama(seed=0)
    draft = perturbed(target, 0.05)
    windows = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    own_trees = own_trees or {}
    drafters = [DrafterSpec("draft", DraftModel(draft), rank_accuracy(target, draft, windows, depth=2, top_k=2),
                            trees=own_trees.get("draft")),
                DrafterSpec("prompt_lookup", PromptLookup(), trees=own_trees.get("prompt_lookup"))]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def log(text):
        if seen is not None:
            seen.append(text)
        if kill_at is not None and text.strip().startswith(f"[{kill_at}/"):
            raise Killed

    trees = trees or [{"kind": "chain", "depth": [1, 2]}, {"kind": "accuracy", "nodes": 1}]
    return run_comparison(target, drafters, trees, prompts, max_new_tokens=[6, 4], repeats=2,
                          temperature=temperature, cost_sizes=(1, 2, 4, 8), assistant=draft, out_dir=out_dir, log=log,
                          resume=resume, **options)


def journal_lines(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / JOURNAL).read_text().splitlines()]


def assert_same_counts(resumed: dict, whole: dict) -> None:
    """Everything but timing: configurations, prompt runs, τ, tokens, passes, every accept length."""
    assert resumed["complete"] and whole["complete"]
    assert resumed["prompt_of_run"] == whole["prompt_of_run"]
    assert [r["config"] for r in resumed["records"]] == [r["config"] for r in whole["records"]]
    for a, b in zip(resumed["records"], whole["records"], strict=True):
        for key in ("tau", "new_tokens", "target_passes", "nodes", "tree_spec"):
            assert a.get(key) == b.get(key), (a["config"], key)
        assert a["runs"]["accept_lengths"] == b["runs"]["accept_lengths"], a["config"]
    # the peers' pass runs each drafter's fastest configuration: which one is timing, the rest is not
    assert [p["name"] for p in resumed["peers"]] == [p["name"] for p in whole["peers"]]
    assert sorted(name.split(" | ")[0] for name in resumed["peer_pass"]) == ["draft", "prompt_lookup", "vanilla"]


@pytest.fixture(autouse=True, scope="module")
def no_figures():
    """The report's figures take most of a tiny comparison's time and are tested in
    tests/train/compare/test_report_figures.py: here the report is only written as results.json (the measurement's
    own record)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "write_outputs", lambda result, out_dir, logger: save_result(result, out_dir))
        yield


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return compare(out), out


def test_a_comparison_killed_twice_resumes_to_the_same_counts(whole, tmp_path):
    whole, whole_dir = whole
    # one configuration's tree is another's: measured once, reported under both names
    alias = next(r for r in whole["records"] if r["config"] == "draft | accuracy 1")
    assert alias["same_tree_as"] == "draft | chain γ=1" and alias["tree_spec"] == Tree.chain(1).to_spec()
    assert alias["runs"] == next(r for r in whole["records"] if r["config"] == "draft | chain γ=1")["runs"]
    main = PROMPT_RUNS * RUNS_PER_PROMPT_RUN
    total = main + PROMPT_RUNS * PEERS_PER_PROMPT_RUN
    assert sum(line["kind"] == "run" for line in journal_lines(whole_dir)) == total

    with pytest.raises(Killed):  # the 7th run: the second prompt run's second configuration
        compare(tmp_path, kill_at=7)
    first = journal_lines(tmp_path)
    assert sum(line["kind"] == "run" for line in first) == 7
    # a kill while appending: half of a line, no newline
    torn = (whole_dir / JOURNAL).read_text().splitlines()[8]
    with open(tmp_path / JOURNAL, "a") as f:
        f.write(torn[: len(torn) // 2])
    seen = []
    with pytest.raises(Killed):  # again, among the peers
        compare(tmp_path, resume=True, kill_at=main + 8, seen=seen)
    assert any("cut off by the kill" in line for line in seen) and any("7 runs kept" in line for line in seen)
    partial = json.loads((tmp_path / "results.json").read_text())
    assert partial["prompts_done"] == PROMPT_RUNS and not partial["complete"]  # the main pass is whole
    seen = []
    resumed = compare(tmp_path, resume=True, seen=seen)
    assert_same_counts(resumed, whole)
    progress = [line for line in seen if line.startswith("  [")]  # counting on from the runs kept
    assert progress[0].startswith(f"  [{main + 9}/{total}]") and progress[-1].startswith(f"  [{total}/{total}]")
    assert resumed["sessions"] == 3 and json.loads((tmp_path / "results.json").read_text())["complete"]
    lines = journal_lines(tmp_path)
    runs = [(line["pass"], line["run"], line["config"]) for line in lines if line["kind"] == "run"]
    assert len(runs) == len(set(runs)) == total and [line["kind"] for line in lines].count("resume") == 2
    # the first process's runs are kept unchanged, each paired with its own prompt run's vanilla
    assert lines[:8] == first and all(line["measured"]["vanilla_tokens_per_s"] is None for line in lines[1:8])
    assert lines[8]["kind"] == "resume"
    # the second prompt run (run 1): vanilla and one configuration kept, the rest paired with a new vanilla
    later = [line["measured"] for line in lines[9:] if line["kind"] == "run" and line["run"] == 1
             and line["pass"] == "main"]
    assert len(later) == RUNS_PER_PROMPT_RUN - 2 and all(m["vanilla_tokens_per_s"] > 0 for m in later)
    assert any("resume=true run_dir=" in line for line in seen)


# experiment=specbench's shape: greedy, each drafter its own trees or the run's, transformers' assisted generation
# measured in the main pass beside every configuration (baselines), no peers' pass
SPECBENCH = {"temperature": 0.0, "peers": False, "baselines": ["assisted"], "trees": [{"kind": "chain", "depth": 2}],
             "own_trees": {"draft": [{"kind": "chain", "depth": 1}, {"kind": "accuracy", "nodes": 1}]}}
SPECBENCH_RUNS = 4  # vanilla, draft | chain γ=1 (accuracy 1 its alias), prompt_lookup | chain γ=2, assisted


def test_a_specbench_run_with_baselines_resumes_to_the_same_counts(tmp_path):
    whole = compare(tmp_path / "whole", **SPECBENCH)
    names = ["vanilla", "draft | chain γ=1", "draft | accuracy 1", "prompt_lookup | chain γ=2"]
    assert [r["config"] for r in whole["records"]] == names  # the draft's own trees, the run's for prompt lookup
    assert whole["records"][2]["same_tree_as"] == "draft | chain γ=1"  # measured once, reported under both
    assert [p["name"] for p in whole["peers"]] == ["transformers assisted"] and set(whole["peer_pass"]) == set(names)
    total = PROMPT_RUNS * SPECBENCH_RUNS
    assert sum(line["kind"] == "run" for line in journal_lines(tmp_path / "whole")) == total

    out = tmp_path / "killed"
    with pytest.raises(Killed):  # the second prompt run's draft: its prompt lookup and assisted runs are left
        compare(out, kill_at=6, **SPECBENCH)
    with pytest.raises(Killed):  # then the third prompt run's prompt lookup, before its assisted run
        compare(out, resume=True, kill_at=11, **SPECBENCH)
    kept = [line for line in journal_lines(out) if line["kind"] == "run"]
    assert len(kept) == 11 and [line["run"] for line in kept if line["config"] == "transformers assisted"] == [0, 1]
    with pytest.raises(ValueError, match=r"drafter_trees\.draft.*set these back"):  # other trees of its own
        compare(out, resume=True, **{**SPECBENCH, "own_trees": {"draft": [{"kind": "chain", "depth": 2}]}})
    resumed = compare(out, resume=True, **SPECBENCH)
    assert resumed["complete"] and resumed["sessions"] == 3
    assert resumed["prompt_of_run"] == whole["prompt_of_run"]
    assert [r["config"] for r in resumed["records"]] == names
    for a, b in zip(resumed["records"], whole["records"], strict=True):
        for key in ("tau", "new_tokens", "target_passes", "tree_spec"):
            assert a.get(key) == b.get(key), (a["config"], key)
        for key in ("accept_lengths", "new_tokens"):  # each run's, restored or measured (Spec-Bench's table)
            assert a["runs"][key] == b["runs"][key], (a["config"], key)
        assert len(a["runs"]["new_tokens"]) == PROMPT_RUNS and sum(a["runs"]["new_tokens"]) == a["new_tokens"]
    # assisted generation: a peer in the report, its runs (restored ones too) with their accept lengths
    (peer,), (whole_peer,) = resumed["peers"], whole["peers"]
    assert peer["name"] == "transformers assisted" and set(resumed["peer_pass"]) == set(names)
    for key in ("accept_lengths", "new_tokens"):
        assert peer["runs"][key] == whole_peer["runs"][key], key
    assert [sum(n) for n in peer["runs"]["accept_lengths"]] == peer["runs"]["new_tokens"]
    assert resumed["peer_pass"]["vanilla"]["new_tokens"] == whole["peer_pass"]["vanilla"]["new_tokens"]
    assert resumed["best"] in names[1:] and resumed["peers"][0]["treespec_best_over_this"] > 0


def test_a_resume_refuses_other_settings_and_damage(tmp_path):
    with pytest.raises(Killed):
        compare(tmp_path, kill_at=3)
    with pytest.raises(ValueError, match="already holds a comparison's measurements.*resume=true continues it"):
        compare(tmp_path)
    with pytest.raises(ValueError, match=r"temperature: measured with 1.0, now 0.5.*set these back"):
        compare(tmp_path, resume=True, temperature=0.5)
    lines = (tmp_path / JOURNAL).read_text().splitlines(keepends=True)
    edited = lines[2].replace('"new_tokens":', '"new_tokens":1')  # an edit the line's sha1 catches
    (tmp_path / JOURNAL).write_text("".join(lines[:2] + [edited] + lines[3:]))
    with pytest.raises(ValueError, match=rf"{JOURNAL} line 3 is corrupt.*runs follow it"):
        compare(tmp_path, resume=True)


def test_the_journal_drops_only_a_torn_last_line(tmp_path):
    journal = Journal(tmp_path)
    journal.start({"a": 1}, {"setup": True})
    one = Measured(new_tokens=4, wall_time=0.5, accept_lengths=[2, 2], target_passes=2)
    journal.record("main", 0, 0, "vanilla", one)
    journal.record("main", 1, 0, "x", one)
    with open(journal.path, "a") as f:
        f.write('{"kind":"run","pass":"main","run":2')
    again = Journal(tmp_path).read()
    assert again.dropped == 1 and set(again.runs) == {("main", 0, "vanilla"), ("main", 1, "x")}
    assert again.runs[("main", 1, "x")][1] == one
    again.record("main", 2, 1, "vanilla", one)  # appends after the last whole line
    assert len(Journal(tmp_path).read().runs) == 3 and Journal(tmp_path).read().dropped == 0
    with pytest.raises(ValueError, match="run 1 of the main pass .x. was prompt 0, this run measures 1 there"):
        again.restored("main", [0, 1, 1])
    with pytest.raises(ValueError, match=r"a: measured with 1, now 2"):
        again.check({"a": 2})


def test_a_job_with_another_config_is_refused_before_any_model_loads(tmp_path):
    base = ["logger=none", f"run_dir={tmp_path}", "drafters=[prompt_lookup]"]
    cfg = compose_cfg("compare", base)
    Journal(tmp_path).start({"config": journal_config(cfg)}, {})
    # what only changes how it runs, logs and reports may differ; the measured settings may not
    precheck(tmp_path, journal_config(compose_cfg("compare", [*base, "threads=1", "bootstrap.samples=500"])), True)
    with pytest.raises(ValueError, match=r"config\.max_new_tokens: measured with 32, now 8"):
        run_job(compose_cfg("compare", [*base, "max_new_tokens=8", "resume=true", "target=/nonexistent"]))
    with pytest.raises(ValueError, match="resume=true continues it"):
        precheck(tmp_path, journal_config(cfg), False)


def test_a_resumed_prompt_pairs_new_runs_with_a_new_vanilla():
    """Ratios are taken within one process: restored runs keep their vanilla, new ones get this process's."""
    target = tiny_llama(seed=0)
    prompts = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))]
    configs = [Config("a", PromptLookup(), Tree.chain(1)), Config("b", PromptLookup(), Tree.chain(2))]
    slow_vanilla = Measured(new_tokens=4, wall_time=100.0, accept_lengths=[1] * 4, target_passes=4)
    kept = Measured(new_tokens=4, wall_time=50.0, accept_lengths=[2, 2], target_passes=2)
    new = {}
    rows = measure(target, configs, prompts, max_new_tokens=4, warmup=False,
                   done={(0, "vanilla"): slow_vanilla, (0, "a"): kept},
                   on_run=lambda i, name, m: new.setdefault(name, m))
    assert set(new) == {"b"}  # the rerun vanilla is not journaled again: it only pairs b
    rows = {r.name: r for r in rows}
    assert rows["vanilla"].prompt_tokens_per_s == [slow_vanilla.tokens_per_s]
    assert rows["a"].prompt_speedups == [kept.tokens_per_s / slow_vanilla.tokens_per_s] == [2.0]
    b = new["b"]
    assert b.vanilla_tokens_per_s > 100 * slow_vanilla.tokens_per_s  # a real vanilla run, not the restored one
    assert rows["b"].prompt_speedups == [b.tokens_per_s / b.vanilla_tokens_per_s]


def test_progress_says_what_is_left():
    lines, now = [], iter([5.0, 7.0, 8.0])  # the first run's time holds the warm-up: not extrapolated
    p = Progress(total=10, runs=5, done=3, log=lines.append, clock=lambda: next(now))
    p("eagle | chain γ=2", 3)
    p("vanilla", 4)
    p("eagle | chain γ=4", 4)
    assert lines == ["  [4/10] eagle | chain γ=2 · prompt run 4/5 · time left: from the next run on",
                     "  [5/10] vanilla · prompt run 5/5 · about 10 s left",
                     "  [6/10] eagle | chain γ=4 · prompt run 5/5 · about 6 s left"]
    assert progress_module.duration(3725) == "1 h 02 min" and progress_module.duration(190) == "3 min 10 s"


def test_a_phase_before_the_runs_counts_down():
    lines, now = [], iter([0.0, 4.0, 6.0, 30.0])
    c = progress_module.Countdown("greedy answers", 3, log=lines.append, clock=lambda: next(now))
    c("81: 6 tokens")
    c()
    c("82 turn 2: skipped")
    assert lines == ["  greedy answers [1/3] · 81: 6 tokens · about 8 s left",
                     "  greedy answers [2/3] · about 3 s left", "  greedy answers [3/3] · 82 turn 2: skipped · done"]


def test_threads_default_to_the_idle_cores(monkeypatch):
    busy = progress_module.busy_cores(2, 0.05)  # /proc/stat on Linux: the share of the cores busy just now
    assert busy is None or 0.0 <= busy <= 2.0
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(progress_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for now, threads in ((0.3, 2), (1.2, 1), (2.6, 1)):
        monkeypatch.setattr(progress_module, "busy_cores", lambda cores, now=now: now)
        chosen, line = default_threads("cpu")
        assert chosen == threads and f"{now:.1f} busy now" in line and "threads=N" in line
    monkeypatch.setattr(progress_module, "busy_cores", lambda cores: None)  # no /proc/stat: the load average
    for load, threads in ((0.3, 2), (1.2, 1), (2.6, 1)):
        monkeypatch.setattr(progress_module.os, "getloadavg", lambda load=load: (load, load, load))
        chosen, line = default_threads("cpu")
        assert chosen == threads and f"{load:.1f} load average" in line and "threads=N" in line
    assert default_threads("cuda")[0] is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads("cpu") == (None, "threads: OMP_NUM_THREADS=1 (threads=N sets them)")


@pytest.mark.slow
def test_the_compare_job_killed_with_sigkill_resumes_to_an_uninterrupted_runs_counts(tmp_path, monkeypatch):
    """The real job on the reference models, killed with SIGKILL at its middle durable write, then resumed."""
    common = ["logger=none", "drafters=[draft,prompt_lookup]", "prompts=2", "max_new_tokens=12", "workload.held_out=2",
              "cost_sizes=[1,2,4,8]", "max_nodes=8", "temperature=1.0",
              "trees=[{kind: chain, depth: [1, 2]}, {kind: accuracy, nodes: 3}]"]
    fsyncs = [0]
    real = __import__("os").fsync

    def counting(fd):
        fsyncs[0] += 1
        real(fd)

    monkeypatch.setattr(harness, "write_outputs", write_outputs)  # the job reads the results.md it writes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("os.fsync", counting)
        whole = run_job(compose_cfg("compare", [*common, f"run_dir={tmp_path / 'whole'}"]))["result"]
    killed = tmp_path / "killed"
    assert run_killed("treespec.train.compare.job:run_job", [*common, f"run_dir={killed}"], fsyncs[0] // 2,
                      config="compare") == -9
    kept = sum(line["kind"] == "run" for line in journal_lines(killed))
    assert 0 < kept < sum(line["kind"] == "run" for line in journal_lines(tmp_path / "whole"))
    resumed = run_job(compose_cfg("compare", [*common, f"run_dir={killed}", "resume=true"]))["result"]
    assert_same_counts(resumed, whole)
    assert resumed["sessions"] == 2 and not math.isnan(resumed["records"][1]["speedup"])
