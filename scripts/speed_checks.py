"""Where decoding time goes on the shipped reference models, switch by switch (a repeatable profile):

    python scripts/speed_checks.py                 # the machine's threads, 6 prompts × 96 new tokens
    python scripts/speed_checks.py --threads 1 --out runs/speed_checks.json

1. The target's forward over N new tokens after 256 cached ones, with transformers' concatenating KV cache and
   with treespec's preallocated one (treespec/cache.py), in ms.
2. One drafting step of each drafter, plain and lean (heads/drafting/lean.py): a depth over 4 frontier nodes after 256
   cached entries (Medusa: a whole proposal), in ms and as c = that time ÷ one target forward over one token.
3. A DFlash block of 8 (one layer, a freshly initialised network: the time does not depend on the weights) against
   one EAGLE-3 depth of 1 and of 4 nodes, full vocabulary and EAGLE-3's 2,048-token draft vocabulary (FR-Spec),
   each timed right after a target pass as in decoding, in interleaved rounds: ms and block ÷ depth.
4. The walker per verification rule at temperature 1 on a 64-node tree (the first 64 nodes of a full 4-ary
   tree) over the target's vocabulary, with random drafts (nothing accepted early: the traversal's worst case)
   and with the target's own top-k: ms and % of one target forward over the 65 tree tokens.
5. treespec's vanilla decoding against transformers' greedy generate(), interleaved prompt by prompt
   (treespec.planning.bench.measure): the median of per-prompt ratios.

Medians of repeated timings in one process; on a shared machine compare the ratios, not the milliseconds.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec import reference
from treespec.drafter import Proposal
from treespec.heads import DFlash, DFlashModel, registry
from treespec.heads.kind import fills_tree_at_once
from treespec.linear_kernels import follow_target_kernel
from treespec.planning.bench import Config, measure
from treespec.sampling import Sampling
from treespec.timing import forward_time, median_time
from treespec.train.compare.peers import hf_peer
from treespec.tree import Tree
from treespec.walker import walk

DRAFTERS = ("draft", "medusa", "eagle", "eagle3")


def block_costs(target, rounds: int = 3) -> dict:
    """Section 3: {"block": {vocab: ms}, "depth": {nodes: ms}, "ratio": {vocab: block ÷ 1-node depth}}."""
    eagle3 = registry.make("eagle3", registry.load_module("eagle3", target, "reference:eagle3"))
    torch.manual_seed(0)
    block = DFlashModel(target, block_size=8, num_layers=1).eval()
    follow_target_kernel(block, target)  # as a loaded drafter does (treespec/linear_kernels.py)
    steps = {("depth", n): eagle3.drafting_step(past_len=256, n_tokens=n) for n in (1, 4)}
    for vocab, draft_vocab in (("full", None), ("fr2048", eagle3.model.draft_vocab)):
        steps[("block", vocab)] = DFlash(block, draft_vocab=draft_vocab).drafting_step(past_len=256)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    target_pass = torch.no_grad()(lambda: target(tokens))  # evicts the drafter from the caches, as decoding does
    times = {key: [] for key in steps}
    for _ in range(rounds):  # interleaved: no term rests on one spell of a shared machine
        for key, step in steps.items():
            times[key].append(median_time(step, repeats=20, before=target_pass))
    ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    out = {"block": {v: ms[("block", v)] for v in ("full", "fr2048")}, "depth": {n: ms[("depth", n)] for n in (1, 4)}}
    out["ratio"] = {v: out["block"][v] / out["depth"][1] for v in out["block"]}
    print("\n| one drafting pass, after 256 context entries | ms | ÷ an EAGLE-3 depth of 1 node |\n|---|---|---|")
    for n in (1, 4):
        print(f"| EAGLE-3, a depth of {n} node(s) | {out['depth'][n]:.2f} | {out['depth'][n] / out['depth'][1]:.2f} |")
    for v, what in (("full", "the full vocabulary"), ("fr2048", "EAGLE-3's 2,048 draft tokens")):
        print(f"| DFlash, a block of 8, {what} | {out['block'][v]:.2f} | {out['ratio'][v]:.2f} |")
    return out


def walker_costs(target) -> dict:
    """Section 4: {drafts: {rule: ms}}, printed as a table against a 65-token forward."""
    tree = Tree(Tree.full(4, 3).paths[:64])
    n, vocab = tree.num_nodes, target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    forward_ms = 1e3 * forward_time(target, n)
    logits = torch.randn(n, vocab, generator=gen) * 3  # [N, V], a broad T = 1 distribution per node
    drafts = {"random drafts": torch.randint(0, vocab, (n - 1,), generator=gen),
              "the target's top-k": torch.tensor([int(logits[tree.parent_list[i]].topk(4).indices[int(tree.ranks[i])])
                                                  for i in range(1, n)])}
    print(f"\n| walker, 64-node tree, T = 1 | rule | ms | % of a {n}-token forward ({forward_ms:.1f} ms) |")
    print("|---|---|---|---|")
    costs = {}
    for label, tokens in drafts.items():
        proposal = Proposal(tree=tree, tokens=tokens)
        for rule in ("rejection", "traversal"):
            ms = 1e3 * median_time(lambda p=proposal, r=rule: walk(logits, p, Sampling(1.0), acceptance=r,
                                                                      generator=gen), repeats=50)
            costs.setdefault(label, {})[rule] = ms
            print(f"| {label} | {rule} | {ms:.3f} | {100 * ms / forward_ms:.1f}% |")
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = reference.load("target")
    out = {"threads": torch.get_num_threads(), "forward_ms": {}, "drafting": {}}

    print(f"| target forward, {out['threads']} thread(s) | concatenating cache | preallocated | ratio |")
    print("|---|---|---|---|")
    for n in (1, 4, 8, 16):
        plain, pre = (1e3 * forward_time(target, n, preallocate=p) for p in (False, True))
        out["forward_ms"][n] = {"concatenating": plain, "preallocated": pre}
        print(f"| N = {n} | {plain:.2f} ms | {pre:.2f} ms | {pre / plain:.2f} |")
    one_token = out["forward_ms"][1]["preallocated"]

    print("\n| drafter | plain | lean | lean ÷ plain | c plain | c lean |\n|---|---|---|---|---|---|")
    for name in DRAFTERS:
        module = registry.load_module(name, target, f"reference:{name}")
        ms = {}
        for lean in (False, True):
            drafter = registry.make(name, module, lean=lean)
            fixed, per_depth = registry.get(name).cost(drafter)
            ms[lean] = 1e3 * (per_depth or fixed)
        # Medusa's heads fill the whole tree in one call: timed per proposal, the others per drafted depth
        out["drafting"][name] = {"plain_ms": ms[False], "lean_ms": ms[True], "unit": "proposal" if
                                 fills_tree_at_once(drafter) else "depth of 4 nodes"}
        print(f"| {name} ({out['drafting'][name]['unit']}) | {ms[False]:.2f} ms | {ms[True]:.2f} ms | "
              f"{ms[True] / ms[False]:.2f} | {ms[False] / one_token:.2f} | {ms[True] / one_token:.2f} |")

    out["block_against_depth"] = block_costs(target)
    out["walk"] = walker_costs(target)

    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in reference.prompts()[: args.prompts]]
    rows = measure(target, [Config("transformers greedy", run=hf_peer(target, "greedy"))], prompts,
                   max_new_tokens=args.max_new_tokens)
    vanilla, hf = rows
    out["vanilla_over_transformers_greedy"] = 1 / hf.speedup
    out["vanilla_tokens_per_s"], out["transformers_tokens_per_s"] = vanilla.tokens_per_s, hf.tokens_per_s
    print(f"\ntreespec vanilla {vanilla.tokens_per_s:.1f} tokens/s, transformers greedy {hf.tokens_per_s:.1f} "
          f"tokens/s: vanilla ÷ transformers = {1 / hf.speedup:.2f}× (1 / the median of {len(prompts)} per-prompt "
          "ratios transformers ÷ vanilla)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
