"""treespec's EAGLE-3 training step checked against SpecForge's, step for step (docs/specforge_check.md; the
command line: scripts/specforge_check.py; tests/train/checks/test_specforge.py runs ``check``).

Same weights, same batch, same number of TTT steps on both sides: the shipped reference target, a random
EAGLE-3 head, windows of held-out stdlib tokens, a draft vocabulary of the most frequent of them. treespec
computes its training loss (``eagle3_loss``), per-step KL, top-1 and parameter gradients here; the head goes out
in SpecForge's checkpoint layout (``export(to="sglang")``: ``LlamaForCausalLMEagle3``, what SpecForge's trainer
warm-starts from) with the target states it consumes, and ``specforge_worker.py`` beside this module (started by
path, it imports nothing from treespec) runs SpecForge's own offline training step on them under SpecForge's
Python (``--specforge-python`` or env TREESPEC_SPECFORGE_PYTHON; its venv pins transformers 5.8.1).

A TTT length L counts forward passes as SpecForge's ``ttt_length`` does (the published 7 = depths 1-7);
treespec's ``unroll_steps`` counts the passes after the first, so it runs with ``unroll_steps = L - 1``. The two
differ by design in two conventions (normalisation, loss mask), both compared: scripts/specforge_check.py's
docstring and docs/specforge_check.md say how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from treespec.heads.checkpoints.export import export

# treespec's EAGLE-3 training code, where it lives today: the one place to update when it moves.
from treespec.heads.eagle3.objective import (
    Eagle3Model,
    RestrictedTarget,
    build_vocab_map,
    eagle3_loss,
    token_counts,
)
from treespec.heads.training.batches import shifted_mask
from treespec.heads.training.target_states import target_hidden, target_states
from treespec.reference import load, path, prompts

ENV = "TREESPEC_SPECFORGE_PYTHON"
WORKER = Path(__file__).resolve().with_name("specforge_worker.py")  # run by path under SpecForge's Python
GROUPS = {"fc": ("fc.",), "attention": ("midlayer.self_attn.",), "mlp": ("midlayer.mlp.",),
          "layer norms": ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm"),
          "final norm": ("norm.",), "lm_head": ("lm_head.",)}


def specforge_python(explicit: str | None = None) -> str | None:
    """The SpecForge venv's python: ``explicit``, else env TREESPEC_SPECFORGE_PYTHON (no default: where that venv
    lives is the machine's business); None when neither is set, or that file does not exist or has no
    ``specforge`` package to import."""
    candidate = explicit or os.environ.get(ENV)
    if not candidate or not Path(candidate).is_file():
        return None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('specforge') is None)"
    found = subprocess.run([candidate, "-c", probe], capture_output=True, timeout=60)
    return candidate if found.returncode == 0 else None


# -- the shared inputs ---------------------------------------------------------------------------------------
def stdlib_windows(tokenizer, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``batch`` consecutive windows [batch, seq_len] of the held-out stdlib prompts, all their tokens [N])."""
    tokens = torch.tensor([t for text in prompts() for t in tokenizer(text)["input_ids"]], dtype=torch.long)
    if tokens.numel() < batch * seq_len:
        raise ValueError(f"the held-out prompts hold {tokens.numel()} tokens, fewer than {batch} x {seq_len}")
    return tokens[: batch * seq_len].view(batch, seq_len), tokens


def span_mask(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """A chat-like token loss mask [batch, seq_len] (1 = trained on): two or three random "assistant" spans per
    row, never covering the last two tokens. Unshifted (``--raw-mask``), a mask on token S - 2 would make SpecForge
    score the target's prediction past the window, which treespec never scores with a loss mask (see the docs):
    left out, the raw run differs by the two-token offset alone."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.zeros(batch, seq_len, dtype=torch.long)
    for row in mask:
        for _ in range(int(torch.randint(2, 4, (1,), generator=g))):
            start = int(torch.randint(0, seq_len - 4, (1,), generator=g))
            row[start : start + int(torch.randint(2, seq_len // 3, (1,), generator=g))] = 1
    mask[:, -2:] = 0
    return mask


@dataclass
class Setup:
    target: object
    model: Eagle3Model
    windows: torch.Tensor              # [b, S] token ids
    loss_mask: torch.Tensor | None     # [b, S] token mask (treespec's convention: the token is trained on)
    features: torch.Tensor             # [b, S, 3H] aux hidden states
    last: torch.Tensor                 # [b, S, H] final-norm hidden state
    logits: torch.Tensor               # [b, S, V] float32

    @property
    def batch(self):
        """What ``eagle3_loss`` takes: the windows, or a chat batch with its loss mask."""
        return self.windows if self.loss_mask is None else {"input_ids": self.windows, "loss_mask": self.loss_mask}

    @property
    def scored(self) -> torch.Tensor:
        """[b, S] bool: position p's prediction (of token p + 1) is trained on."""
        if self.loss_mask is None:
            return torch.ones_like(self.windows, dtype=torch.bool)
        return shifted_mask(self.loss_mask, 1, self.windows.shape[1])


def build_setup(*, seed: int, batch: int, seq_len: int, draft_vocab: int, loss_mask: str) -> Setup:
    target, tokenizer = load("target")  # float32: the comparison is at float32 tolerance
    windows, stream = stdlib_windows(tokenizer, batch, seq_len)
    vocab = target.config.vocab_size
    d2t, t2d = build_vocab_map(token_counts(stream, vocab), min(draft_vocab, vocab))
    torch.manual_seed(seed)
    model = Eagle3Model(target, vocab_map=(d2t, t2d)).float().train()
    with torch.no_grad():
        features, last = target_hidden(target, windows, model.aux_layers)
        logits = target_states(target, windows, model.aux_layers)[1]
    mask = span_mask(batch, seq_len, seed) if loss_mask == "spans" else None
    return Setup(target, model, windows, mask, features, last, logits)


def specforge_loss_mask(setup: Setup, raw: bool) -> torch.Tensor:
    """The loss mask SpecForge's data pipeline must carry. SpecForge's entry k (after its shift) reads token k + 1
    and the target's logits at k + 1, i.e. predicts token k + 2, and is scored by loss_mask[k]: aligned, that is
    treespec's scored[k + 1]. ``raw``: the token mask itself, as SpecForge's chat parser writes it."""
    if raw:
        return (setup.loss_mask if setup.loss_mask is not None else torch.ones_like(setup.windows)).long()
    aligned = torch.zeros_like(setup.windows)
    aligned[:, :-1] = setup.scored[:, 1:].long()
    return aligned


def write_exchange(folder: Path, setup: Setup, lengths, decay: float, raw_mask: bool) -> None:
    """Everything the worker needs: the head in SpecForge's layout, the stored target states, the vocabulary
    map file, the target's lm_head (float32) and the request."""
    export(setup.model, setup.target, folder / "head", to="sglang")
    inputs = {"input_ids": setup.windows, "loss_mask": specforge_loss_mask(setup, raw_mask),
              "aux_hidden_state": setup.features.float(), "hidden_state": setup.last.float()}
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(folder / "inputs.safetensors"))
    save_file({"weight": setup.target.get_output_embeddings().weight.detach().float().contiguous()},
              str(folder / "lm_head.safetensors"))
    # SpecForge reads its vocabulary map with torch.load (load_vocab_mapping); a dict of two tensors
    torch.save({"d2t": setup.model.d2t.cpu(), "t2d": setup.model.t2d.cpu()}, folder / "vocab_mapping.pt")
    (folder / "request.json").write_text(json.dumps({"ttt_lengths": list(lengths), "decay": decay,
                                                     "target_dir": str(path("target"))}))


# -- treespec's side -----------------------------------------------------------------------------------------
def grads_of(module) -> dict:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad and p.grad is not None}


def treespec_step(setup: Setup, length: int, decay: float) -> tuple[dict, dict]:
    """treespec's training step with ``length`` TTT passes (unroll_steps = length - 1): (per-step results,
    gradients by objective: "kept_mean" = its own loss, "bt_sum" = re-weighted to SpecForge's normalisation)."""
    model, (b, s) = setup.model, setup.windows.shape
    model.zero_grad(set_to_none=True)
    total, metrics = eagle3_loss(setup.target, model, setup.batch, unroll_steps=length - 1, decay=decay)
    total.backward()
    total = total.detach()
    grads = {"kept_mean": grads_of(model)}

    restricted = RestrictedTarget(setup.logits, model, None if setup.loss_mask is None else setup.scored)
    steps = []
    for i in range(length):  # step i scores positions 1 + i .. S - 1 (heads/eagle3/drafter.py, unrolled)
        valid = restricted.valid[:, 1 + i :]
        kept = int(valid.sum())
        steps.append({"kl": metrics[f"kl{i}"], "top1": metrics[f"top1_{i}"], "kept": kept,
                      "correct": round(metrics[f"top1_{i}"] * kept),
                      "neg_entropy_sum": float(restricted.neg_entropy[:, 1 + i :][valid].sum())})

    # Per-step losses, differentiable: step i's output does not depend on later steps, so the undecayed total
    # over steps 0..k minus the one over 0..k-1 is step k's KL, exactly as eagle3_loss computes it.
    model.zero_grad(set_to_none=True)
    totals = [eagle3_loss(setup.target, model, setup.batch, unroll_steps=k, decay=1.0)[0] for k in range(length)]
    kls = [totals[0]] + [totals[k] - totals[k - 1] for k in range(1, length)]
    sum(decay**i * kl * steps[i]["kept"] / (b * s) for i, kl in enumerate(kls)).backward()
    grads["bt_sum"] = grads_of(model)
    return {"loss": total.item(), "steps": steps}, grads


# -- the comparison ------------------------------------------------------------------------------------------
@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    worst: dict = field(default_factory=dict)  # largest relative differences seen, by kind

    @property
    def ok(self) -> bool:
        return not self.failures

    def note(self, kind: str, value: float) -> None:
        self.worst[kind] = max(self.worst.get(kind, 0.0), value)


def close(a: float, b: float) -> float:
    """|a - b| relative to max(1, |a|, |b|)."""
    return abs(a - b) / max(1.0, abs(a), abs(b))


def compare_length(report: Report, length: int, ours: dict, ours_grads: dict, theirs: dict, their_grads: dict,
                   b: int, s: int, decay: float, loss_rtol: float, grad_rtol: float) -> None:
    bt = b * s
    report.lines += [f"TTT length {length} (treespec unroll_steps={length - 1}), B·T = {b}·{s}",
                     "step  kept ts/sf   KL ts       KL sf→ts    |Δ|       CE/BT sf    ts→CE/BT    |Δ|       "
                     "correct ts/sf  acc ts  acc sf"]
    for i, (o, t) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
        sf_kl = (t["ploss"] * t["positions"] + t["neg_entropy_sum"]) / max(t["kept"], 1)
        ts_ce = (o["kl"] * o["kept"] - o["neg_entropy_sum"]) / bt
        d_kl, d_ce = close(o["kl"], sf_kl), close(t["ploss"], ts_ce)
        report.note("loss", max(d_kl, d_ce))
        report.lines.append(f"{i:>4}  {o['kept']:>5}/{t['kept']:<5}  {o['kl']:<10.6f}  {sf_kl:<10.6f}  {d_kl:<8.1e}  "
                            f"{t['ploss']:<10.6f}  {ts_ce:<10.6f}  {d_ce:<8.1e}  {o['correct']:>6}/{t['correct']:<6}  "
                            f"{o['top1']:.3f}   {t['acc']:.3f}")
        if o["kept"] != t["kept"]:
            report.failures.append(f"length {length} step {i}: kept positions {o['kept']} (treespec) vs {t['kept']}")
        if d_kl > loss_rtol or d_ce > loss_rtol:
            report.failures.append(f"length {length} step {i}: loss differs ({d_kl:.1e} kept-mean, {d_ce:.1e} B·T-sum)")
        if o["correct"] != t["correct"]:
            report.failures.append(f"length {length} step {i}: top-1 correct {o['correct']} (treespec) vs "
                                   f"{t['correct']}")
    # the totals: each side's own weighting of its own step losses (SpecForge's Eagle3TrainStrategy: ploss_decay ** i)
    decayed = lambda values: sum(decay**i * v for i, v in enumerate(values))  # noqa: E731
    ts_in_sf = decayed((o["kl"] * o["kept"] - o["neg_entropy_sum"]) / bt for o in ours["steps"])
    sf_in_ts = decayed((t["ploss"] * t["positions"] + t["neg_entropy_sum"]) / max(t["kept"], 1)
                       for t in theirs["steps"])
    d_total = max(close(ours["loss"], sf_in_ts), close(theirs["loss"], ts_in_sf))
    report.note("loss", d_total)
    report.lines.append(f"total  treespec {ours['loss']:.6f} vs SpecForge→ts {sf_in_ts:.6f}; SpecForge "
                        f"{theirs['loss']:.6f} vs treespec→CE/BT {ts_in_sf:.6f}  (|Δ| {d_total:.1e})")
    if d_total > loss_rtol:
        report.failures.append(f"length {length}: weighted total loss differs ({d_total:.1e})")
    report.lines.append("gradients   max|g|      kept-mean |Δ|  B·T-sum |Δ|   native ts vs sf: |Δ|/max|g|")
    for group, prefixes in GROUPS.items():
        names = [n for n in ours_grads["kept_mean"] if n.startswith(prefixes)]
        if not names:
            continue
        scale = max(float(ours_grads["kept_mean"][n].abs().max()) for n in names)
        row = []
        for ours_kind, their_kind in (("kept_mean", "kept_mean"), ("bt_sum", "native"), ("kept_mean", "native")):
            diff = max(float((ours_grads[ours_kind][n] - their_grads[their_kind][n]).abs().max()) for n in names)
            row.append(diff)
        rel = [d / max(scale, 1e-12) for d in row]
        report.note("gradient", max(rel[:2]))
        report.lines.append(f"  {group:<11} {scale:<10.3e}  {row[0]:<13.2e}  {row[1]:<12.2e}  {rel[2]:.2e}")
        for kind, r in (("kept-mean", rel[0]), ("B·T-sum", rel[1])):
            if r > grad_rtol:
                report.failures.append(f"length {length}: {group} gradients differ ({kind}): {r:.1e} of max|g|")
    missing = sorted(set(ours_grads["kept_mean"]) ^ set(their_grads["native"]))
    if missing:
        report.failures.append(f"length {length}: parameters on one side only: {missing}")
    else:  # each side's own objective: how far the normalisations alone move the gradient
        flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(grads)])  # noqa: E731
        ts, sf = flat(ours_grads["kept_mean"]), flat(their_grads["native"])
        ts, sf = ts.double(), sf.double()
        report.lines.append(f"native objectives: cosine(g_ts, g_sf) {float(ts @ sf / (ts.norm() * sf.norm())):.6f}, "
                            f"|g_sf| / |g_ts| {float(sf.norm() / ts.norm()):.4f}")
    report.lines.append("")


def run_worker(python: str, folder: Path, timeout: float) -> tuple[dict, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # SpecForge's venv sees nothing of treespec's
    done = subprocess.run([python, str(WORKER), str(folder)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the SpecForge worker failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((folder / "result.json").read_text()), load_file(str(folder / "grads.safetensors"))


def check(*, python: str, lengths=(1, 2, 7), seed: int = 0, batch: int = 2, seq_len: int = 64,
          draft_vocab: int = 2048, loss_mask: str = "none", raw_mask: bool = False, decay: float = 0.8,
          loss_rtol: float = 1e-5, grad_rtol: float = 1e-4, keep: str | None = None,
          timeout: float = 600.0) -> Report:
    """Run both sides and compare; the Report's ``lines`` are the table, ``failures`` what disagreed."""
    setup = build_setup(seed=seed, batch=batch, seq_len=seq_len, draft_vocab=draft_vocab, loss_mask=loss_mask)
    with tempfile.TemporaryDirectory(prefix="specforge_check_") as tmp:
        folder = Path(keep) if keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        write_exchange(folder, setup, lengths, decay, raw_mask)
        theirs, their_grads = run_worker(python, folder, timeout)
    report = Report()
    v = theirs["versions"]
    report.lines += [f"SpecForge {v['specforge']} (torch {v['torch']}, transformers {v['transformers']}, loss: "
                     f"{theirs['loss_kernel']}) vs treespec (torch {torch.__version__}); draft vocabulary "
                     f"{setup.model.draft_vocab_size} of {setup.model.vocab_size}, loss mask {loss_mask}"
                     f"{' (raw, unaligned)' if raw_mask else ''}, seed {seed}",
                     f"SpecForge from_pretrained leaves rotary caches uninitialised: "
                     f"{theirs['from_pretrained_rotary_broken']} (repaired by _init_rope(): "
                     f"{theirs['init_rope_repairs']}); its training path (from_config + warm start) is unaffected",
                     ""]
    b, s = setup.windows.shape
    for result in theirs["lengths"]:
        length = result["length"]
        ours, ours_grads = treespec_step(setup, length, decay)
        grads = {kind: {n[len(f"{length}/{kind}/"):]: g for n, g in their_grads.items()
                        if n.startswith(f"{length}/{kind}/")} for kind in ("native", "kept_mean")}
        compare_length(report, length, ours, ours_grads, result, grads, b, s, decay, loss_rtol, grad_rtol)
    return report


def run(args) -> int:
    """scripts/specforge_check.py's options (``ttt`` checked there): the report to stdout; 0: agreement, 1: a
    disagreement, 2: SpecForge's Python is missing or its worker failed."""
    python = specforge_python(args.specforge_python)
    if python is None:
        given = args.specforge_python or os.environ.get(ENV)
        where = (f"{given} is no python with SpecForge" if given else
                 f"SpecForge's python is not given: pass --specforge-python PATH or set {ENV}")
        print(f"{where} (its venv's setup: docs/specforge_check.md)", file=sys.stderr)
        return 2
    try:
        report = check(python=python, lengths=args.ttt, seed=args.seed, batch=args.batch, seq_len=args.seq_len,
                       draft_vocab=args.draft_vocab, loss_mask=args.loss_mask, raw_mask=args.raw_mask,
                       decay=args.decay, loss_rtol=args.loss_rtol, grad_rtol=args.grad_rtol, keep=args.keep)
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 2
    print("\n".join(report.lines))
    worst = ", ".join(f"{k} {v:.1e}" for k, v in report.worst.items())
    if report.ok:
        print(f"agree (largest relative differences: {worst})")
        return 0
    print("DISAGREE:\n  " + "\n  ".join(report.failures))
    return 1

