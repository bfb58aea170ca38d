"""The comparison job: "which tree should I use here?", on your target, your drafters and your workload
(scripts/compare_trees.py, conf/compare.yaml, conf/workload/; docs/workloads.md).

``run_from_config`` checks the whole config before loading anything, then: loads the target; reads and
selects the workload (train/compare/workload.py) and turns it into prompt ids (train/compare/templates.py: chat
template, end tokens, later turns holding the target's own earlier answers); loads the drafters, each with its
accuracies measured on the target's own continuations of the workload's held-out part (never the timed
prompts) and FR-Spec's ranking from the same text (or a corpus the config names); keeps the assistant peer
only when it shares the target's vocabulary; then train/compare/harness.py measures and train/compare/report.py reports.

With a target other than the shipped reference one the defaults adapt: ``drafters: null`` is prompt lookup
plus every available entry given a ``source`` (the shipped heads fit the reference target only), and the
assistant peer is skipped, with a note in the stamp, when its vocabulary differs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from treespec import linear_kernels, reference
from treespec.drafter import SAMPLED_CANDIDATES
from treespec.heads import registry
from treespec.heads.drafting.vocab import DraftVocab
from treespec.inputs import max_positions
from treespec.io import single_run
from treespec.planning.chain_tau import measure_chain_tau
from treespec.planning.drafting_cost import CALIBRATION_TOKENS, NO_DRAFTING, measure_drafting_cost
from treespec.sampling import Sampling
from treespec.train.compare.configurations import DrafterSpec
from treespec.train.compare.dry_runs import measure_dry_runs, prompts_of
from treespec.train.compare.entries import VOCAB_FILE, drafter_checksum, entry_record, made, max_depth_of
from treespec.train.compare.harness import run_comparison
from treespec.train.compare.job_config import (
    acceptance_rules,
    bootstrap_settings,
    check_config,
    drafter_labels,
    tree_specs_of,
)
from treespec.train.compare.journal import precheck
from treespec.train.compare.methods import baselines_of, own_trees, shipped, unshipped, wants_assistant
from treespec.train.compare.progress import set_threads
from treespec.train.compare.report import rerender
from treespec.train.compare.side_by_side import compare_runs
from treespec.train.compare.stamp import collect as collect_stamp
from treespec.train.compare.templates import (
    HeldOutText,
    PromptTemplate,
    continuation_windows,
    fitted,
    timed_prompts,
    token_counts,
)
from treespec.train.compare.workload import load_workload
from treespec.train.training.data import STDLIB_CORPUS, prepare_tokens
from treespec.train.training.distributed import LOCK_FILE
from treespec.train.training.log import RunLogger

CHAIN_DEPTH = 8  # the deepest sampled chain whose τ is measured per rule (tree=auto chooses γ = 0..this)


def rank_accuracy_on(kind, target, module, held: HeldOutText, sampling: Sampling) -> list[list[float]]:
    """acc[d][r] on the held-out text: one [n, S] tensor, or windows of different lengths ([1, S_i] each), whose
    tables are pooled weighted by the positions each contributes at each depth. Each window's lead (its prompt)
    is context only: roots are scored from the continuation on, where decoding drafts (as the chain τ is)."""
    pairs = held.pairs()
    if not pairs:
        raise ValueError("no held-out window to measure accuracies on")
    tables = [(kind.rank_accuracy(target, module, w, sampling=sampling, first_root=lead), w.shape[1] - lead)
              for w, lead in pairs]
    if tables[0][0] is None:  # a drafter without fixed ranks to score (prompt lookup)
        return None
    if len(tables) == 1:
        return tables[0][0]
    out = []
    for d, row in enumerate(tables[0][0]):
        weights = [max(1, n - 1 - d) for _, n in tables]  # roots that reach depth d in each window
        pooled = [sum(t[d][r] * wt for (t, _), wt in zip(tables, weights, strict=True)) / sum(weights)
                  for r in range(len(row))]
        total = sum(pooled)  # ranks are exclusive: a sum above 1 is float32 rounding in the tables
        out.append([x / total for x in pooled] if total > 1 else pooled)
    return out


def calibration_prompts(held: HeldOutText, positions: int | None = None, count: int = 2) -> list[torch.Tensor]:
    """What drafting is timed on in the loop (treespec/planning/drafting_cost.py): the first ``count`` held-out
    prompts, decoded as a timed prompt is (the target writes the continuation the accuracies were measured on, so
    the drafter accepts as it will; a whole window could leave no room in a small target's positions). A drafter is
    timed only when it is predicted, which needs the held-out text its accuracies or chain τ came from. A prompt too
    long for the target's ``positions`` keeps its last tokens (``fitted``)."""
    return [fitted(p, CALIBRATION_TOKENS, positions, "calibration prompt", lambda _: None)
            for p in prompts_of(held, count)]


def rules_of(cfg) -> list[str]:
    rules = acceptance_rules(cfg)
    return [rules] if isinstance(rules, str) else rules


def load_drafters(cfg, target, windows, sampling: Sampling, vocab_of=lambda spec, label: None, log=print
                  ) -> list[DrafterSpec]:
    """Each drafter the run names, from the registry, with its accuracies at this run's sampling and its
    drafting costs (for predictions). Accuracies are measured at the run's sampling on ``windows()``: the
    target's own continuations of the workload's held-out part, what verification will see; the accuracies
    shipped beside a drafter were measured on human-written text and underestimate τ.
    ``vocab_of(entry.draft_vocab, label)`` gives the drafter's FR-Spec vocabulary (None: its full head). A predicted
    drafter's drafting is timed in the loop on the first held-out prompts (``calibration_prompts``); a drafter with
    neither accuracies nor chain τ (the model-free kinds) is measured by a dry run instead, decoding the held-out
    prompts as timed prompts are decoded (train/compare/dry_runs.py): τ per tree and its drafting, in one decoding."""
    specs = []
    missing = unshipped(cfg, drafter_labels(cfg))
    for label, source in missing.items():
        log(f"drafter {label} left out: {source} is not shipped in this checkout yet (skip_unshipped=true)")
    for label in (label for label in drafter_labels(cfg) if label not in missing):
        entry = cfg.available[label]
        kind = registry.get(entry.name)
        candidates = entry.get("candidates", "topk")
        module, drafter, draft_vocab = made(cfg, label, target, vocab_of)
        accuracy = None
        # predictions assume top-k ranks of the full head (a reduced one's accuracies were never measured); a
        # combination's nodes are no ranks of one head
        if candidates == "topk" and draft_vocab is None and not kind.has_parts and windows() is not None:
            accuracy = rank_accuracy_on(kind, target, module, windows(), sampling)  # None: no fixed ranks to score
        chain = None
        if candidates in SAMPLED_CANDIDATES and not sampling.greedy and windows() is not None:
            # sampled candidates: each rule's τ in closed form on chains drafted by the drafter itself
            depth = min(CHAIN_DEPTH, kind.max_depth(module) or CHAIN_DEPTH)
            chain = measure_chain_tau(target, drafter, windows().windows, depth=depth, sampling=sampling,
                                      lead=windows().leads,
                                      generator=torch.Generator().manual_seed(0))
            log(f"predicted τ of {label}'s sampled chains γ = 0..{depth} ({chain.drafts} drafts): " + "; ".join(
                f"{rule} " + " ".join(f"{t:.2f}" for t in chain.tau[rule]) for rule in chain.tau))
        # as it drafts (lean or not, reduced vocabulary or not), in the decoding loop: only for a drafter whose
        # configurations are predicted (the others' predictions do not exist to use it)
        cost, measured = NO_DRAFTING, None
        if accuracy is not None or chain is not None:  # both came from windows(): they exist
            cost = measure_drafting_cost(target, drafter, calibration_prompts(windows(), max_positions(target.config)))
        elif candidates == "topk" and windows() is not None:  # nothing else predicts it: τ per tree from a dry run
            measured, cost = measure_dry_runs(target, label, drafter, prompts_of(windows()),
                                              own_trees(cfg, label) or tree_specs_of(cfg), rules_of(cfg), sampling,
                                              int(cfg.max_new_tokens), log)
        if cost is not NO_DRAFTING:
            fixed, per_depth, per_node = cost.on()  # in seconds of this moment's pass: the setup puts them on its curve
            log(f"drafting cost of {label}, in the loop: {1e3 * fixed:.2f} ms per step + {1e3 * per_depth:.2f} ms per "
                f"depth + {1e3 * per_node:.3f} ms per node")
        step = functools.partial(kind.drafting_step, drafter) if kind.has_weights else None
        specs.append(DrafterSpec(label, drafter, accuracy, drafting_cost=cost,
                                 max_depth=max_depth_of(cfg, label, module), checksum=drafter_checksum(entry, module),
                                 drafting_step=step, entry=entry_record(cfg, label, module), chain_tau=chain,
                                 trees=own_trees(cfg, label), measured=measured))
    return specs


def assistant_peer(cfg, tokenizer, device, log=print):
    """(the assistant model or None, the stamp's record): transformers' assisted generation needs the
    assistant to share the target's vocabulary, so another one is skipped with a note."""
    source = cfg.get("assistant")
    if not source or not wants_assistant(cfg):
        return None, {"source": source, "used": False, "reason": "not asked for" if not source else "peers=false"}
    if cfg.get("skip_unshipped") and not shipped(source):
        reason = f"{source} is not shipped in this checkout yet (skip_unshipped=true)"
        log(f"assisted generation skipped: {reason}")
        return None, {"source": str(source), "used": False, "reason": reason}
    try:
        same = AutoTokenizer.from_pretrained(reference.resolve(source)).get_vocab() == tokenizer.get_vocab()
    except (OSError, ValueError, FileNotFoundError) as err:
        raise ValueError(f"assistant={source}: {err} (assistant=null skips the assisted-generation peer)") from None
    if not same:
        reason = f"its vocabulary differs from the target's ({source} is not a draft model for {cfg.target})"
        log(f"assisted-generation peer skipped: {reason}")
        return None, {"source": str(source), "used": False, "reason": reason}
    return (reference.load_model(source, linear_kernel=cfg.get("linear_kernel", linear_kernels.DEFAULT))[0].to(device),
            {"source": str(source), "used": True})


def workload_prompts(cfg, target, tokenizer, log=print):
    """(timed prompts, the workload, its template, a ``windows()`` that makes the held-out windows once, the
    held-out note for the report)."""
    w = cfg.workload
    template = PromptTemplate(tokenizer, w.get("template", "auto"), w.get("system_prompt"),
                              extra_end_ids=[target.generation_config.eos_token_id])
    workload = load_workload(w, prompts=cfg.prompts, length=template.first_turn_tokens, cache_dir=cfg.paths.data)
    budgets = {str(k): int(v) for k, v in (w.get("max_new_tokens") or {}).items()}
    prompts = timed_prompts(target, template, workload.timed, lambda c: budgets.get(c, cfg.max_new_tokens),
                            max_prompt_tokens=w.get("max_prompt_tokens"), skipped=workload.skipped,
                            cut_to_fit=w.source == "reference", log=log)
    seed = int(cfg.get("seed") or 0)
    device = target.device
    # accuracies at the positions decoding verifies: acceptance rises along a generation (the target's own text
    # grows more predictable), so continuations longer than the answers over-predict τ (docs/results.md)
    new_tokens = int(w.get("held_out_tokens") or max(p.max_new_tokens for p in prompts))

    @functools.cache
    def windows():  # made once, only if a drafter needs them
        if not workload.held_out:
            log("no held-out prompt (workload.held_out=0, or every category has one prompt): no accuracies, so no "
                "accuracy or auto trees and no predictions")
            return None
        made = continuation_windows(target, template, workload.held_out, new_tokens=new_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p, seed=seed,
                                    max_prompt_tokens=w.get("max_prompt_tokens"), cut_to_fit=w.source == "reference",
                                    log=log)
        return made.to(device) if made.windows else None

    what = "later lines of the timed prompts' files" if w.source == "reference" else "this workload"
    note = (f"the target's own continuations of {len(workload.held_out)} held-out prompts of {what} "
            f"({', '.join(sorted({i.category for i in workload.held_out})) or 'none'}), disjoint from the timed "
            "prompts")
    return prompts, workload, template, windows, note


def frequency_counts(cfg, tokenizer, windows) -> torch.Tensor:
    """[V] token counts FR-Spec ranks by: the held-out continuations (``workload.frequency_corpus: null``), or a
    corpus: ``stdlib`` or a folder / .jsonl of {"text"} (its training split)."""
    corpus = cfg.workload.get("frequency_corpus")
    if corpus is None:
        held = windows()
        if held is None:
            raise ValueError("FR-Spec's ranking needs held-out text: set workload.held_out >= 1 or "
                             "workload.frequency_corpus=<stdlib, a folder or a .jsonl of {\"text\"}>")
        return token_counts(held, len(tokenizer))
    spec = STDLIB_CORPUS if corpus == "stdlib" else {"source": str(corpus), "pattern": "*", "val_fraction": 0.02,
                                                     "max_files": None}
    _, train_tokens, _ = prepare_tokens(spec, len(tokenizer), cfg.paths.data, tokenizer=tokenizer)
    return torch.bincount(train_tokens.long(), minlength=len(tokenizer))


# settings a resumed comparison may change: how it runs (threads), logs and reports (intervals), where it writes,
# and the batch-size pass (measured again whole on a resume); the drafters it does not run are left out too
RESUMABLE = ("threads", "resume", "run_dir", "paths", "logger", "bootstrap", "report", "compare", "batch_sizes",
             "batches", "batch_cost_sizes")


def journal_config(cfg) -> dict:
    """The job's config as a resume must find it (train/compare/journal.py): resolved, less ``RESUMABLE``."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    used = set(drafter_labels(cfg))
    resolved["available"] = {k: v for k, v in resolved.get("available", {}).items() if k in used}
    return {k: v for k, v in resolved.items() if k not in RESUMABLE}


def run_from_config(cfg, out_dir, command: str | None = None) -> dict:
    """The scripts/compare_trees.py job: load target, workload and drafters named in ``cfg``, compare, write
    outputs."""
    check_config(cfg)
    resume = bool(cfg.get("resume", False))
    precheck(out_dir, journal_config(cfg), resume)  # refused before any model loads
    set_threads(cfg.threads, cfg.get("device") or "cpu")
    tree_specs = tree_specs_of(cfg)
    target, tokenizer = reference.load_model(cfg.target, linear_kernel=cfg.get("linear_kernel", linear_kernels.DEFAULT))
    device = torch.device(cfg.get("device") or "cpu")
    target = target.to(device)  # drafters load onto the target's device (heads/registry.py)
    assistant, assistant_note = assistant_peer(cfg, tokenizer, device)
    prompts, workload, template, windows, held_out_note = workload_prompts(cfg, target, tokenizer)
    counts = functools.cache(lambda: frequency_counts(cfg, tokenizer, windows))

    def vocab_of(spec, label: str) -> DraftVocab | None:
        """``draft_vocab`` of drafter entry ``label``: N (the N most frequent tokens, module docstring), a saved
        vocabulary's path, or null (the full head); a copy is kept in the run (``VOCAB_FILE``: results.md's code
        line loads it)."""
        if spec is None:
            return None
        vocab = DraftVocab.most_frequent(counts(), spec) if isinstance(spec, int) else DraftVocab.load(spec)
        vocab.save(Path(out_dir) / VOCAB_FILE.format(label=label))
        return vocab

    drafters = load_drafters(cfg, target, windows, Sampling(cfg.temperature, cfg.top_p), vocab_of)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    w = cfg.workload
    workload_record = {
        "source": workload.source, "selected_sha1": workload.digest(), "categories": workload.categories,
        "timed_items": len(workload.timed), "timed_prompts": len(prompts), "held_out_items": len(workload.held_out),
        "held_out": held_out_note, "skipped": dict(workload.skipped), "formats": dict(workload.formats),
        **template.describe(),
        "selection": {k: OmegaConf.to_container(w, resolve=True).get(k) for k in
                      ("per_category", "categories", "held_out", "max_prompt_tokens", "seed", "max_new_tokens")}
        | {"prompts": cfg.prompts}}
    stamp = collect_stamp(
        target=target, target_source=str(cfg.target), target_folder=reference.resolve(cfg.target),
        drafters={d.name: d.checksum for d in drafters}, prompts=[p.ids for p in prompts], command=command,
        config=resolved, prompt_set=f"{workload.source}: {len(prompts)} prompts in {len(workload.categories)} "
        f"categories ({', '.join(workload.categories)})", seed=int(cfg.get("seed") or 0), workload=workload_record,
        assistant=assistant_note)
    stamp["unshipped"] = unshipped(cfg, drafter_labels(cfg))
    logger = RunLogger(out_dir, use_wandb=cfg.logger.use_wandb, project=cfg.logger.project, name="compare-trees",
                       resume=resume,
                       config={**resolved, "stamp": {k: v for k, v in stamp.items() if k != "config"}})
    result = run_comparison(target, drafters, tree_specs, [p.ids for p in prompts],
                            max_new_tokens=[p.max_new_tokens for p in prompts], temperature=cfg.temperature,
                            top_p=cfg.top_p, repeats=cfg.repeats, cost_sizes=tuple(cfg.cost_sizes),
                            max_nodes=cfg.max_nodes, peers=cfg.peers, assistant=assistant, out_dir=out_dir,
                            logger=logger, seed=int(cfg.get("seed") or 0), bootstrap=bootstrap_settings(cfg),
                            acceptance=acceptance_rules(cfg), baselines=baselines_of(cfg, assistant),
                            stamp=stamp, eos_token_id=template.end_ids or None,
                            prompt_info=[p.describe() for p in prompts], held_out=held_out_note,
                            batch_sizes=cfg.get("batch_sizes"), batches=cfg.get("batches", 3),
                            batch_cost_sizes=tuple(cfg.get("batch_cost_sizes") or (1, 2, 4, 8, 16, 32)),
                            resume=resume, journal_config=journal_config(cfg), compile=bool(cfg.get("compile")))
    logger.finish()
    return result


def run_job(cfg, out_dir=None, command: str | None = None) -> dict:
    """scripts/compare_trees.py: ``report=PATH`` re-renders a run's outputs from its results.json (nothing is
    measured), ``compare=[A,B,...]`` writes ``comparison.md`` (runs side by side) into ``out_dir``, else a
    comparison is measured. ``out_dir``: the run's folder (default ``cfg.run_dir``). Returns {"mode", "outputs"
    (files written), "markdown" (what to print), ...}."""
    out_dir = cfg.run_dir if out_dir is None else out_dir
    if cfg.get("report") and cfg.get("compare"):
        raise ValueError("give report=PATH or compare=[A,B], not both")
    if cfg.get("report"):
        folder = rerender(cfg.report)
        return {"mode": "report", "outputs": folder, "markdown": (folder / "results.md").read_text()}
    if cfg.get("compare"):
        paths = cfg.compare
        paths = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [str(p) for p in paths]
        text = compare_runs(paths)
        path = Path(out_dir) / "comparison.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return {"mode": "compare", "outputs": path, "markdown": text}
    with single_run(Path(out_dir) / LOCK_FILE, f"run_dir {out_dir}"):  # two runs never interleave their results
        result = run_from_config(cfg, out_dir, command)
    return {"mode": "measure", "outputs": Path(out_dir), "best": result["best"], "result": result,
            "markdown": (Path(out_dir) / "results.md").read_text()}
