"""Every primary config composes with every experiment and debug config meant for its job, and with every
drafter and tree choice it documents, and passes the start-up check its job runs before loading models."""

from pathlib import Path

import pytest

from treespec.heads import registry
from treespec.train.compare import job as compare
from treespec.train.training import drafter_job as train_heads
from treespec.train.training import lm_job as lm

from tests.helpers import CONF, compose_cfg

CHECKS = {"train_lm": lm.check_config, "train_heads": train_heads.check_config, "compare": compare.check_config}
# experiment / debug configs by the job they are written for (file name prefix)
JOB_OF = {"compare": "compare", "reference": "train_heads", "tiny_lm": "train_lm", "tiny_heads": "train_heads",
          "specbench": "compare"}
# overrides an experiment cannot run without (the file it measures; the start-up check only needs it named)
NEEDS = {"specbench": ["workload.path=question.jsonl"]}


def group(name: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF) / name).glob("*.yaml"))


def job_of(config: str) -> str:
    return next(job for prefix, job in JOB_OF.items() if config.startswith(prefix))


CASES = [(job, []) for job in CHECKS]
CASES += [(job_of(e), [f"experiment={e}", *NEEDS.get(e, [])]) for e in group("experiment")]
CASES += [(job_of(d), [f"debug={d}"]) for d in group("debug")]
TRAINABLE = [name for k in registry.KINDS if k.trainable for name in (k.name, *k.recipes)]  # medusa2: a recipe
CASES += [("train_heads", [f"drafter={d}"]) for d in TRAINABLE]
CASES += [(job, [f"tree={t}"]) for job in ("train_heads", "compare") for t in group("tree")]
# every drafter the comparison offers (medusa2 is a training recipe: its heads pair with their own fine-tuned target)
AVAILABLE = sorted(compose_cfg("compare", []).available)
CASES += [("compare", [f"drafters=[{d}]"]) for d in AVAILABLE if d != "upstream"]
CASES += [("compare", ["drafters=[upstream]", "available.upstream.source=/some/checkpoint"])]


@pytest.mark.parametrize("job, overrides", CASES, ids=[f"{j}-{'-'.join(o) or 'default'}" for j, o in CASES])
def test_config_composes_and_passes_the_start_up_check(job, overrides):
    CHECKS[job](compose_cfg(job, overrides))


def test_every_config_is_covered():
    covered = {o[0].split("=")[1] for _, o in CASES if o and o[0].split("=")[0] in ("experiment", "debug")}
    assert covered == set(group("experiment")) | set(group("debug"))
    # every conf/drafter/ file is an entry of the comparison's `available` (same name) or a training recipe
    assert set(group("drafter")) == set(AVAILABLE) | set(TRAINABLE)


@pytest.mark.parametrize("job, overrides, message", [
    ("train_heads", ["tree=accuracy", "+tree.depth=3"], r"unknown key\(s\) depth"),
    ("train_heads", ["export_to=[vllm,tgi]"], r"export_to: unknown format\(s\) tgi"),
    ("compare", ["drafters=[eagle,warp]"], r"'warp' is not one of the available drafters"),
    ("compare", ["prompts=0"], r"prompts must be an integer >= 1"),
    ("compare", ["prompts=1000"], r"only \d+ held-out prompts are shipped"),
    ("compare", ["repeats=0"], r"repeats must be an integer >= 1"),
    ("compare", ["available.medusa.candidates=sample", "drafters=[medusa]"], r"takes candidates in"),
    ("train_lm", ["trainer.seq_len=4096"], r"exceeds model.max_position_embeddings"),
    ("compare", ["drafters=[upstream]"], r"'upstream' needs its checkpoint: available.upstream.source="),
    ("compare", ["drafters=[prompt_lookup]", "+available.prompt_lookup.draft_vocab=64"], r"no full-vocabulary head"),
    # a combination's parts: other entries, fixed ranks, each checked as it is alone; its settings
    ("compare", ["drafters=[combined]", "available.combined.parts=[suffix]"], r"parts must list two or more"),
    ("compare", ["drafters=[combined]", "available.combined.parts=[suffix,warp]"], r"'warp' is not one of the avail"),
    ("compare", ["drafters=[combined]", "available.combined.parts=[suffix,eagle_sample]"], r"samples its candidates"),
    ("compare", ["drafters=[combined]", "available.combined.parts=[suffix,combined]"], r"combined drafter itself"),
    ("compare", ["drafters=[combined]", "available.combined.parts=[suffix,upstream]"], r"'upstream' needs its checkp"),
    ("compare", ["drafters=[combined]", "available.combined.mode=best"], r"mode must be one of"),
    ("compare", ["drafters=[combined]", "available.combined.nodes=0"], r"nodes must be an integer >= 1"),
])
def test_bad_configs_fail_at_start_up(job, overrides, message):
    with pytest.raises(ValueError, match=message):
        CHECKS[job](compose_cfg(job, overrides))


def test_untrainable_drafter_is_refused_when_composed():
    """Each trainable drafter has its optimiser settings in conf/optim/<name>.yaml; others fail to compose."""
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="optim/prompt_lookup"):
        compose_cfg("train_heads", ["drafter=prompt_lookup"])


def test_another_targets_default_drafters_are_the_model_free_ones_and_the_given_sources():
    """drafters=null on a target other than the reference: the kinds without weights that read nothing (Lookahead
    included), then every entry given a source (REST once given its corpus)."""
    from treespec.train.compare.job_config import drafter_labels

    cfg = compose_cfg("compare", ["target=/models/mine", "available.eagle3.source=/ckpt/e3"])
    assert drafter_labels(cfg) == ["prompt_lookup", "recycling", "suffix", "lookahead", "eagle3"]
    cfg = compose_cfg("compare", ["target=/models/mine", "available.rest.source=/data/corpus"])
    assert drafter_labels(cfg) == ["prompt_lookup", "recycling", "suffix", "lookahead", "rest"]
