"""The cost curve of a target on a device: median seconds of one forward over N new tokens after 256
cached ones, N = 1..128 (what tree sizing trades τ against). Random weights are enough for timing.

    python scripts/cost_curve.py --device cuda --dtype bfloat16 --model reference --model llama3-8b
    python scripts/cost_curve.py --device cpu --model tiny              # the dry run gpu_check.sh does in CI
    python scripts/cost_curve.py --device cpu --model smollm2 --threads 1   # SmolLM2-135M-Instruct (trained)
"""

import argparse
import csv
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec import reference
from treespec.planning.autotree import DEFAULT_SIZES, measure_cost_curve

# Llama-3-8B's shape (random weights: timing needs none trained); "tiny" keeps the dry run to seconds
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}


def build(name: str, device: str, dtype: torch.dtype, attn: str):
    if name == "reference" or name in reference.GGUF_TARGETS:
        name = "target" if name == "reference" else name
        return reference.load(name, dtype=dtype, attn_implementation=attn)[0].to(device)
    with torch.device(device):  # allocate on the device directly: an 8B model in fp32 on the host is 32 GB
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[name], attn_implementation=attn))
    return model.to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--model", action="append", choices=["reference", *reference.GGUF_TARGETS, *SHAPES],
                        help="repeatable")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/cost_curve"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.model or ["reference"]:
        model = build(name, args.device, getattr(torch, args.dtype), args.attn)
        curve = measure_cost_curve(model, args.sizes, repeats=args.repeats)
        results[name] = curve
        timings = ", ".join(f"N={n}: {1e3 * s:.2f} ms" for n, s in curve.items())
        print(f"{name} ({args.device}, {args.dtype}): {timings}")
        with open(args.out / f"cost_curve_{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["tree_tokens", "seconds", "relative_to_one"])
            writer.writerows([n, f"{s:.6f}", f"{s / curve[args.sizes[0]]:.3f}"] for n, s in curve.items())
        del model
    meta = {"device": args.device, "dtype": args.dtype, "attn": args.attn, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "threads": torch.get_num_threads(),
            "curves": {k: {str(n): s for n, s in v.items()} for k, v in results.items()}}
    (args.out / "cost_curves.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
