"""The EAGLE-3 drafter's model: a feature-fusion drafter with its own reduced-vocabulary head (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test"), in the
published layout. heads/eagle3/drafter.py's ``Eagle3`` drives it.

The drafter fuses three of the target's hidden states (low, mid, high) into one feature and runs one
decoder layer whose attention reads the token and the feature side by side:

    h      = fc(cat(low, mid, high))                    3H → H  (target features only)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))                         2H wide
    h'     = h + o_proj(attention(q/k/v_proj(x)))       q/k/v: 2H → heads, residual = h
    out    = h' + mlp(post_attention_layernorm(h'))     the layer's pre-norm output
    logits = lm_head(norm(out))                         over the draft vocabulary

Entry j of the drafter's sequence pairs committed token x_{j+1} with the target's fused feature at j (as
EAGLE-1: the drafter's sequence is the target's shifted by one, entry j at position j). A tree node
deeper than the root's children pairs its token with its parent's ``out`` (H wide, so no fc): the
drafter runs over its own outputs. Training-time test (heads/training/unroll.py, heads/eagle3/objective.py) trains
exactly that.

**Aux layers.** ``aux_layers`` index transformers' ``hidden_states``: ``hidden_states[i]`` is the INPUT of
decoder layer i (0-based), i.e. the output of layer i - 1; 0 is the embeddings and L (the last) is the
final-norm output. The published default is (2, L//2, L-3) (official EAGLE, vLLM, speculators;
SpecForge's [1, L//2-1, L-4] counts outputs of layers, the same states); ``default_aux_layers`` keeps it
when those are three distinct inputs of layers 1..L-1, and otherwise spreads three indices evenly over
1..L-1 (tiny targets).

**Vocabulary.** The head predicts ``draft_vocab_size`` tokens, the most frequent in the training data
(``build_vocab_map``): draft id d is target id d + d2t[d], and t2d marks the target ids that have a draft
id. The drafter's distribution over the TARGET vocabulary is the draft logits scattered into a
[..., V] tensor of -inf (``logits``): zero probability outside the draft vocabulary, so sampled
candidates (q_draft) and top-k ranks are target ids, and verification stays lossless.

**A Llama layer, as upstream builds it** (heads/eagle3/layer.py): the attention, MLP, norms and rotary
embedding are transformers' Llama classes built with the target's sizes and RoPE, one full-attention layer,
whatever the target, so that vLLM, SGLang and speculators can serve the head; ``layer="target"`` builds them
from the target's own stock classes instead (Qwen2's biases, Qwen3's q/k norms: loadable by treespec only).
Only q/k/v are widened to 2H inputs. Tokens are embedded with the target's frozen table (not in the
state_dict). State-dict keys are the upstream ones: ``fc.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
``lm_head.weight``, buffers ``d2t`` and ``t2d``. ``norm`` and ``lm_head`` start as copies of the
target's final norm and of its lm_head rows for the draft vocabulary (a warm start; both are trained).
"""

from __future__ import annotations

import torch
from torch import nn

from treespec.heads.checkpoints.drafter_folder import (
    architecture,
    check_fits_target,
    load_drafter,
    save_drafter,
    vocab_size_of,
)
from treespec.heads.drafting.lean import LeanProjection
from treespec.heads.drafting.vocab import DraftVocab
from treespec.heads.eagle3.layer import Eagle3Layer, check_layer_choice, final_norm, layer_config_for, rotary_for
from treespec.io import check_float_weights
from treespec.visibility import causal_mask


def default_aux_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, mid and high ``hidden_states`` indices (inputs of decoder layers) for an L-layer
    target: (2, L//2, L-3) as published when those are distinct inputs of layers 1..L-1 (L >= 7), else
    three indices spread evenly over 1..L-1 (repeated when L < 4)."""
    n = int(num_hidden_layers)
    published = (2, n // 2, n - 3)
    if len(set(published)) == 3 and all(1 <= i <= n - 1 for i in published):
        return published
    top = max(n - 1, 1)
    low, mid, high = (round(1 + (top - 1) * k / 2) for k in range(3))
    return low, mid, high


def resolve_aux_layers(aux_layers, num_hidden_layers: int) -> tuple[int, ...]:
    """Explicit indices (negative ones count from the end of ``hidden_states``) → non-negative ones; None
    → ``default_aux_layers``. An index outside 0..L is a ValueError."""
    n = int(num_hidden_layers)
    if aux_layers is None:
        return default_aux_layers(n)
    layers = tuple(int(i) for i in aux_layers)
    if not layers or any(not -(n + 1) <= i <= n for i in layers):
        raise ValueError(f"aux_layers {layers} must index the target's {n + 1} hidden states (hidden_states[i] is "
                         f"the input of decoder layer i: 0 = embeddings .. {n} = the final-norm output)")
    return tuple(i % (n + 1) for i in layers)




def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the ``draft_vocab_size`` most frequent target ids in ``token_counts`` [V] (frequencies
    over the loss-masked training tokens; ties go to the smaller id): heads/drafting/vocab.py's DraftVocab, in
    EAGLE-3's buffers. ``draft_vocab_size == V`` gives the identity (d2t all zero)."""
    vocab = DraftVocab.most_frequent(token_counts, draft_vocab_size)
    return vocab.d2t, vocab.t2d



# -- the model ---------------------------------------------------------------------------------------------
class Eagle3Model(nn.Module):
    """fc(cat(low, mid, high)) → EAGLE-3's decoder layer → norm → lm_head over the draft vocabulary."""

    #: the drafter kind that drives it, and its checkpoint folder's name: eagle3_config.json beside
    #: eagle3.safetensors (heads/checkpoints/drafter_folder.py)
    kind = "eagle3"
    #: no stock decoder stack for heads/drafting/lean.py's LeanDecoder: its layer reads token and feature side by side
    decoder = None

    def __init__(self, target, *, aux_layers=None, vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None,
                 layer: str = "llama"):
        """vocab_map: (d2t, t2d) from ``build_vocab_map``; None = the full target vocabulary. layer: "llama" (the
        default: what every upstream consumer serves) or "target" (the target's own classes; heads/eagle3/layer.py)."""
        super().__init__()
        self.layer = check_layer_choice(layer)
        n_layers, h, vocab = target.config.num_hidden_layers, target.config.hidden_size, vocab_size_of(target)
        self.aux_layers = resolve_aux_layers(aux_layers, n_layers)
        if vocab_map is None:
            vocab_map = (torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool))
        d2t, t2d = (torch.as_tensor(t) for t in vocab_map)
        if t2d.shape != (vocab,):
            raise ValueError(f"vocab_map: t2d has {t2d.numel()} entries for a {vocab}-token target")
        self.draft_vocab = DraftVocab.from_maps(d2t, t2d)  # checks that d2t and t2d agree
        self.vocab_size, self.draft_vocab_size = vocab, d2t.numel()
        self.layer_config = layer_config_for(target, layer)
        self.config = {"draft_vocab_size": self.draft_vocab_size, "vocab_size": vocab, "target_hidden_size": h,
                       "hidden_size": h, "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                       "architecture": architecture(target), "layer": layer}

        self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(target, self.layer_config, layer)
        self.norm = final_norm(target, self.layer_config, layer)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64))
        self.register_buffer("t2d", t2d.to(torch.bool))
        self.rotary_emb = rotary_for(target, self.layer_config, layer)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.draft_ids].float())
        # a list keeps the target's frozen table out of our parameters and state_dict
        self._embed = [target.get_input_embeddings()]
        self.to(target.device)
        for p in self.parameters():  # parameters only: rotary inv_freq stays float32, as the target's
            p.data = p.data.to(target.dtype)
        self.requires_grad_(True)  # the norms copied from a frozen target come frozen

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_ids(self) -> torch.Tensor:
        """LongTensor [draft_vocab_size]: the target id of each draft id."""
        return self.draft_vocab.ids.to(self.d2t.device)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states side by side [..., 3H] → the drafter's input feature [..., H]."""
        return self.fc(target_features)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, *, attention_mask=None, position_ids=None,
                cache=None) -> torch.Tensor:
        """input_ids [b, n] and the features they pair with [b, n, H] (fused target features, or the
        drafter's own outputs) → the layer's pre-norm outputs [b, n, H]. Without ``attention_mask`` the
        attention is causal after whatever ``cache`` holds; positions default to follow it."""
        # (a static pass's cache, treespec/static_pass.py, has no length to read: it always gives mask and positions)
        past = cache.get_seq_length() if cache is not None and (attention_mask is None or position_ids is None) else 0
        n = input_ids.shape[1]
        if attention_mask is None:
            attention_mask = causal_mask(n, past, dtype=hidden.dtype, device=hidden.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=hidden.device)[None]
        embeds = self._embed[0](input_ids).to(hidden.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.midlayer(embeds, hidden, position_embeddings, attention_mask, cache)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [..., H] → logits over the draft vocabulary [..., draft_vocab_size] (training)."""
        return self.lm_head(self.norm(out))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [..., H] → logits over the target vocabulary [..., V] (-inf outside the draft one),
        what drafting proposes from."""
        return self.draft_vocab.scatter(self.draft_logits(out))

    def head(self, lean: bool = False):
        """``logits``, or with ``lean`` the same through a lean projection of lm_head (heads/drafting/lean.py)."""
        if not lean:
            return self.logits
        projection = LeanProjection.of(self.lm_head)
        return lambda out: self.draft_vocab.scatter(projection(self.norm(out)))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states generate() passes (the aux layers), as the Eagle drafter reads them."""
        return self.aux_layers

    # -- persistence ---------------------------------------------------------------------------------
    def check_fits(self, target) -> None:
        fits(self.config, target)

    def save_pretrained(self, folder) -> None:
        """``eagle3.safetensors`` (upstream key names) beside ``eagle3_config.json``, each written atomically."""
        save_drafter(self, folder, self.kind, self.config)

    @classmethod
    def from_pretrained(cls, folder, target) -> Eagle3Model:
        """Load a drafter for ``target`` (safetensors only); one built for another target is refused with a
        ValueError naming the differences."""
        config, weights = load_drafter(folder, cls.kind)
        if "upstream" in config:
            raise ValueError(f"{folder} holds an upstream-layout EAGLE-3 drafter: load it with treespec.heads.load")
        if not (isinstance(config.get("eagle_aux_hidden_state_layer_ids"), list)
                and isinstance(config.get("architecture"), dict)):
            raise ValueError(f"EAGLE-3 config in {folder} needs 'eagle_aux_hidden_state_layer_ids' (a list) and "
                             f"'architecture' (a dict), got keys {sorted(config)}")
        fits(config, target)
        vocab = vocab_size_of(target)
        if "d2t" not in weights and "t2d" not in weights:  # upstream omits the map for the full vocabulary
            weights["d2t"], weights["t2d"] = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
        try:
            model = cls(target, aux_layers=config["eagle_aux_hidden_state_layer_ids"],
                        vocab_map=(weights["d2t"], weights["t2d"]), layer=config.get("layer", "target"))
            check_float_weights(weights, model, f"EAGLE-3 weights in {folder}")
            model.load_state_dict(weights)  # copied into our device and dtype
        except (KeyError, RuntimeError, ValueError) as err:  # a broken map; missing, unexpected or mis-shaped tensors
            raise ValueError(f"EAGLE-3 weights in {folder} do not fit the drafter: {err}") from None
        return model.eval()


def fits(config: dict, target) -> None:
    """Raise ValueError naming every difference between the target a drafter was built for and ``target``:
    architecture values (hidden size, vocabulary, layer count, ...) and aux layers it lacks."""
    n = target.config.num_hidden_layers
    missing = [i for i in config["eagle_aux_hidden_state_layer_ids"] if not 0 <= i <= n]
    problems = (f"aux layers {missing} (drafter) do not exist in a {n}-layer target",) if missing else ()
    check_fits_target("EAGLE-3", config["architecture"], architecture(target), problems)
