"""Validation at the door of the decoding loop (treespec/generate.py): every argument is checked (and normalised
where the intent is clear) before any model runs, so a mistake is an error that names the argument, the value and
what is accepted, never an error from deep inside torch or a silently wrong result. ``check_arguments`` checks
every argument but the tree: planning (treespec/planning/resolve.py) calls it before it measures anything for a
tree spec, and ``check_inputs`` calls it again with the resolved tree.

Normalised: ``input_ids`` as a list of ints, a [P] or [1, P] tensor or numpy array, a [b, P] tensor (with an
``attention_mask`` [b, P] when its prompts are left-padded, transformers' convention) or a list of 1-D prompts,
left-padded here with the pad id (``pad_token_id``, else the target's generation config's or config's, else the first
eos id, else 0); ``eos_token_id`` as an int, a numpy integer, an integer tensor or any iterable of ints (list, tuple,
set); ``tree`` as a Tree, a DynamicTree or a TreesByBatch (a tree-spec dict is resolved before the loop, by
treespec.planning.resolve). Refused: a target that is not a causal LM with an LM head, a target in training mode
(dropout would make its output random), ALiBi models (their position biases cannot follow a tree), an attention
implementation that cannot take a tree mask, flex_attention on CPU, cascade attention where it cannot run
(treespec/cascade.py: flash-attn missing or no CUDA for "treespec_cascade"; sliding windows, soft-capped logits,
hybrid targets), a target whose cache layers cannot be rolled back to an accepted path (recurrent state: linear
attention, state-space and convolution layers; see treespec/layer_types.py), named with the layer types, right
padding, and a batch of rows on a target with sliding-window layers (their windows count slots, which differ per row),
and ``compile`` on a target whose passes cannot be static graphs (treespec/static_pass.py)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treespec.batch_trees import TreesByBatch
from treespec.cascade import CASCADE_ATTENTION, check_cascade_target
from treespec.drafter import Drafter
from treespec.dynamic_tree import DynamicTree
from treespec.layer_types import check_rollback, is_hybrid, sliding_window
from treespec.sampling import Sampling
from treespec.static_pass import compile_options
from treespec.timing import StepTimer
from treespec.tree import Tree
from treespec.visibility import TREE_MASK_ATTENTION
from treespec.walker import ACCEPTANCE_MODES


@dataclass
class Arguments:
    """Every argument of the loop but the tree, checked."""

    input_ids: torch.Tensor          # LongTensor [b, P] on the target's device, left-padded (no all-padding column)
    attention_mask: torch.Tensor | None  # LongTensor [b, P]: 0 on left padding; None when there is none
    prompt_lengths: list[int]        # each row's prompt tokens
    given: torch.Tensor              # LongTensor [b, P'] the prompts as given (padded), the output's first columns
    pad_token_id: int                # after a row's eos in the output (and left padding of a list of prompts)
    max_new_tokens: int
    drafter: Drafter | None          # None when the tree is empty: plain decoding, no drafter prefill or features
    sampling: Sampling
    eos: frozenset[int]
    compile: dict | None             # torch.compile's arguments for static passes (treespec/static_pass.py), or None
    positions_left: int | None       # the fewest positions the target or the drafter has past prompt + budget

    @property
    def first_prompt(self) -> torch.Tensor:
        """[1, P]: the first prompt without its padding, on the target's device (what a plan measures on)."""
        return self.input_ids[:1] if self.attention_mask is None else self.input_ids[:1, self.attention_mask[0].bool()]


@dataclass
class Inputs(Arguments):
    tree: Tree | DynamicTree | TreesByBatch  # what every step verifies (Tree.chain(0) without a drafter)
    whole_trees: bool                # the last steps verify the whole tree (generate's step_tree_of)


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def vocab_size(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


def token_ids(value, name: str) -> list[int]:
    """A flat list of token ids from an int, a numpy integer, an integer tensor, or a list, tuple, set or other
    iterable of those. A nested list is refused: it is a batch of prompts, never one sequence."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer token ids, got a {value.dtype} tensor")
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [int(value)]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
        values = list(value)
        if any(isinstance(v, Iterable) and not (isinstance(v, torch.Tensor) and v.dim() == 0) for v in values):
            raise ValueError(f"{name} must be a flat sequence of token ids, got a nested one ({_short(value)})")
        return [i for v in values for i in token_ids(v, name)]
    raise ValueError(f"{name} must be token ids (an int, a sequence of ints or an integer tensor), got {value!r}")


def pad_id(target, pad_token_id, eos: list[int]) -> int:
    """The pad id: ``pad_token_id``, else the target's generation config's or config's, else the first eos id
    (as transformers' generate), else 0."""
    candidates = [pad_token_id, getattr(getattr(target, "generation_config", None), "pad_token_id", None),
                  getattr(target.config, "pad_token_id", None), *eos[:1], 0]
    return next(token_ids(c, "pad_token_id")[0] for c in candidates if c is not None and token_ids(c, "pad_token_id"))


def is_prompt_list(input_ids) -> bool:
    """A list of prompts (1-D tensors or arrays, lists of ints), not one prompt of ints."""
    return isinstance(input_ids, (list, tuple)) and len(input_ids) > 0 and \
        all((isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim >= 1) or
            (isinstance(p, Sequence) and not isinstance(p, (str, bytes))) for p in input_ids)


def left_padded(prompts, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A list of 1-D prompts → (input_ids [b, P], attention_mask [b, P]), left-padded with ``pad``."""
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (torch.Tensor, np.ndarray)) and prompt.ndim > 1:
            raise ValueError(f"input_ids[{i}] must be one prompt (1-D), got shape {tuple(prompt.shape)}")
        rows.append(token_ids(prompt, "input_ids"))
    if not all(rows):
        raise ValueError(f"input_ids[{[len(r) for r in rows].index(0)}] is empty: give at least one token")
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def check_attention_mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor | None:
    """attention_mask [b, P] of 0/1 (or bool) with left padding only → LongTensor, or None when it pads nothing."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.tensor(attention_mask)
    if attention_mask.dim() == 1:
        attention_mask = attention_mask[None]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(f"attention_mask must be an integer or bool tensor of 0 and 1, got a {attention_mask.dtype} "
                         "tensor: convert it with .long() (transformers' tokenizers return int64)")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (prompt token), as transformers' tokenizers "
                         "return it")
    mask = attention_mask.long().cpu()
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask pads on the right: decoder-only generation needs left padding (a "
                         "tokenizer with padding_side='left'), as in transformers' generate")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row {empty[0]} of attention_mask masks the whole prompt: give at least one token per row")
    return None if bool(mask.all()) else mask


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_input_ids(input_ids, target, attention_mask=None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """→ (input_ids [b, P], attention_mask [b, P] or None when nothing is padded)."""
    if isinstance(input_ids, np.ndarray) and input_ids.dtype != object:
        input_ids = torch.as_tensor(input_ids)
    if isinstance(input_ids, (set, frozenset, Mapping)):
        raise ValueError(f"input_ids must be ordered token ids (a list, a tuple or a tensor), got a "
                         f"{type(input_ids).__name__}")
    if is_prompt_list(input_ids):
        if attention_mask is not None:
            raise ValueError("a list of prompts is padded here: give no attention_mask with it")
        input_ids, attention_mask = left_padded(input_ids, pad)
    elif not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(token_ids(input_ids, "input_ids"), dtype=torch.long)[None]
    elif input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids holds no prompt: give at least one row")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    mask = check_attention_mask(attention_mask, input_ids)
    vocab = vocab_size(target)
    real = input_ids if mask is None else input_ids[mask.to(input_ids.device).bool()]  # padding may be any id
    low, high = int(real.min()), int(real.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}) (the target's vocabulary), got ids from {low} to {high}")
    return input_ids.long(), mask


def check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_sampling(temperature, top_p) -> Sampling:
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    return Sampling(float(temperature), float(top_p))


def uses_alibi(config) -> bool:
    """Whether the model adds ALiBi biases (Press et al. 2022) instead of rotating positions: Bloom, Falcon
    with ``alibi=True``, MPT with ``attn_config.alibi``, configs naming ``position_embedding_type="alibi"``."""
    attn = getattr(config, "attn_config", None)
    attn_alibi = attn.get("alibi") if isinstance(attn, Mapping) else getattr(attn, "alibi", False)
    return (getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True
            or attn_alibi is True or getattr(config, "position_embedding_type", None) == "alibi")


def check_model(target) -> None:
    """A transformers causal LM with an LM head, whose positions a tree mask can carry."""
    if not isinstance(target, torch.nn.Module) or not hasattr(target, "config") or \
            not hasattr(target, "get_output_embeddings"):
        raise ValueError(f"target must be a transformers causal LM (e.g. AutoModelForCausalLM.from_pretrained(...)), "
                         f"got {type(target).__name__}")
    if target.get_output_embeddings() is None:
        raise ValueError(f"target {type(target).__name__} has no LM head (a base model gives hidden states, not "
                         "logits): load it with AutoModelForCausalLM")
    if uses_alibi(target.config):
        # ALiBi models build their biases from a 2-D padding mask's cumulative sum; a tree mask gives them no
        # per-node distances, so their attention would be wrong (transformers fails inside the model)
        raise ValueError(f"target {type(target).__name__} ({target.config.model_type}) uses ALiBi position biases, "
                         "which treespec's tree masks do not carry: use a model with rotary or learned positions")


def check_target(target) -> None:
    if target.training:
        raise ValueError("the target is in training mode (dropout makes its output random, so nothing would equal "
                         "its greedy decoding): call target.eval() first")
    check_rollback(target)  # state treespec cannot roll back is refused here, naming its layer types
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in TREE_MASK_ATTENTION:
        raise ValueError(f"attention implementation {impl!r} cannot take a tree mask; load the target with "
                         "attn_implementation='sdpa' (or 'eager'; 'flex_attention' or 'treespec_cascade' on GPU)")
    if impl == "flex_attention" and target.device.type == "cpu":
        # torch 2.13's inductor fails on CPU: CppCompileError for tree masks, an out-of-bounds index in the
        # compiled kernel for the decode steps of a plain chain (tests/core/test_gpu.py's CPU dry run found both)
        raise ValueError("flex_attention runs on CUDA only here: load the target with attn_implementation='sdpa' "
                         "on CPU")
    if impl in CASCADE_ATTENTION:
        check_cascade_target(target.config, target.device)
        if is_hybrid(target.config):
            raise ValueError(f"{impl} is not verified on hybrid targets ({target.config.model_type}): load the target "
                             "with attn_implementation='sdpa'")
        window = sliding_window(target.config)
        if window is not None:
            raise ValueError(f"{impl} has no sliding windows and {target.config.model_type} has a window of "
                             f"{window}: load the target with attn_implementation='sdpa'")


def check_tree(tree, drafter) -> Tree | DynamicTree | TreesByBatch:
    if isinstance(tree, TreesByBatch):  # each size's tree as if it were the only one
        if drafter is None and tree.speculates:
            raise ValueError(f"{tree!r} has candidates but no drafter was given to propose them")
        if drafter is None or not tree.speculates:
            return Tree.chain(0)
        for size, each in tree.trees.items():
            try:
                check_tree(each, drafter)
            except ValueError as err:
                raise ValueError(f"{tree!r} at batch size {size}: {err}") from None
        return tree
    if drafter is None and tree is None:
        return Tree.chain(0)
    # a drafter's own default is named as such: "tree must be ..." once blamed a tree= nobody gave
    what = "tree" if tree is not None else f"{type(drafter).__name__}'s default_tree"
    tree = drafter.default_tree if tree is None else tree
    if isinstance(tree, Mapping):  # the loop never plans (docs/design.md, "Planning apart from decoding")
        raise ValueError(f"the decoding loop takes a resolved tree, got the tree spec {tree}: treespec.generate "
                         "resolves specs before decoding (treespec.planning.resolve.plan_tree)")
    if not isinstance(tree, (Tree, DynamicTree)):
        raise ValueError(f"{what} must be a Tree, a DynamicTree, a TreesByBatch or a tree-spec dict, got "
                         f"{type(tree).__name__}: {tree!r}")
    if drafter is None:
        if len(tree) > 0:
            raise ValueError(f"tree {tree!r} has candidates but no drafter was given to propose them")
        return Tree.chain(0)
    if isinstance(tree, DynamicTree) and not drafter.grows_dynamic_trees:
        raise ValueError(f"{type(drafter).__name__} cannot grow {tree!r}: give it a static Tree")
    limit = drafter.max_tree_depth
    if limit is not None and isinstance(tree, Tree) and tree.depth > limit:  # whatever max_new_tokens cuts it to
        note = f": {drafter.max_tree_depth_note}" if drafter.max_tree_depth_note else ""
        raise ValueError(f"{what} {tree!r} is deeper than the {limit} levels {type(drafter).__name__} can fill{note}")
    return tree


def check_batch(target, drafter, batch_size: int) -> None:
    """A batch of rows shares one slot axis (treespec/cache.py): a sliding window, which counts slots, would
    differ per row."""
    if batch_size == 1:
        return
    if is_hybrid(target.config):
        raise ValueError(f"a batch of {batch_size} prompts cannot be decoded on {target.config.model_type}'s "
                         "recurrent layers yet (treespec/recurrent.py verifies one row): call generate once per prompt")
    window = sliding_window(target.config)
    if window is not None:
        raise ValueError(f"a batch of {batch_size} prompts cannot be decoded on {target.config.model_type}'s "
                         f"sliding-window layers (window {window}) yet: call generate once per prompt")
    if drafter is not None:
        drafter.check_batch(batch_size)


def check_arguments(target, input_ids, *, drafter, max_new_tokens, temperature, top_p, eos_token_id, generator,
                    acceptance, observer=None, attention_mask=None, pad_token_id=None, compile=False) -> Arguments:
    """Every generate() argument but the tree, checked; see the module docstring."""
    if drafter is not None and not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must implement treespec.drafter.Drafter, got {type(drafter).__name__}")
    if observer is not None and not isinstance(observer, StepTimer):
        raise ValueError(f"observer must be a treespec.timing.StepTimer or None, got {observer!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {generator!r}")
    if acceptance not in ACCEPTANCE_MODES:
        raise ValueError(f"unknown acceptance mode {acceptance!r}; expected one of {ACCEPTANCE_MODES}")
    check_model(target)
    max_new_tokens = check_count(max_new_tokens, "max_new_tokens")
    sampling = check_sampling(temperature, top_p)
    eos_ids = token_ids(eos_token_id, "eos_token_id") if eos_token_id is not None else []
    eos = frozenset(eos_ids)
    outside = sorted(i for i in eos if not 0 <= i < vocab_size(target))
    if outside:  # an id no step can emit would never stop decoding
        raise ValueError(f"eos_token_id must lie in [0, {vocab_size(target)}) (the target's vocabulary), got {outside}")
    pad = pad_id(target, pad_token_id, eos_ids)
    given, mask = check_input_ids(input_ids, target, attention_mask, pad)
    lengths = [given.shape[1]] * given.shape[0] if mask is None else mask.sum(-1).tolist()
    check_target(target)
    compile_with = compile_options(compile, target)
    check_batch(target, drafter, given.shape[0])
    total = max(lengths) + max_new_tokens
    limits = [("target", max_positions(target.config))]
    if drafter is not None:
        drafter.check_target(target)
        limits.append((type(drafter).__name__, drafter.max_positions))
    for who, limit in limits:
        if limit is not None and total > limit:
            raise ValueError(f"prompt ({max(lengths)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"{who}'s {limit} positions")
    columns = given.shape[1] - max(lengths)  # padding in every row: the prefill skips it
    ids = given[:, columns:].to(target.device)
    if mask is not None:
        mask = mask[:, columns:]
        mask = None if bool(mask.all()) else mask.to(target.device)
    if mask is not None:  # padding may hold any id (-100, the vocabulary size): the model sees a real one there
        ids = ids.masked_fill(mask == 0, pad if 0 <= pad < vocab_size(target) else 0)
    left = [limit - total for _, limit in limits if limit is not None]
    return Arguments(ids, mask, lengths, given, pad, max_new_tokens, drafter, sampling, eos, compile_with,
                     min(left) if left else None)


def check_inputs(target, input_ids, *, tree, **arguments) -> Inputs:
    """Every generate() argument (``check_arguments``'s) and the resolved ``tree``, checked."""
    checked = check_arguments(target, input_ids, **arguments)
    tree = check_tree(tree, checked.drafter)
    vocab = vocab_size(target)
    for each in tree.trees.values() if isinstance(tree, TreesByBatch) else (tree,):
        if isinstance(each, Tree) and len(each) and int(each.ranks.max()) >= vocab:
            raise ValueError(f"{each!r} asks for rank {int(each.ranks.max())} but the vocabulary has {vocab} tokens")
    # nothing to draft (e.g. tree=auto chose not to speculate): decode as vanilla, without the drafter
    speculates = not (isinstance(tree, Tree) and len(tree) == 0)
    # a static pass verifies the whole tree up to the end, keeping its graph, where its positions stay in range
    whole = checked.compile is not None and (checked.positions_left is None or tree.depth <= checked.positions_left)
    fields = {f.name: getattr(checked, f.name) for f in dataclasses.fields(Arguments)}
    return Inputs(**{**fields, "drafter": checked.drafter if speculates else None}, tree=tree, whole_trees=whole)
