"""Where a decoding step's time goes, per attention implementation: torch.profiler over plain (vanilla) decoding of the
reference target, the ops ranked by their own time, beside the bare one-token pass.

Why: the first GPU check found an sdpa decoding step on CUDA far slower than its pass, where flex_attention's was
not (results/gpu_check_2026-12-04/); this says which ops take the difference.

    python scripts/decode_profile.py --device cuda --attn sdpa --attn flex_attention --out DIR
    python scripts/decode_profile.py --device cpu --attn sdpa --tokens 8 --out DIR    # the dry run (CPU)

Writes decode_profile.md under --out: per implementation, ms per decoding step of generate() (the prefill left out)
and of the bare one-token pass, and the top ``--rows`` ops of one generation by self time (CUDA time on a GPU, CPU
time otherwise), with their call counts per token.
"""

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from treespec import generate, reference
from treespec.timing import forward_time


def decode_ms(target, prompt, tokens: int, device: str) -> float:
    """Milliseconds per decoding step of plain greedy decoding, the prefill left out: a generation of ``tokens``
    minus one of a single token (its prefill alone), over the steps between (after a warm-up generation)."""
    def timed(n: int) -> tuple[float, int]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(target, prompt, max_new_tokens=n)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.new_tokens

    generate(target, prompt, max_new_tokens=4)
    (one, _), (many, new) = timed(1), timed(tokens)
    return 1e3 * (many - one) / max(1, new - 1)


def top_ops(target, prompt, tokens: int, device: str, rows: int) -> str:
    """The profiler's table of one generation's ops by self time, per token (its prefill included)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(target, prompt, max_new_tokens=tokens)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:rows]
    lines = ["| op | self ms per token | calls per token |", "|---|---|---|"]
    for e in events:
        lines.append(f"| `{e.key}` | {getattr(e, key, 0.0) / 1e3 / tokens:.3f} | {e.count / tokens:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--attn", action="append", help="attention implementations (default: sdpa)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens each profiled generation decodes")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--out", default="runs/decode_profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# Decoding profile ({args.device}, {args.tokens} tokens, reference target)\n"]
    for attn in args.attn or ["sdpa"]:
        target, tokenizer = reference.load("target", attn_implementation=attn)
        target = target.to(args.device).eval()
        prompt = tokenizer(reference.prompts()[0], return_tensors="pt").input_ids[:, -256:].to(args.device)
        per_token = decode_ms(target, prompt, args.tokens, args.device)
        bare = 1e3 * forward_time(target, n_tokens=1, past_len=prompt.shape[1], repeats=10)
        line = f"{attn}: generate {per_token:.2f} ms per step, the bare one-token pass {bare:.2f} ms"
        print(line, flush=True)
        report += [f"## {attn}\n", line + "\n", top_ops(target, prompt, args.tokens, args.device, args.rows), ""]
    (out / "decode_profile.md").write_text("\n".join(report))
    print(f"wrote {out / 'decode_profile.md'}")


if __name__ == "__main__":
    main()
