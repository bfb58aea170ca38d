"""The DFlash drafter's model (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv 2602.06036), in z-lab's published layout. heads/dflash/drafter.py's ``DFlash`` drives it.

A few decoder layers fill a whole block at once: the last committed token (the root) followed by b − 1 mask tokens,
embedded with the target's frozen table, at positions root .. root + b − 1; the block attends to itself without a
causal mask and to the context, the target's hidden states at the drafter's target layers for every token before
the root, side by side and projected (heads/dflash/block_layer.py):

    context = hidden_norm(fc(cat(h_{l_1}, ..., h_{l_K})))        K·H → H, per committed token before the root
    out     = norm(layers(embed([root, mask, ..., mask]), context))
    logits  = lm_head(out[1:])                                    the target's lm_head; position k is depth k

One pass gives a distribution for every depth 1..b − 1 of the block; the root's own output is not used. The
embeddings and lm_head are the target's (not stored).

**The root's feature in the block** (``root_feature``, treespec's, not z-lab's). In z-lab's layout the target's
features enter as keys and values only, so in the first layer a mask position's query is the mask token's embedding:
the same at every anchor, whatever the context. EAGLE's drafter reads the feature that produced the root at its own
input. With ``root_feature`` the block's input adds that feature, projected by the same ``fc`` and its own norm
(``root_norm``, zero at first, so a drafter grown from one without it starts with its predictions):

    embed([root, mask, ..., mask]) + root_norm(fc(cat(h_{l_1}, ..., h_{l_K})[root − 1]))     at every block position

No serving stack computes it, so such a drafter does not export (heads/dflash/upstream.py).

**A training vocabulary** (``drafter.train_vocab``: N, heads/dflash/objective.py): the block learns to fill only the
N most frequent tokens of its training data, scored through those N rows of the target's lm_head; on a small target
the full head is most of a training step (docs/training.md, DFlash). ``vocab`` (a DraftVocab) then travels with the
weights as ``draft_vocab.safetensors`` and is the drafter's FR-Spec vocabulary when decoding (heads/dflash/drafter.py).

**Target layers.** ``target_layer_ids`` count decoder-layer OUTPUTS as z-lab does: id i is transformers'
``hidden_states[i + 1]`` (``feature_layers``, what generate() passes the drafter). The default picks K = the number
of draft layers evenly between layer 1 and L − 3 (one draft layer: L // 2), z-lab's ``build_target_layer_ids``;
a target too shallow for that (L < 4) takes them evenly over 0..L − 1.

**Weights**, under z-lab's names: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input_layernorm,post_attention_layernorm}.weight``, ``norm.weight`` (and treespec's
``root_norm.weight``). ``norm`` starts as the target's final norm where it computes the same (its lm_head reads
normed states); everything else is freshly initialised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from treespec.heads.checkpoints.drafter_folder import (
    architecture,
    check_fits_target,
    load_drafter,
    save_drafter,
    vocab_size_of,
)
from treespec.heads.dflash.block_layer import DFlashLayer, held, keys_values, layer_config, layer_values
from treespec.heads.drafting.vocab import TrainingVocab
from treespec.heads.eagle3.layer import final_norm
from treespec.io import check_float_weights
from treespec.visibility import relation_mask


def default_target_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """z-lab's choice of ``count`` target layers (decoder-layer outputs) for an L-layer target: L // 2 for one,
    else evenly from layer 1 to L − 3, rounded; evenly over 0..L − 1 when L − 3 < 1."""
    n, count = int(num_target_layers), int(count)
    if count == 1:
        return (n // 2,)
    start, end = (1, n - 3) if n - 3 > 1 else (0, n - 1)
    return tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))


def resolve_target_layers(ids, num_target_layers: int, count: int) -> tuple[int, ...]:
    """Explicit decoder-layer output ids (0..L − 1), or None → ``default_target_layers``; anything else is a
    ValueError naming the target's range."""
    n = int(num_target_layers)
    if ids is None:
        return default_target_layers(n, count)
    # a Sequence, not list/tuple only: a hydra override (drafter.target_layer_ids=[...]) arrives as a ListConfig
    if isinstance(ids, str) or not isinstance(ids, Sequence) or any(isinstance(i, bool) or not isinstance(i, int)
                                                                  for i in ids):
        raise ValueError(f"DFlash target_layer_ids must be a list of decoder-layer ids (0..{n - 1}), got {ids!r}")
    ids = tuple(int(i) for i in ids)
    if not ids or any(not 0 <= i < n for i in ids):
        raise ValueError(f"DFlash target_layer_ids {list(ids)} must be decoder-layer outputs of the {n}-layer target: "
                         f"ids in 0..{n - 1} (id i is hidden_states[i + 1])")
    return ids


class DFlashModel(TrainingVocab, nn.Module):
    """fc + hidden_norm over the target's features, ``num_layers`` DFlash layers, norm; the target's embeddings
    and lm_head (module docstring)."""

    #: the drafter kind that drives it, and its folder's names: dflash_config.json beside dflash.safetensors
    kind = "dflash"

    def __init__(self, target, *, block_size: int = 16, num_layers: int = 1, target_layer_ids=None,
                 mask_token_id: int | None = None, layer: dict | None = None, root_feature: bool = False):
        """block_size: tokens per block (the root and block_size − 1 mask tokens: the deepest tree it fills);
        target_layer_ids: decoder-layer outputs it reads (None: z-lab's default for ``num_layers`` of them);
        mask_token_id: the target token id whose embedding marks a position to fill (None: the vocabulary's last,
        a reserved or padding id in large vocabularies); layer: layer values apart from the target's
        (heads/dflash/block_layer.py's ``LAYER_FIELDS``); root_feature: the block's input adds the root's feature
        (module docstring)."""
        super().__init__()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"DFlash block_size must be an integer >= 2 (the root and at least one token to fill), "
                             f"got {block_size!r}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"DFlash num_layers must be an integer >= 1, got {num_layers!r}")
        if not isinstance(root_feature, bool):
            raise ValueError(f"DFlash root_feature must be true or false, got {root_feature!r}")
        tc = target.config.get_text_config(decoder=True)
        n, h, vocab = tc.num_hidden_layers, tc.hidden_size, vocab_size_of(target)
        self.block_size = block_size
        self.target_layer_ids = resolve_target_layers(target_layer_ids, n, num_layers)
        self.mask_token_id = vocab - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"DFlash mask_token_id {self.mask_token_id} is not a token of the target's {vocab}-token "
                             "vocabulary")
        self.layer_config = layer_config(target, num_layers, layer)
        self.config = {"block_size": block_size, "num_hidden_layers": num_layers,
                       "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                       "layer": layer_values(self.layer_config), "architecture": architecture(target),
                       "root_feature": root_feature}
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=self.layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(self.layer_config, i) for i in range(num_layers))
        self.norm = final_norm(target, self.layer_config, "llama")
        self.root_norm = Qwen3RMSNorm(h, eps=self.layer_config.rms_norm_eps) if root_feature else None
        if root_feature:
            nn.init.zeros_(self.root_norm.weight)  # adds nothing at first (module docstring)
        self.rotary_emb = Qwen3RotaryEmbedding(config=self.layer_config)
        # lists keep the target's frozen table and head out of our parameters and state_dict
        self._embed, self._lm_head = [target.get_input_embeddings()], [target.get_output_embeddings()]
        self.to(target.device)
        for p in self.parameters():  # parameters only: rotary inv_freq stays float32, as the target's
            p.data = p.data.to(target.dtype)
        self.requires_grad_(True)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target ``hidden_states`` indices it reads (generate()'s convention): each target layer id + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head[0]

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features side by side [..., K·H] → the context the layers read [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def block_ids(self, roots: torch.Tensor) -> torch.Tensor:
        """Roots [b] → blocks [b, block_size]: each root, then mask tokens."""
        blocks = roots.new_full((roots.shape[0], self.block_size), self.mask_token_id)
        blocks[:, 0] = roots
        return blocks

    def forward(self, block_ids: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                context_positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                cache=None, root_features: torch.Tensor | None = None) -> torch.Tensor:
        """The layers over blocks ``block_ids`` [b, q] at ``positions`` [b or 1, q] → normed outputs [b, q, H].
        ``root_features`` [b, q or 1, K·H]: with ``root_feature``, the target's features that produced each query's
        root (module docstring); ignored without.

        The context is ``features`` [b, c, K·H], the target's features of context tokens at ``context_positions``
        [b or 1, c], or with ``features`` None what ``cache`` holds (``add_context``; nothing without one).
        ``attention_mask``: float additive [b or 1, 1, q, c + q] over the context's keys, then the blocks'; None:
        every query sees every key."""
        x = self._embed[0](block_ids).to(self.dtype)
        if self.root_norm is not None:
            if root_features is None:
                raise ValueError("this DFlash drafter adds the root's feature to its block (root_feature): pass "
                                 "root_features")
            x = x + self.root_norm(self.fc(root_features.to(self.dtype)))
        rope = self.rotary_emb(x, positions)
        if features is not None:
            context = self.project(features)
            context_rope = self.rotary_emb(x, context_positions)
        for i, layer in enumerate(self.layers):
            kv = keys_values(layer.self_attn, context, context_rope) if features is not None else held(cache, i)
            x = layer(x, rope, attention_mask, kv)
        return self.norm(x)

    def add_context(self, features: torch.Tensor, positions: torch.Tensor, cache) -> None:
        """Append the context keys and values of the target's ``features`` [b, c, K·H] at ``positions`` [b or 1, c]
        to every layer of ``cache`` (each layer's depend on the features alone)."""
        context = self.project(features)
        rope = self.rotary_emb(context, positions)
        for i, layer in enumerate(self.layers):
            cache.update(*keys_values(layer.self_attn, context, rope), i)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Normed outputs [..., H] → logits over the target's vocabulary [..., V] (its own lm_head; -inf outside a
        training vocabulary)."""
        return self.lm_head(out) if self.vocab is None else self.vocab.scatter(self.draft_logits(out))

    def anchored(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                 positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced blocks over whole windows, many per row in one pass (training, rank accuracy): window
        ``input_ids`` [b, S] with the target's ``features`` [b, S, K·H], a block rooted at each of ``anchors`` [b, m]
        (positions 1..S − 1) → outputs [b, m, block_size, H]. Block i sees the context of its anchor a, positions < a
        (of a's own conversation with a packed batch's ``segments`` [b, S]), and itself whole: what decoding from
        root a sees. ``positions`` [b, S]: a packed batch's per-conversation position ids (None: 0..S − 1)."""
        b, s = input_ids.shape
        m, size = anchors.shape[1], self.block_size
        device = input_ids.device
        local = torch.arange(s, device=device)[None].expand(b, s) if positions is None else positions
        roots = input_ids.gather(1, anchors)  # [b, m]
        blocks = self.block_ids(roots.flatten()).view(b, m * size)
        offsets = torch.arange(size, device=device)
        block_positions = (local.gather(1, anchors)[:, :, None] + offsets).flatten(1)  # [b, m·size]
        context = torch.arange(s, device=device)[None, None] < anchors[:, :, None]  # [b, m, S]: before the anchor
        if segments is not None:
            context &= segments[:, None, :] == segments.gather(1, anchors)[:, :, None]
        own = torch.eye(m, dtype=torch.bool, device=device)  # [m, m]: a block sees only itself
        seen = torch.cat([context.repeat_interleave(size, dim=1),
                          own.repeat_interleave(size, 0).repeat_interleave(size, 1)[None].expand(b, -1, -1)], dim=2)
        root_features = None
        if self.root_norm is not None:  # the feature at a − 1 produced root a, for each of a block's positions
            before = (anchors - 1)[:, :, None].expand(-1, -1, features.shape[-1])
            root_features = features.gather(1, before).repeat_interleave(size, dim=1)  # [b, m·size, K·H]
        out = self(blocks, features, block_positions, local, relation_mask(seen, dtype=self.dtype),
                   root_features=root_features)
        return out.view(b, m, size, -1)

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        fits(self.config, target)

    def save_pretrained(self, folder) -> None:
        """``dflash.safetensors`` (z-lab's key names) beside ``dflash_config.json`` and, with a training vocabulary,
        ``draft_vocab.safetensors``, each written atomically."""
        save_drafter(self, folder, self.kind, self.config)
        self.save_vocab(folder)

    @classmethod
    def from_pretrained(cls, folder, target) -> DFlashModel:
        """Load a drafter for ``target`` (safetensors only); one built for another target is refused with a
        ValueError naming the differences."""
        config, weights = load_drafter(folder, cls.kind)
        needed = ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id", "layer", "architecture")
        if any(key not in config for key in needed):
            raise ValueError(f"DFlash config in {folder} needs {', '.join(needed)}, got keys {sorted(config)}")
        ids, integer = config["target_layer_ids"], lambda i: isinstance(i, int) and not isinstance(i, bool)
        wrong = [f"{key}={config[key]!r} (not {what})" for key, ok, what in (  # each failed inside fits (TypeError)
            ("target_layer_ids", isinstance(ids, list) and all(map(integer, ids)), "a list of layer ids"),
            ("architecture", isinstance(config["architecture"], dict), "a dict"),
            ("layer", config["layer"] is None or isinstance(config["layer"], dict), "a dict")) if not ok]
        if wrong:
            raise ValueError(f"DFlash config {folder}/dflash_config.json: {', '.join(wrong)}")
        fits(config, target)
        try:
            model = cls(target, block_size=config["block_size"], num_layers=config["num_hidden_layers"],
                        target_layer_ids=config["target_layer_ids"], mask_token_id=config["mask_token_id"],
                        layer=config["layer"], root_feature=config.get("root_feature", False))
            check_float_weights(weights, model, f"DFlash weights in {folder}")
            model.load_state_dict(weights)  # copied into our device and dtype
        except (KeyError, RuntimeError, ValueError) as err:  # missing, unexpected or mis-shaped tensors
            raise ValueError(f"DFlash weights in {folder} do not fit the drafter: {err}") from None
        model.load_vocab(folder)
        return model.eval()


def grow_from(model: DFlashModel, trained: DFlashModel) -> None:
    """Start ``model`` from a trained DFlash ``trained`` with as many layers or fewer (``drafter.init_from``): its
    projection, layers and final norm copied, each layer beyond them the identity at first (zero o_proj and
    down_proj: residual blocks that add nothing), so the grown drafter starts with the trained one's predictions and
    training only has to improve on them; likewise a ``root_norm`` it lacks starts at zero. Anything else the two
    disagree on (block size, target layers, mask token, layer values, a training vocabulary, a root feature the
    trained one has and ``model`` lacks) is a ValueError."""
    if trained.num_layers > model.num_layers:
        raise ValueError(f"DFlash init_from has {trained.num_layers} layers, more than the {model.num_layers} to "
                         "train; set drafter.num_layers to at least that")
    differ = [f"{key} {trained.config[key]!r} (init_from) against {model.config[key]!r}"
              for key in ("block_size", "target_layer_ids", "mask_token_id", "layer", "architecture")
              if trained.config[key] != model.config[key]]
    if trained.root_norm is not None and model.root_norm is None:
        differ.append("root_feature true (init_from) against false")
    if trained.vocab is not None:
        differ.append("a training vocabulary (init_from) against the full one: grow from a full-vocabulary drafter")
    if differ:
        raise ValueError(f"DFlash init_from does not fit the drafter to train: {'; '.join(differ)}")
    missing, unexpected = model.load_state_dict(trained.state_dict(), strict=False)
    assert not unexpected and all(key.startswith("layers.") or key == "root_norm.weight" for key in missing)
    with torch.no_grad():
        if "root_norm.weight" in missing:
            model.root_norm.weight.zero_()
        for layer in model.layers[trained.num_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def fits(config: dict, target) -> None:
    """Raise ValueError naming every difference between the target a drafter was built for and ``target``:
    architecture values (hidden size, vocabulary, layer count, ...) and target layers it lacks."""
    n = target.config.get_text_config(decoder=True).num_hidden_layers
    missing = [i for i in config["target_layer_ids"] if not 0 <= i < n]
    problems = (f"target layers {missing} (drafter) do not exist in a {n}-layer target",) if missing else ()
    check_fits_target("DFlash", config["architecture"], architecture(target), problems)
