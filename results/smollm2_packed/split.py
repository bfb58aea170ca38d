"""Where a SmolLM2 pass's time goes at 1 and 16 new tokens (after 256 cached ones), on the default kernels: each
``nn.Linear`` call, the attention function (``treespec_sdpa``), and the Llama modules around them, timed with a clock
around each call (which adds a little to every number). Medians over ``rounds`` rounds of 8 passes, ms per pass.

    python results/smollm2_packed/split.py [rounds=4]
"""

import statistics
import sys
from collections import defaultdict

import torch
from torch import nn
from transformers import AttentionInterface

from treespec import gqa_attention, reference
from treespec.timing import clocked, clocked_passes, forward_steps

rounds = int(dict(a.split("=", 1) for a in sys.argv[1:]).get("rounds", 4))
torch.set_num_threads(2)
target, _ = reference.load("smollm2")
spent = defaultdict(float)
MODULES = ("LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm")


for module in target.modules():
    kind = "linear" if isinstance(module, nn.Linear) else type(module).__name__
    if kind == "linear" or kind in MODULES:
        module.forward = clocked(module.forward, kind, spent)
AttentionInterface.register(gqa_attention.NAME, clocked(gqa_attention.sdpa_gqa_in_place, "attention function", spent))
steps = forward_steps(target, [1, 16], past_len=256)
per_pass = {n: defaultdict(list) for n in steps}
for _ in range(rounds):
    for n, step in steps.items():
        step(), step()
        for name, ms in clocked_passes(step, spent).items():
            per_pass[n][name].append(ms)
for n, by_name in per_pass.items():
    print(f"{n} token(s): " + ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in by_name.items()))
