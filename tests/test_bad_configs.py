"""Bad settings of the jobs (training, the comparison, the data jobs) fail at start-up with a message naming the
key, the value and what is accepted, before any model loads; a resume refuses other data and says what else
changed; a data job never reports success on nothing. Plus a fuzz over each job's config overrides."""

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec.train.compare import job as compare
from treespec.train.compare.report import rerender
from treespec.train.training import checkpoint
from treespec.train.training import drafter_job as train_heads
from treespec.train.training import lm_job as lm
from treespec.train.training.chat import ChatRenderer
from treespec.train.training.checkpoint import CheckpointMismatch
from treespec.train.training.completions import Completion
from treespec.train.training.regeneration import check_responses, regenerate

from tests.helpers import chat_tokenizer, compose_cfg, conversations, write_jsonl

CHECKS = {"train_lm": lm.check_config, "train_heads": train_heads.check_config, "compare": compare.check_config}


@pytest.mark.parametrize("job, overrides, message", [
    ("train_lm", ["trainer.max_steps=abc"], r"trainer.max_steps must be an integer >= 1 or null, got 'abc'"),
    ("train_lm", ["trainer.max_steps=-5"], r"trainer.max_steps must be an integer >= 1 or null, got -5"),
    ("train_lm", ["trainer.ckpt_every=0"], r"trainer.ckpt_every must be an integer >= 1, got 0"),
    ("train_lm", ["trainer.threads=-1"], r"trainer.threads must be an integer >= 1 or null, got -1"),
    ("train_lm", ["trainer.precision=fp8"], r"trainer.precision must be one of fp32, bf16, got 'fp8'"),
    ("train_lm", ["optim.lr=-1"], r"optim.lr must be a finite number in \(0, inf\), got -1"),
    ("train_lm", ["optim.lr=nan"], r"optim.lr must be a finite number in \(0, inf\), got nan"),
    ("train_lm", ["optim.betas=[0.9]"], r"optim.betas must be two numbers in \[0, 1\)"),
    ("train_lm", ["resume=maybe"], r"resume must be true or false, got 'maybe'"),
    ("train_lm", ["export_dtype=float99"], r"export_dtype must be a floating-point torch dtype"),
    ("train_lm", ["model.hidden_size=abc"], r"model.hidden_size must be an integer >= 1, got 'abc'"),
    ("train_lm", ["data.corpus.max_files=0"], r"data.corpus.max_files must be an integer >= 1 or null"),
    ("train_heads", ["drafter.num_heads=0"], r"drafter.num_heads must be an integer >= 1, got 0"),
    ("train_heads", ["drafter=eagle", "drafter.unroll_steps=-1"], r"drafter.unroll_steps must be an integer >= 0"),
    ("train_heads", ["drafter=eagle", "drafter.variant=eagle9"], r"drafter.variant must be one of treespec, upstream"),
    ("train_heads", ["eval.temperature=-1"], r"eval.temperature must be a finite number in \[0, inf\), got -1"),
    ("train_heads", ["eval.max_new_tokens=0"], r"eval.max_new_tokens must be an integer >= 1, got 0"),
    ("train_heads", ["data.self_distill.prompts=0"], r"data.self_distill.prompts must be an integer >= 1"),
    ("compare", ["cost_sizes=[]"], r"cost_sizes must be a non-empty list of integers, got \[\]"),
    ("compare", ["cost_sizes=[-1,0]"], r"cost_sizes must be two or more different tree sizes >= 1"),
    # one size wrote a curve that cost_at could not extrapolate from (an IndexError)
    ("compare", ["cost_sizes=[4,4]"], r"cost_sizes must be two or more different tree sizes >= 1, got \[4, 4\]"),
    ("train_heads", ["eval.profile.cost_sizes=[1]"], r"eval.profile.cost_sizes must be two or more different tree"),
    ("compare", ["temperature=hot"], r"temperature must be a finite number in \[0, inf\), got 'hot'"),
    ("compare", ["top_p=0"], r"top_p must be a finite number in \(0, 1\], got 0"),
    ("compare", ["device=tpu9"], r"device must be a torch device \(cpu, cuda, cuda:1\), got 'tpu9'"),
])
def test_bad_settings_are_named_at_start_up(job, overrides, message):
    with pytest.raises(ValueError, match=message):
        CHECKS[job](compose_cfg(job, overrides))


@pytest.mark.parametrize("job", ["train_lm", "train_heads"])
def test_a_run_dir_under_a_file_is_named_at_start_up(job, tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match=r"run_dir .*a-file/run: .*a-file is a file, not a folder"):
        CHECKS[job](compose_cfg(job, [f"run_dir={tmp_path / 'a-file' / 'run'}"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine has the device")
def test_cuda_without_cuda_is_named():
    with pytest.raises(ValueError, match=r"device='cuda', but this torch build or machine has no CUDA device"):
        compare.check_config(compose_cfg("compare", ["device=cuda"]))


def test_training_config_is_checked_before_the_target_loads(monkeypatch):
    """eval.* settings were once checked only after the whole training run."""
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr(train_heads, "load_model", no_loading)
    with pytest.raises(ValueError, match=r"eval.temperature"):
        train_heads.run(compose_cfg("train_heads", ["eval.temperature=-1", "logger=none"]))


# -- one run per output ---------------------------------------------------------------------------------------
def test_a_second_run_on_the_same_output_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    import json
    import socket
    import subprocess
    import sys

    from treespec.io import single_run

    lock = tmp_path / "run" / ".treespec.lock"
    with single_run(lock, "run_dir run"):
        with pytest.raises(RuntimeError, match=rf"run_dir run is in use by another run \(pid {os.getpid()} on "):
            with single_run(lock, "run_dir run"):
                pass
    assert not lock.exists()  # released
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    held = {"pid": int(gone.stdout), "host": socket.gethostname()}
    lock.write_text(json.dumps(held))  # a run killed with its lock in place
    with single_run(lock, "run_dir run"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_training_job_refuses_a_run_dir_in_use(tmp_path):
    from treespec.io import single_run

    run_dir = tmp_path / "run"
    cfg = compose_cfg("train_lm", ["debug=tiny_lm", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"])
    with single_run(run_dir / ".treespec.lock", "another run"):
        with pytest.raises(RuntimeError, match=rf"run_dir {run_dir} is in use by another run"):
            lm.run(cfg)
        with pytest.raises(RuntimeError, match=rf"run_dir {run_dir} is in use by another run"):
            compare.run_job(compose_cfg("compare", []), run_dir)


# -- resume ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interrupted_lm(tmp_path_factory):
    """A tiny LM run stopped after 20 steps (checkpoints at 10 and 20): (the overrides to resume it, its run dir)."""
    root = tmp_path_factory.mktemp("lm")
    common = ["debug=tiny_lm", f"run_dir={root / 'run'}", f"data.cache_dir={root / 'cache'}"]
    lm.run(compose_cfg("train_lm", [*common, "trainer.stop_after=20"]))
    return common, root / "run"


def copy_run(interrupted_lm, tmp_path):
    common, run_dir = interrupted_lm
    shutil.copytree(run_dir, tmp_path / "run")
    return [*common, f"run_dir={tmp_path / 'run'}", "resume=true", "trainer.stop_after=1"], tmp_path / "run"


def test_resume_on_other_data_is_refused_naming_the_setting(interrupted_lm, tmp_path):
    """resume=true data.corpus.max_files=5 once resumed at step 20 on a twentieth of the tokens."""
    overrides, _ = copy_run(interrupted_lm, tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"data.corpus.max_files differs \(data.corpus.max_files: saved 12, "
                                                 r"now 5\); resume=true continues that run"):
        lm.run(compose_cfg("train_lm", [*overrides, "data.corpus.max_files=5"]))


def test_resume_announces_a_changed_learning_rate_and_step_count(interrupted_lm, tmp_path, capsys):
    overrides, _ = copy_run(interrupted_lm, tmp_path)
    summary = lm.run(compose_cfg("train_lm", [*overrides, "optim.lr=5e-4", "trainer.max_steps=40"]))
    out = capsys.readouterr().out
    assert "resuming from" in out and summary["steps"] == 21
    assert "resume: optim.lr was 0.0015 in the checkpoint, now 0.0005" in out
    assert "resume: total_steps was 30 in the checkpoint, now 40" in out


def test_an_edited_meta_step_falls_back_to_the_previous_checkpoint(interrupted_lm, tmp_path, capsys):
    """meta.json's step was outside every checksum: editing 20 → 25 resumed at 25 with step-20 tensors."""
    overrides, run_dir = copy_run(interrupted_lm, tmp_path)
    meta = json.loads((run_dir / "ckpt-20" / "meta.json").read_text())
    meta["step"] = 25
    (run_dir / "ckpt-20" / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=r"ckpt-20/meta.json does not match the meta_sha1 .*falling back"):
        lm.run(compose_cfg("train_lm", overrides))
    assert "resuming from" in capsys.readouterr().out and (run_dir / "ckpt-11").is_dir()


def test_a_deleted_newest_checkpoint_is_named_on_fall_back(interrupted_lm, tmp_path, capsys):
    overrides, run_dir = copy_run(interrupted_lm, tmp_path)
    shutil.rmtree(run_dir / "ckpt-20")
    with pytest.warns(UserWarning, match=r"ckpt-20 is listed in .*latest.json but does not exist \(deleted\?\)"):
        lm.run(compose_cfg("train_lm", overrides))
    assert f"resuming from {run_dir / 'ckpt-10'} at step 10" in capsys.readouterr().out


def test_a_checkpoint_that_predates_data_fingerprints_resumes_with_a_warning(tmp_path):
    state = {"w": torch.zeros(2)}
    checkpoint.save_checkpoint(tmp_path, step=3, model=state, optimizer={"state": {}, "param_groups": []},
                               rng={"cpu": torch.get_rng_state()}, fingerprint={"hidden": 8})
    with pytest.warns(UserWarning, match=r"predates treespec recording data in its fingerprint"):
        ckpt = checkpoint.read_checkpoint(tmp_path / "ckpt-3", {"hidden": 8, "data": {"corpus": "x"}})
    assert ckpt["step"] == 3
    with pytest.warns(UserWarning, match="predates"), pytest.raises(CheckpointMismatch, match=r"hidden differs"):
        checkpoint.read_checkpoint(tmp_path / "ckpt-3", {"hidden": 16, "data": {"corpus": "x"}})


# -- the comparison's report= ------------------------------------------------------------------------------------
VANILLA = {"config": "vanilla", "drafter": "none", "tree": "vanilla", "nodes": 0}  # what names a configuration


@pytest.mark.parametrize("contents, message", [
    ([1, 2, 3], r"results.json .* must hold a JSON object, got list"),
    ({}, r"'records' must be a non-empty list of configurations"),
    ({"records": [{**VANILLA, "runs": {"speedup": [1.0, 1.0]}}], "cost_curve": {"1": 0.1},
      "settings": {"prompts": 3, "repeats": 1}, "prompt_of_run": [0, 1]},
     r"settings give 3 prompt runs .* prompt_of_run lists 2"),
    ({"records": [{**VANILLA, "runs": {"speedup": [1.0]}}], "cost_curve": {"1": 0.1},
      "settings": {"prompts": 2, "repeats": 1}, "prompt_of_run": [0, 1]},
     r"configuration 'vanilla' holds 1 prompt runs, prompt_of_run 2"),
])
def test_report_of_a_malformed_results_file_names_it(tmp_path, contents, message):
    (tmp_path / "results.json").write_text(json.dumps(contents))
    with pytest.raises(ValueError, match=message):
        rerender(tmp_path)


# -- data jobs --------------------------------------------------------------------------------------------------
class SilentBackend:
    """A target that ends every response at once: its end-of-text token straight after the assistant header."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def complete(self, prompts, **kwargs):
        return [Completion("", 1) for _ in prompts]


def test_regeneration_of_nothing_but_empty_responses_fails(tmp_path):
    """It once reported success; the failure only showed at training time ("no usable conversation")."""
    tok = chat_tokenizer()
    tok.eos_token = "<|im_end|>"
    source = write_jsonl(tmp_path / "c.jsonl", conversations(3))
    cfg = compose_cfg("train_heads", ["data=chat", f"data.chat.source={source}"])
    counts = regenerate(SilentBackend(tok), cfg.data.chat, tmp_path / "out.jsonl", progress=False)
    assert counts["written"] == 3 and counts["empty_turns"] == counts["turns"] > 0
    with pytest.raises(ValueError, match=r"regeneration failed: all \d+ regenerated assistant turns are empty"):
        check_responses(counts, None)
    check_responses({**counts, "empty_turns": counts["turns"] - 1}, None)  # some answers: a success


def test_chatml_for_a_tokenizer_without_its_tokens_warns():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a byte-level tokenizer of bytes alone (one trained here has the ChatML tokens: tests/train/training/test_train.py)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    with pytest.warns(UserWarning, match=r"chatml, but the tokenizer has no <\|im_start\|>, <\|im_end\|> token"):
        ChatRenderer(plain, "chatml")


# -- fuzz: any override of each job's config ---------------------------------------------------------------------
KEYS = {
    "train_lm": ["trainer.max_steps", "trainer.epochs", "trainer.ckpt_every", "trainer.eval_every", "trainer.threads",
                 "trainer.precision", "trainer.batch_size", "trainer.seq_len", "trainer.grad_accum", "optim.lr",
                 "optim.warmup_steps", "optim.grad_clip", "optim.min_lr_ratio", "resume", "seed", "export_dtype",
                 "model.hidden_size", "model.num_attention_heads", "data.vocab_size", "data.corpus.max_files"],
    "train_heads": ["trainer.max_steps", "trainer.stop_after", "trainer.log_every", "optim.lr", "optim.weight_decay",
                    "drafter.num_heads", "drafter.num_layers", "drafter.loss_decay", "drafter.share_lm_head",
                    "eval.prompts", "eval.prompt_tokens", "eval.max_new_tokens", "eval.temperature", "resume",
                    "data.self_distill.prompts", "data.self_distill.temperature", "trainer.eval_windows"],
    "compare": ["prompts", "repeats", "max_new_tokens", "temperature", "top_p", "max_nodes", "cost_sizes",
                "workload.held_out", "workload.per_category", "threads", "device", "peers", "seed"],
}
VALUES = st.sampled_from(["0", "-1", "1", "3", "2.5", "nan", "inf", "abc", "true", "null", "[]", "[1,2]", "[-1]",
                          "fp8", "bf16", "cuda", "1e-3", "''"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=st.sampled_from(sorted(KEYS)), data=st.data())
def test_fuzz_config_overrides(job, data):
    """Any value for a key the job reads: the start-up check passes, or it raises a ValueError naming the key."""
    key = data.draw(st.sampled_from(KEYS[job]))
    value = data.draw(VALUES)
    try:
        cfg = compose_cfg(job, [f"{key}={value}"])
    except Exception:  # noqa: BLE001 - hydra refuses to compose it (a type its schema forbids): also at the door
        return
    try:
        CHECKS[job](cfg)
    except ValueError as err:
        short = key.split(".")[-1]
        assert short in str(err), (job, key, value, str(err))
