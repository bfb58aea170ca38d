"""Start-up checks of the training jobs' configs (scripts/train_lm.py, scripts/train_heads.py): every value the
training loop, the optimiser, the drafter's recipe, the data and the end-of-run evaluation read is checked
before any model loads, so a typo is a ValueError naming the key, the value and what is accepted, never an
error deep inside a run (a ZeroDivisionError at the first checkpoint) nor a silent substitute (a precision
typo training in fp32, ``max_steps=-5`` exporting an untrained model, ``resume=maybe`` meaning true).

The comparison's config has its own check (train/compare/job_config.py) built from the same value checks.
"""

from __future__ import annotations

import math
import numbers

import torch
from omegaconf import OmegaConf

from treespec.io import folder_path
from treespec.reference import float_dtype
from treespec.train.training import distributed
from treespec.train.training.data import BYTE_ALPHABET, SPECIAL_TOKENS
from treespec.train.training.loop import PRECISIONS


# -- one value --------------------------------------------------------------------------------------------------
def integer(value, key: str, minimum: int = 1, *, optional: bool = False) -> None:
    """An int >= ``minimum`` (None too when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        null = " or null" if optional else ""
        raise ValueError(f"{key} must be an integer >= {minimum}{null}, got {value!r}")


def number(value, key: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, optional: bool = False) -> None:
    """A finite real number in [low, high] (an end excluded when ``*_open``; None too when ``optional``)."""
    if optional and value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if low is not None or high is not None else ""
        raise ValueError(f"{key} must be a finite number{where}{' or null' if optional else ''}, got {value!r}")


def boolean(value, key: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")


def choice(value, key: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")


def integers(value, key: str, *, optional: bool = False) -> None:
    """A list of ints (None too when ``optional``)."""
    if optional and value is None:
        return
    items = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    if not isinstance(items, (list, tuple)) or not items or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ValueError(f"{key} must be a non-empty list of integers{' or null' if optional else ''}, got {value!r}")


def cost_sizes(value, key: str) -> None:
    """Tree sizes a cost curve is timed at: two different ones at least (a tree's cost is interpolated between them;
    one size once wrote a curve cost_at could not read), each >= 1."""
    integers(value, key)
    if min(value) < 1 or len(set(value)) < 2:
        raise ValueError(f"{key} must be two or more different tree sizes >= 1, got {list(value)}")


def device(name) -> None:
    """``device``: a torch device this build and machine have (cuda needs a CUDA build and a GPU)."""
    try:
        parsed = torch.device(str(name))
    except RuntimeError:
        raise ValueError(f"device must be a torch device (cpu, cuda, cuda:1), got {name!r}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but this torch build or machine has no CUDA device: use device=cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r}: the comparison runs on cpu or cuda")


# -- a training job's sections ----------------------------------------------------------------------------------
def check_trainer(t) -> None:
    """conf/trainer/default.yaml: the loop's keys (the distributed ones: distributed.check_trainer)."""
    distributed.check_trainer(t)
    integer(t.get("max_steps"), "trainer.max_steps", optional=True)
    number(t.get("epochs", 1.0), "trainer.epochs", 0, low_open=True)
    integer(t.get("stop_after"), "trainer.stop_after", optional=True)
    for key in ("eval_every", "ckpt_every", "log_every"):
        integer(t.get(key), f"trainer.{key}")
    integer(t.get("eval_windows"), "trainer.eval_windows", optional=True)
    integer(t.get("threads"), "trainer.threads", optional=True)
    choice(t.get("precision", "fp32"), "trainer.precision", PRECISIONS)
    for key in ("compile", "progress"):
        boolean(t.get(key, False), f"trainer.{key}")


def check_optim(o) -> None:
    """conf/optim/*.yaml: train/training/loop.py's OptimConfig."""
    number(o.get("lr"), "optim.lr", 0, low_open=True)
    number(o.get("min_lr_ratio", 0.1), "optim.min_lr_ratio", 0, 1)
    integer(o.get("warmup_steps", 0), "optim.warmup_steps", 0)
    number(o.get("weight_decay", 0.0), "optim.weight_decay", 0)
    number(o.get("grad_clip", 1.0), "optim.grad_clip", 0, low_open=True)
    betas = o.get("betas", (0.9, 0.95))
    if not (len(betas) == 2 and all(not isinstance(b, bool) and isinstance(b, numbers.Real) and 0 <= b < 1
                                    for b in betas)):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {betas!r}")


def check_data(data) -> None:
    """The corpus and self-distillation settings (conf/data/)."""
    corpus = data.get("corpus")
    if corpus is not None:
        integer(corpus.get("max_files"), "data.corpus.max_files", optional=True)
        number(corpus.get("val_fraction", 0.02), "data.corpus.val_fraction", 0, 1, high_open=True)
    integer(data.get("vocab_size", 8192), "data.vocab_size", BYTE_ALPHABET + len(SPECIAL_TOKENS))  # byte-level BPE
    distill = data.get("self_distill")
    if distill is not None:
        for key in ("prompts", "prompt_tokens", "new_tokens", "batch_size"):
            integer(distill.get(key), f"data.self_distill.{key}")
        number(distill.get("temperature"), "data.self_distill.temperature", 0)


def check_job(cfg) -> None:
    """What every training job shares: trainer, optim, data, seed and resume."""
    check_trainer(cfg.trainer)
    check_optim(cfg.optim)
    check_data(cfg.data)
    integer(cfg.get("seed", 0), "seed", 0)
    boolean(cfg.get("resume", False), "resume")
    if cfg.get("run_dir"):
        folder_path(cfg.run_dir, "run_dir")


def check_export_dtype(value) -> None:
    try:
        float_dtype(value)
    except ValueError:
        raise ValueError(f"export_dtype must be a floating-point torch dtype (float32, bfloat16, float16), got "
                         f"{value!r}") from None


def check_model(model) -> None:
    """conf/model/*.yaml: a language model's architecture values."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings"):
        integer(model.get(key), f"model.{key}")
    integer(model.get("num_key_value_heads"), "model.num_key_value_heads", optional=True)
    if model.hidden_size % model.num_attention_heads:
        raise ValueError(f"model.hidden_size={model.hidden_size} must be a multiple of model.num_attention_heads="
                         f"{model.num_attention_heads}")


# the drafter keys the recipes read (conf/drafter/{medusa,hydra,eagle,eagle3,dflash}.yaml), each checked where present
DRAFTER_INTEGERS = {"num_heads": 1, "num_layers": 1, "unroll_steps": 0, "accuracy_depth": 1, "topk_distill": 0,
                    "heads_warmup_steps": 0}
DRAFTER_WEIGHTS = ("loss_decay", "unroll_decay", "noise_std", "feature_weight", "token_weight",
                   "topk_weight", "heads_weight", "distill_weight", "lm_weight", "backbone_lr_scale",
                   "lk_eta")  # numbers >= 0
DRAFTER_SWITCHES = ("share_lm_head", "fusion", "lean", "prefix_attention", "distill", "on_policy")


def check_drafter(d) -> None:
    for key, minimum in DRAFTER_INTEGERS.items():
        if key in d:
            integer(d[key], f"drafter.{key}", minimum)
    for key in DRAFTER_WEIGHTS:
        if key in d:
            number(d[key], f"drafter.{key}", 0)
    for key in DRAFTER_SWITCHES:
        if key in d:
            boolean(d[key], f"drafter.{key}")
    if d.get("on_policy") and d.get("loss", "kl") != "kl":
        raise ValueError(f"drafter.on_policy weights the kl loss; drafter.loss={d.get('loss')!r} has its own weighting "
                         "(set drafter.loss=kl or drafter.on_policy=false)")
    if "draft_vocab_size" in d:
        integer(d.draft_vocab_size, "drafter.draft_vocab_size", optional=True)
    for key in ("feature_layers", "aux_layers"):
        if key in d:
            integers(d[key], f"drafter.{key}", optional=True)


def check_eval(e) -> None:
    """train_heads' end-of-run decoding evaluation (conf/train_heads.yaml's eval)."""
    for key in ("prompts", "prompt_tokens", "max_new_tokens"):
        integer(e.get(key), f"eval.{key}")
    number(e.get("temperature"), "eval.temperature", 0)
    profile = e.get("profile") or {}
    cost_sizes(profile.get("cost_sizes", [1, 2]), "eval.profile.cost_sizes")
    for key in ("engine_rounds", "chain_windows"):
        integer(profile.get(key, 1), f"eval.profile.{key}")
