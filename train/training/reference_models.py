"""Ship the trained reference models (scripts/ship_reference.py, after scripts/train_reference.sh): copy them
from a run folder into treespec/models/, write held-out prompts, measure the seed's α and c, predicted vs measured
chain speedups, and write the model card (MODEL_CARD.md, card.json).
"""

import json
import shutil
import statistics
from pathlib import Path

import torch

from treespec import Tree, reference
from treespec.heads import DraftModel
from treespec.planning.analysis import expected_tokens_per_round, speedup
from treespec.planning.bench import Config, measure
from treespec.sampling import Sampling, probs
from treespec.timing import forward_time
from treespec.train.training.data import STDLIB_CORPUS, eval_windows, load_corpus, prepare_tokens

PROMPT_LINES = 25  # lines per prompt


def cut(text: str, held_out: bool = False, max_chars: int = 1000) -> str | None:
    """A prompt of ``text``: PROMPT_LINES lines a third of the way in (a timed prompt), or, ``held_out``, lines
    two thirds in, past the timed cut (what the comparison measures accuracies on: like the timed prompts, not
    them). None for a file under 60 lines."""
    lines = text.splitlines(keepends=True)
    if len(lines) < 60:
        return None
    start = len(lines) // 3
    if held_out:
        start = max(2 * len(lines) // 3, start + PROMPT_LINES)
    return "".join(lines[start : start + PROMPT_LINES])[:max_chars]


def write_prompts(n: int = 24) -> None:
    """Prompts from validation-split stdlib files: split ``test`` (timed) and split ``held_out`` (the same files'
    later lines, for the comparison's accuracies: train/compare/workload.py)."""
    files = [(name, text) for name, text in sorted(load_corpus("stdlib").val) if cut(text) is not None][:n]
    rows = [{"split": "test", "source": name, "text": cut(text)} for name, text in files]
    held = [{"split": "held_out", "source": name, "text": cut(text, held_out=True)} for name, text in files]
    with open(reference.MODELS_DIR / "prompts.jsonl", "w") as f:
        for r in rows + held:
            f.write(json.dumps(r) + "\n")


@torch.no_grad()
def acceptance_rates(target, draft, windows: torch.Tensor) -> dict:
    """The seed's α on held-out text (teacher forcing): greedy = P(argmax q = argmax p);
    temperature 1 = E[Σ_x min(p(x), q(x))], the chance a drafted token survives rejection sampling."""
    greedy, sampled = [], []
    for w in windows.split(4):
        p_logits, q_logits = target(input_ids=w).logits, draft(input_ids=w).logits
        greedy.append((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item())
        p, q = probs(p_logits, Sampling(1.0)), probs(q_logits, Sampling(1.0))
        sampled.append(torch.minimum(p, q).sum(-1).mean().item())
    return {"greedy": statistics.mean(greedy), "t1": statistics.mean(sampled)}


def run(args, root: Path) -> None:
    """scripts/ship_reference.py's options; ``root``: the repository, whose runs/lm/<name> hold the trained models
    and .cache/data the tokenized corpus."""
    out_dir = reference.MODELS_DIR
    summaries = {}
    for name in reference.NAMES:
        run_dir = root / "runs" / "lm" / name
        if not args.skip_copy:
            shutil.rmtree(out_dir / name, ignore_errors=True)
            shutil.copytree(run_dir / "final", out_dir / name)
            shutil.copy(run_dir / "summary.json", out_dir / name / "training_summary.json")
        summaries[name] = json.loads((out_dir / name / "training_summary.json").read_text())
    write_prompts()

    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    _, _, val_tokens = prepare_tokens(STDLIB_CORPUS, len(tokenizer), root / ".cache" / "data")
    alpha = acceptance_rates(target, draft, eval_windows(val_tokens, 512, 32))
    t_target, t_draft = forward_time(target), forward_time(draft)
    c = t_draft / t_target
    print(f"alpha={alpha} c={c:.3f} (target {1e3 * t_target:.2f} ms, draft {1e3 * t_draft:.2f} ms)")

    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in reference.prompts()[: args.prompts]]
    measured = {}
    for label, temperature in (("greedy", 0.0), ("t1", 1.0)):
        configs = [Config(f"γ={g}", DraftModel(draft, candidates="sample"), Tree.chain(g)) for g in range(1, 9)]
        rows = measure(target, configs, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature)
        measured[label] = {r.name: r for r in rows}
        print(label, [(r.name, round(r.speedup, 2), round(r.tau, 2)) for r in rows])

    card = {"alpha": alpha, "c": c, "target_forward_ms": 1e3 * t_target, "draft_forward_ms": 1e3 * t_draft,
            "measured": {k: {n: {"speedup": r.speedup, "tau": r.tau, "tokens_per_s": r.tokens_per_s}
                             for n, r in v.items()} for k, v in measured.items()},
            "training": summaries, "threads": torch.get_num_threads()}
    (out_dir / "card.json").write_text(json.dumps(card, indent=2))
    write_card(card)


def write_card(card: dict) -> None:
    t, d = card["training"]["target"], card["training"]["draft"]
    lines = [
        "# Reference models: model card",
        "",
        "Two Llama models (`LlamaForCausalLM`, tied embeddings) sharing one byte-level BPE tokenizer, trained",
        "from scratch on this machine (2 CPU cores) by `scripts/train_reference.sh`; measured by",
        "`scripts/ship_reference.py`. Weights are bf16 safetensors; `treespec.reference.load` upcasts to fp32.",
        "",
        "- **Corpus:** the Python 3.11 standard library `.py` files (site-packages excluded), split by a hash of",
        f"  the file path: {t['train_tokens']:,} train tokens, {t['val_tokens']:,} validation tokens (~2 % of files).",
        "- **Tokenizer:** byte-level BPE, vocabulary 8192 (`<|endoftext|>` = 0 separates files).",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| parameters | {t['parameters'] / 1e6:.2f}M | {d['parameters'] / 1e6:.2f}M |",
        "| layers × hidden (heads) | 7 × 384 (6), MLP 1024 | 2 × 128 (2), MLP 384 |",
        "| context | 1024 positions (trained on 512-token windows) | same |",
        f"| steps × batch | {t['steps']} × 8 × 512 | {d['steps']} × 8 × 512 |",
        f"| tokens seen (epochs) | {t['tokens_seen']:,} ({t['epochs']:.2f}) "
        f"| {d['tokens_seen']:,} ({d['epochs']:.2f}) |",
        f"| training wall time | {t['train_wall_time_s'] / 60:.0f} min | {d['train_wall_time_s'] / 60:.0f} min |",
        f"| final train loss (EMA) | {t['train_loss']:.3f} | {d['train_loss']:.3f} |",
        f"| validation loss | {t['val_loss']:.3f} | {d['val_loss']:.3f} |",
        f"| validation top-1 next-token accuracy | {t['val_top1']:.3f} | {d['val_top1']:.3f} |",
        "",
        "Validation numbers are on the first 96 windows of 512 tokens of the validation split.",
        "",
        "## The seed's α and c, and chain speculation on this CPU",
        "",
        f"- α (draft token accepted, teacher-forced on 32 × 512 validation tokens): greedy "
        f"**{card['alpha']['greedy']:.3f}**, temperature 1 **{card['alpha']['t1']:.3f}**.",
        f"- c = draft forward / target forward (one token after 256 cached, median, {card['threads']} threads): "
        f"{card['draft_forward_ms']:.2f} / {card['target_forward_ms']:.2f} ms = **{card['c']:.3f}**.",
        "",
        "Predicted (seed formula, E[T]/(γc+1) with the α and c above) vs measured (`DraftModel` chain, median",
        "speedup over vanilla in the same run, 8 held-out prompts × 128 new tokens):",
        "",
        "| γ | predicted τ greedy | measured τ greedy | predicted speedup greedy | measured speedup greedy "
        "| predicted τ T=1 | measured τ T=1 | predicted speedup T=1 | measured speedup T=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in range(1, 9):
        cells = []
        for label in ("greedy", "t1"):
            a, m = card["alpha"][label], card["measured"][label][f"γ={g}"]
            cells += [f"{expected_tokens_per_round(a, g):.2f}", f"{m['tau']:.2f}",
                      f"{speedup(a, g, card['c']):.2f}×", f"{m['speedup']:.2f}×"]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The seed formula assumes i.i.d. acceptance and that a verification pass over γ+1 tokens costs the same",
        "as a one-token step; on this CPU neither holds exactly (`scripts/cost_curve.py` measures how a pass's",
        "cost grows with its tokens), which is the gap between the columns.",
    ]
    (reference.MODELS_DIR / "MODEL_CARD.md").write_text("\n".join(lines) + "\n")

