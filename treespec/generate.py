"""The one decoding loop: prefill → propose → verify → commit.

    prefill   target(prompt)                         → first token (the root of step 1)
    step      drafter.propose(committed, feature)    → candidate tree (tokens, q_draft)
              target([root] + tree, tree mask)       → logits at every node, one pass
              walk(logits, proposal)                 → accepted path + next token
              keep_tree_path(cache); drafter.accept  → caches hold prefix + accepted path

Invariant between steps: the target's cache holds every committed token except the last one, the
root, which is fed at the start of the next verification pass. ``drafter=None`` runs the same loop
with an empty tree: plain autoregressive decoding, the baseline every speedup is measured against.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from treespec.cache import TreeCache, check_filled, keep_tree_path, tree_masks
from treespec.drafter import Proposal, stack_features
from treespec.dynamic_tree import DynamicTree
from treespec.inputs import check_inputs
from treespec.masks import full_attention_tree_mask, tree_position_ids
from treespec.sampling import argmax, probs, sample
from treespec.tree import Tree
from treespec.verify import walk


@dataclass
class GenerationResult:
    sequences: torch.Tensor                          # LongTensor [1, prompt + new]
    prompt_length: int
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification pass
    wall_time: float = 0.0                           # seconds, prefill included
    target_time: float = 0.0                         # seconds inside target forwards
    draft_time: float = 0.0                          # seconds inside drafter.propose / accept

    @property
    def target_passes(self) -> int:
        """Verification passes (the prefill, which commits the first token, is not counted)."""
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        """τ: mean tokens committed per verification pass, bonus token included."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def overhead_time(self) -> float:
        """Seconds spent outside target and drafter calls: masks, walking, cache compaction, glue."""
        return self.wall_time - self.target_time - self.draft_time


def prefill_kwargs(target) -> dict:
    """``logits_to_keep=1`` where the model's forward takes it (transformers' causal LMs), else nothing."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}


@torch.no_grad()
def generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter=None,
    tree: Tree | DynamicTree | dict | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    acceptance: str = "rejection",
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``input_ids`` [1, P] with tree speculation.

    ``tree`` is the candidate tree: a Tree, a DynamicTree or a tree-spec dict (default: the drafter's
    ``default_tree``). Every argument is checked first (treespec/inputs.py). ``acceptance`` is
    "rejection" (lossless: greedy at temperature 0, rejection sampling otherwise) or "typical"
    (Medusa's typical acceptance: faster, NOT lossless).
    """
    inputs = check_inputs(target, input_ids, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, generator=generator,
                          acceptance=acceptance)
    input_ids, max_new_tokens, tree, sampling, eos = (inputs.input_ids, inputs.max_new_tokens, inputs.tree,
                                                      inputs.sampling, inputs.eos)
    if isinstance(tree, Tree) and len(tree) == 0:  # nothing to draft (e.g. tree=auto chose not to speculate):
        drafter = None  # vanilla decoding, without the drafter's prefill or the target's features
    needs_features = drafter is not None and drafter.needs_features
    feature_layers = tuple(drafter.feature_layers) if needs_features else ()
    device = target.device
    attn_implementation = target.config._attn_implementation

    prompt_len = input_ids.shape[1]
    sequence = torch.empty(1, prompt_len + max_new_tokens, dtype=torch.long, device=device)  # [1, L_max]
    sequence[:, :prompt_len] = input_ids
    result = GenerationResult(sequences=sequence, prompt_length=prompt_len)
    # the time split (target / drafter / engine) waits for queued CUDA kernels at every boundary, so that each
    # part is charged for its own kernels (a no-op on CPUs)
    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    t_start = clock()

    def forward(**kwargs):
        t0 = clock()
        out = target(cache=cache, use_cache=True, output_hidden_states=needs_features, **kwargs)
        result.target_time += clock() - t0
        if not needs_features:
            return out, None
        return out, stack_features(out.hidden_states, feature_layers)  # [1, n, L·h]

    # -- prefill: the prompt's last logits give the first new token (the first root) --------------
    cache = TreeCache(target.config)  # sliding-window layers too can be rolled back (treespec/cache.py)
    mask_parts = full_attention_tree_mask(attn_implementation, dtype=target.dtype, device=device)  # kept per tree
    # only the last position's logits are needed (a full-prompt [P, V] projection costs as much as a few steps)
    out, features = forward(input_ids=input_ids.to(device), **prefill_kwargs(target))  # features: [1, P, L·h]
    check_filled(cache, prompt_len, target)
    p_target = probs(out.logits[0, -1], sampling)  # [V]
    root = int(argmax(p_target) if sampling.greedy else sample(p_target, generator))
    length = prompt_len
    sequence[0, length] = root
    length += 1
    feature = features[:, -1] if needs_features else None  # [1, h]: the state that produced the root
    if drafter is not None:
        t0 = clock()
        drafter.reset()
        drafter.prefill(input_ids, features)
        result.draft_time += clock() - t0

    # -- decode: one verification pass per step ----------------------------------------------------
    no_candidates = torch.empty(0, dtype=torch.long)
    while root not in eos and length < prompt_len + max_new_tokens:
        remaining = prompt_len + max_new_tokens - length
        step_tree = tree.truncate(remaining - 1)  # deeper nodes could never be committed
        if drafter is not None and len(step_tree) > 0:
            t0 = clock()
            proposal = drafter.propose(sequence[:, :length], feature, step_tree, sampling, generator)
            result.draft_time += clock() - t0
        else:  # plain decoding: the root alone
            proposal = Proposal(step_tree, no_candidates)
        past = length - 1
        tokens = torch.cat([sequence[0, past:length], proposal.tokens.to(device)])  # [N]: root + candidates
        # a chain is verified with the model's own causal mask and positions (no mask to build per step), except
        # under flex_attention, where the model would run create_block_mask every step and the run's kept
        # block-mask parts are cheaper; a tree takes one mask per kind of layer (full attention, sliding window)
        tree_inputs = {} if proposal.tree.is_chain and attn_implementation != "flex_attention" else {
            "attention_mask": tree_masks(cache, proposal.tree, past, attn_implementation=attn_implementation,
                                         dtype=target.dtype, device=device, reuse=mask_parts),
            "position_ids": tree_position_ids(proposal.tree, past, device=device)}
        out, features = forward(input_ids=tokens[None], **tree_inputs)
        accepted = walk(out.logits[0], proposal, sampling, acceptance=acceptance, generator=generator)
        # the commit works on host lists: a handful of tiny tensor ops per step costs more than the lists
        path = accepted.path.tolist()  # accepted nodes in depth order, root excluded
        keep = [0, *path]  # tree-node offsets the caches keep, root first
        keep_tree_path(cache, past, keep)

        drafted = proposal.tokens.tolist()
        new = [drafted[i - 1] for i in path] + [accepted.next_token]
        new = new[:remaining]
        for i, token in enumerate(new):
            if token in eos:
                new = new[: i + 1]
                break
        sequence[0, length : length + len(new)] = torch.tensor(new, device=device)
        length += len(new)
        result.accept_lengths.append(len(new))
        root = new[-1]
        if needs_features:  # [1, k + 1, L·h]: a chain prefix is a view, anything else a gather
            kept = features[:, : len(keep)] if keep == list(range(len(keep))) else \
                features[:, torch.tensor(keep, device=device)]
        if drafter is not None and len(step_tree) > 0:
            t0 = clock()
            drafter.accept(accepted.path, kept if needs_features else None)
            result.draft_time += clock() - t0
        if needs_features:
            feature = kept[:, -1]  # the state that produced the new root

    result.sequences = sequence[:, :length]
    result.wall_time = clock() - t_start
    return result
