"""What SmolLM2's attention calls cost inside its passes at 1 and 16 new tokens (after 256 cached ones), with a clock
around each: the C kernel alone, its Python wrapper (``native_attention``) and the whole attention function
(``treespec_sdpa``; at one token, transformers' sdpa). Medians over 5 rounds of 8 passes, ms per pass.

    python results/few_query_attention/in_model.py
"""

import statistics
from collections import defaultdict

import torch
from transformers import AttentionInterface

from treespec import gqa_attention, native_linear, reference
from treespec.timing import clocked, clocked_passes, forward_steps

torch.set_num_threads(2)
target, _ = reference.load("smollm2")
spent = defaultdict(float)


library = native_linear.library()
library.few_query_attention = clocked(library.few_query_attention, "C kernel", spent)
gqa_attention.native_attention = clocked(gqa_attention.native_attention, "native_attention()", spent)
AttentionInterface.register(gqa_attention.NAME, clocked(gqa_attention.sdpa_gqa_in_place, "attention function", spent))
steps = forward_steps(target, [1, 16], past_len=256)
layers = target.config.num_hidden_layers
for n, step in steps.items():
    per_pass = defaultdict(list)
    for _ in range(5):
        step()
        for name, ms in clocked_passes(step, spent).items():
            per_pass[name].append(ms)
    print(f"{n} token(s), ms per pass (µs per layer): " + ", ".join(
        f"{name} {statistics.median(v):.2f}" + ("" if name == "whole pass" else
                                                 f" ({statistics.median(v) / layers * 1e3:.0f})")
        for name, v in per_pass.items()))
