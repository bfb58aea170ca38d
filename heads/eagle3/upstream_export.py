"""EAGLE-3 drafters written in other projects' layouts (the writing half of heads/eagle3/upstream.py, whose
docstring describes the layouts and the aux-layer conventions): ``eagle3_to_upstream`` gives the config.json and
tensors each consumer loads (SGLang, vLLM, speculators, SafeAILab/EAGLE), or refuses with ``Refused`` what the
consumer cannot represent; heads/eagle3/kind.py calls it and heads/checkpoints/export.py writes the files.
"""

from __future__ import annotations

import re

from treespec.heads.checkpoints.upstream_common import (
    Refused,
    base_config,
    bias_keys,
    dtype_name,
    nonzero,
    settle_biases,
    verifier_name,
)
from treespec.heads.eagle3.network import Eagle3Model


def _eagle3_state(model: Eagle3Model, layer: str) -> dict:
    """Tensors under upstream names, the layer as ``layer`` ("midlayer." or "layers.0.")."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("midlayer."):
            key = layer + key[len("midlayer."):]
        out[key] = value.detach().contiguous()
    return out


def eagle3_to_upstream(model: Eagle3Model, target, consumer: str, *, verifier: str | None = None,
                       speculative_tokens: int = 3) -> tuple[dict, dict]:
    """(config.json, tensors) of an Eagle3Model for ``consumer``: "sglang" (LlamaForCausalLMEagle3), "vllm"
    (Eagle3LlamaForCausalLM), "speculators" (Eagle3Speculator, read by vLLM) or "eagle" (SafeAILab/EAGLE)."""
    n, h = target.config.num_hidden_layers, target.config.hidden_size
    c = model.layer_config
    nbr = bool(getattr(model, "norm_before_residual", False))
    own = getattr(model, "embed_tokens", None) is not None
    aux = [int(i) for i in model.aux_layers]
    if c.hidden_act != "silu" and consumer != "speculators":
        raise Refused(f"{consumer}'s Llama MLP supports hidden_act 'silu' only, this drafter's is {c.hidden_act!r}")
    if any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in model.state_dict()):
        raise Refused(f"{consumer} cannot represent q/k norms in the EAGLE-3 layer (built with layer='target' from a "
                      "Qwen3-style target's classes); a head built with layer='llama' (the default) exports")
    if consumer in ("sglang", "vllm", "speculators") and any(not 1 <= i <= n - 1 for i in aux):
        raise Refused(f"{consumer} captures aux hidden states at the inputs of decoder layers 1..{n - 1} only; this "
                      f"drafter fuses hidden_states {aux} (0 = embeddings, {n} = final norm output)")
    if consumer == "eagle" and aux != [2, n // 2, n - 3]:
        raise Refused(f"SafeAILab/EAGLE hard-codes aux layers (2, L//2, L-3) = {(2, n // 2, n - 3)}; this drafter "
                      f"fuses {aux}")
    if nbr and consumer in ("sglang", "eagle"):
        raise Refused(f"{consumer} has no norm_before_residual: its residual is the un-normed feature")
    if own and consumer == "sglang":
        raise Refused("SGLang embeds draft tokens with the target's table; this drafter has a table of its own")
    layer = "midlayer." if consumer in ("sglang", "eagle") else "layers.0."
    state = _eagle3_state(model, layer)
    if consumer == "speculators" and not own:  # its loader builds embed_tokens and leaves it zero when absent
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().to(model.dtype).cpu()
    if model.draft_vocab.is_full and consumer != "eagle":
        state.pop("d2t"), state.pop("t2d")  # optional for the full vocabulary; the official code needs them
    arch = {"sglang": "LlamaForCausalLMEagle3", "vllm": "Eagle3LlamaForCausalLM", "eagle": "LlamaForCausalLM",
            "speculators": "LlamaForCausalLM"}[consumer]
    config = base_config(model, target, arch, c, model.dtype)
    config.update({"num_hidden_layers": 1, "draft_vocab_size": model.draft_vocab_size, "target_hidden_size": h})
    lay = re.escape(layer)
    qkv, o, mlp = lay + r"self_attn\.[qkv]_proj$", lay + r"self_attn\.o_proj$", lay + r"mlp\."
    bias = lambda pattern: nonzero(state, pattern.replace("$", r"\.bias$"))  # noqa: E731
    if consumer == "sglang":  # q/k/v never; fc per "bias"; o_proj per attention_bias or bias
        fc_on = bias(r"^fc$")
        o_on = fc_on or bias(o)
        expected = ({"fc.bias"} if fc_on else set()) | (bias_keys(state, o) if o_on else set())
        state = settle_biases(state, expected, consumer, "SGLang's EAGLE-3 q/k/v projections are built without biases")
        config.update({"bias": fc_on, "attention_bias": o_on,
                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                        "use_aux_hidden_state": True}})
    elif consumer in ("vllm", "speculators"):  # fc never; attention_bias → q/k/v and o_proj; mlp_bias → MLP
        a_on, m_on = bias(qkv) or bias(o), nonzero(state, mlp + r".*\.bias$")
        expected = (bias_keys(state, qkv) | bias_keys(state, o) if a_on else set()) | \
            (bias_keys(state, mlp) if m_on else set())
        state = settle_biases(state, expected, consumer, f"{consumer}'s EAGLE-3 fc is built without a bias")
        config.update({"attention_bias": a_on, "mlp_bias": m_on, "norm_before_residual": nbr,
                       "eagle_aux_hidden_state_layer_ids": aux})
        if consumer == "vllm":
            config["bias"] = False
    else:
        state = settle_biases(state, set(), consumer, "SafeAILab/EAGLE's EAGLE-3 layer has no biases")
        if c.rope_parameters.get("rope_type", "default") not in ("default", "linear", "dynamic"):
            raise Refused("SafeAILab/EAGLE supports linear and dynamic rope_scaling only")
        if config["rope_scaling"]:
            config["rope_scaling"] = {"type": c.rope_parameters["rope_type"], "factor": c.rope_parameters.get("factor")}
        config["pretraining_tp"] = 1
    if consumer == "speculators":
        layer_config = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "target_hidden_size",
                                                                     "norm_before_residual", "architectures",
                                                                     "eagle_aux_hidden_state_layer_ids")}
        layer_config["architectures"] = ["LlamaForCausalLM"]
        name = verifier_name(target, verifier, consumer, required=True)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer_config, "draft_vocab_size": model.draft_vocab_size,
                  "norm_before_residual": nbr, "target_hidden_size": h, "eagle_aux_hidden_state_layer_ids": aux,
                  "speculators_config": {"algorithm": "eagle3",
                                         "proposal_methods": [{"proposal_type": "greedy",
                                                               "speculative_tokens": int(speculative_tokens)}],
                                         "default_proposal_method": "greedy",
                                         "verifier": {"name_or_path": name,
                                                      "architectures": list(getattr(target.config, "architectures",
                                                                                    None) or [])}},
                  "torch_dtype": dtype_name(model.dtype)}
    return config, {k: v.contiguous() for k, v in state.items()}


