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

import time
from dataclasses import dataclass, field

import torch

from treespec.cache import keep_tree_path
from treespec.heads.base import Proposal
from treespec.sampling import Sampling, probs, sample
from treespec.tree import Tree
from treespec.verify import walk

_TREE_MASK_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


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


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def check_inputs(target, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"batch size {input_ids.shape[0]} is not supported yet: treespec decodes one sequence "
                         "at a time (call generate once per prompt)")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = max_positions(target.config)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"target's {limit} positions")
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in _TREE_MASK_IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {impl!r} cannot take a tree mask; load the target with "
                         "attn_implementation='sdpa' (or 'eager'; 'flex_attention' on GPU)")


def _tree_mask(tree: Tree, past_len: int, target):
    from treespec.masks import tree_attention_mask, tree_block_mask

    if target.config._attn_implementation == "flex_attention":
        return tree_block_mask(tree, past_len, device=target.device)
    return tree_attention_mask(tree, past_len, dtype=target.dtype, device=target.device)


@torch.no_grad()
def generate(
    target,
    input_ids: torch.Tensor,
    *,
    drafter=None,
    tree: Tree | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    acceptance: str = "rejection",
) -> GenerationResult:
    """Decode up to ``max_new_tokens`` after ``input_ids`` [1, P] with tree speculation.

    ``tree`` is the static candidate tree (default: the drafter's ``default_tree``); ``acceptance`` is
    "rejection" (lossless: greedy at temperature 0, rejection sampling otherwise) or "typical"
    (Medusa's typical acceptance: faster, NOT lossless).
    """
    from transformers import DynamicCache

    from treespec.masks import tree_position_ids

    sampling = Sampling(temperature, top_p)
    check_inputs(target, input_ids, max_new_tokens)
    if drafter is not None:
        drafter.check_target(target)
        tree = tree if tree is not None else drafter.default_tree
        if not isinstance(tree, Tree) and not drafter.grows_dynamic_trees:
            raise ValueError(f"{type(drafter).__name__} cannot grow {tree!r}: give it a static Tree")
    elif tree is not None and len(tree) > 0:
        raise ValueError(f"{tree!r} has candidates but no drafter was given to propose them")
    tree = tree if tree is not None else Tree.chain(0)
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    needs_features = drafter is not None and drafter.needs_features
    feature_layers = tuple(drafter.feature_layers) if needs_features else ()
    device = target.device

    prompt_len = input_ids.shape[1]
    sequence = torch.empty(1, prompt_len + max_new_tokens, dtype=torch.long, device=device)  # [1, L_max]
    sequence[:, :prompt_len] = input_ids
    result = GenerationResult(sequences=sequence, prompt_length=prompt_len)
    t_start = time.perf_counter()

    def forward(**kwargs):
        t0 = time.perf_counter()
        out = target(cache=cache, use_cache=True, output_hidden_states=needs_features, **kwargs)
        result.target_time += time.perf_counter() - t0
        if not needs_features:
            return out, None
        # [1, n, L·h]: the drafter's feature layers side by side (EAGLE-3 fuses low, mid and high ones)
        return out, torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)

    # -- prefill: the prompt's last logits give the first new token (the first root) --------------
    cache = DynamicCache(config=target.config)
    out, features = forward(input_ids=input_ids.to(device))  # features: [1, P, L·h]
    p_target = probs(out.logits[0, -1], sampling)  # [V]
    root = int(p_target.argmax() if sampling.greedy else sample(p_target, generator))
    length = prompt_len
    sequence[0, length] = root
    length += 1
    feature = features[:, -1] if needs_features else None  # [1, h]: the state that produced the root
    if drafter is not None:
        t0 = time.perf_counter()
        drafter.reset()
        drafter.prefill(input_ids, features)
        result.draft_time += time.perf_counter() - t0

    # -- decode: one verification pass per step ----------------------------------------------------
    while root not in eos and length < prompt_len + max_new_tokens:
        remaining = prompt_len + max_new_tokens - length
        step_tree = tree.truncate(remaining - 1)  # deeper nodes could never be committed
        if drafter is not None and len(step_tree) > 0:
            t0 = time.perf_counter()
            proposal = drafter.propose(sequence[:, :length], feature, step_tree, sampling, generator)
            result.draft_time += time.perf_counter() - t0
            candidates = proposal.tokens.to(device)
        else:
            proposal = Proposal(step_tree, torch.empty(0, dtype=torch.long))
            candidates = proposal.tokens.to(device)
        past = length - 1
        tokens = torch.cat([sequence[0, past:length], candidates])  # [N]: root + candidates
        # a chain is verified with the model's own causal mask and positions (no mask to build per step)
        tree_inputs = {} if proposal.tree.is_chain else {
            "attention_mask": _tree_mask(proposal.tree, past, target),
            "position_ids": tree_position_ids(proposal.tree, past, device=device)}
        out, features = forward(input_ids=tokens[None], **tree_inputs)
        accepted = walk(out.logits[0], proposal, sampling, acceptance=acceptance, generator=generator)
        keep = torch.cat([torch.zeros(1, dtype=torch.long), accepted.path.cpu()])  # [k + 1], root first
        keep_tree_path(cache, past, keep.to(device))

        new = candidates[accepted.path.to(device) - 1].tolist() + [accepted.next_token]
        new = new[:remaining]
        for i, token in enumerate(new):
            if token in eos:
                new = new[: i + 1]
                break
        sequence[0, length : length + len(new)] = torch.tensor(new, device=device)
        length += len(new)
        result.accept_lengths.append(len(new))
        root = new[-1]
        if drafter is not None and len(step_tree) > 0:
            t0 = time.perf_counter()
            drafter.accept(accepted.path, features[:, keep.to(device)] if needs_features else None)
            result.draft_time += time.perf_counter() - t0
        if needs_features:
            feature = features[:, keep[-1]]  # the state that produced the new root

    result.sequences = sequence[:, :length]
    result.wall_time = time.perf_counter() - t_start
    return result
