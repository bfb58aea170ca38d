"""Vanilla greedy decoding of SmolLM2-135M-Instruct on each CPU linear kernel, alternated prompt by prompt (a slow
spell of a shared machine falls on all), and the T(N)/T(1) curve of one forward after 256 cached tokens per kernel,
alternated round by round. Prints tokens/s (median over prompts) and each kernel's ratio to the first's, whether the
greedy tokens equal the first kernel's, the curves, and a 256-token prefill's time per kernel (a forward from an empty
cache, alternated round by round).

    python results/smollm2_packed/vanilla_ab.py [kernels=packed,native,fewrow] [prompts=8] [tokens=64]
"""

import gzip
import json
import statistics
import sys
import time

import torch

from treespec import reference
from treespec.generate import decode
from treespec.linear_kernels import use_linear_kernel
from treespec.timing import forward_steps, median_time

args = dict(a.split("=", 1) for a in sys.argv[1:])
kernels = args.get("kernels", "packed,native,fewrow").split(",")
n_prompts, tokens = int(args.get("prompts", 8)), int(args.get("tokens", 64))
torch.set_num_threads(2)
target, tokenizer = reference.load("smollm2")
with gzip.open("treespec/models/smollm2/chat.jsonl.gz", "rt") as f:
    rows = [json.loads(line) for _, line in zip(range(200), f, strict=False)]
prompts = []
for row in rows[::25][:n_prompts]:  # spread over the file; the first user turn of each conversation
    turn = next(m for m in row["messages"] if m["role"] == "user") if "messages" in row else {"content": row["prompt"]}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": turn["content"]}], add_generation_prompt=True,
                                        return_tensors="pt")
    prompts.append(ids if torch.is_tensor(ids) else ids["input_ids"])
rates = {k: [] for k in kernels}
outputs = {k: [] for k in kernels}
with torch.no_grad():
    for ids in prompts:
        for kernel in kernels:
            use_linear_kernel(target, kernel)
            decode(target, ids, max_new_tokens=4)  # first-call set-up (held copies) untimed
            start = time.perf_counter()
            result = decode(target, ids, max_new_tokens=tokens)
            new = result.sequences.shape[1] - ids.shape[1]
            rates[kernel].append(new / (time.perf_counter() - start))
            outputs[kernel].append(result.sequences[0, ids.shape[1]:].tolist())
first = kernels[0]
for kernel in kernels:
    ratio = statistics.median(a / b for a, b in zip(rates[kernel], rates[first], strict=True))
    same = sum(a == b for a, b in zip(outputs[kernel], outputs[first], strict=True))
    print(f"vanilla {kernel}: {statistics.median(rates[kernel]):.1f} tokens/s, paired ÷ {first} {ratio:.3f}, "
          f"greedy tokens equal to {first}'s on {same}/{len(prompts)} prompts")
sizes = [1, 2, 4, 8, 16]
steps = forward_steps(target, sizes, past_len=256)
times = {(k, n): [] for k in kernels for n in sizes}
for _ in range(5):
    for kernel in kernels:
        use_linear_kernel(target, kernel)
        for n, step in steps.items():
            times[(kernel, n)].append(median_time(step, repeats=5, warmup=1))
for kernel in kernels:
    t1 = statistics.median(times[(kernel, 1)])
    print(f"T(N)/T(1) {kernel}: T(1) {1e3 * t1:.1f} ms, " + " ".join(
        f"{n}:{statistics.median(times[(kernel, n)]) / t1:.2f}" for n in sizes[1:]))
prefill = torch.randint(0, target.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
prefill_times = {k: [] for k in kernels}
with torch.no_grad():
    for _ in range(5):
        for kernel in kernels:
            use_linear_kernel(target, kernel)
            prefill_times[kernel].append(median_time(lambda: target(input_ids=prefill), repeats=3, warmup=1))
for kernel in kernels:
    ratio = statistics.median(prefill_times[kernel]) / statistics.median(prefill_times[first])
    print(f"prefill of 256 tokens {kernel}: {1e3 * statistics.median(prefill_times[kernel]):.0f} ms, "
          f"÷ {first} {ratio:.2f}")
