"""The SpecForge side of ``scripts/specforge_check.py`` (``treespec.train.checks.specforge_step``): runs under
SpecForge's own Python (its venv pins transformers 5.8.1, treespec needs 5.24) and imports nothing from treespec,
so it is started by its path, not imported:

    SPECFORGE_VENV/bin/python train/checks/specforge_worker.py EXCHANGE_FOLDER        # from the repository root

It reads what the check wrote into EXCHANGE_FOLDER (``request.json``, ``inputs.safetensors``, the head in
SpecForge's checkpoint layout under ``head/``, ``vocab_mapping.pt``, ``lm_head.safetensors``) and runs SpecForge's
offline EAGLE-3 training path on it, as its trainer does:

1. the draft model: ``AutoDraftModelConfig.from_file`` → ``AutoDraftModel.from_config`` → ``warm_start_draft_model``
   (the exported weights) → ``load_vocab_mapping`` → ``load_embedding`` (the target's token table) →
   ``freeze_embedding``, all in float32;
2. each sample through ``normalize_offline_sample`` (which zeroes the last loss-mask entry), stacked;
3. ``Eagle3TrainStrategy.forward_loss`` over ``OnlineEagle3Model`` (sdpa backend) with a ``TargetHead`` holding
   the target's lm_head: it shifts input ids and target states (``TargetHead.preprocess``), unrolls ``length``
   TTT steps and sums the step losses weighted ``ploss_decay ** i``. Its backward gives the native gradient.
4. the same forward once more, its step losses re-weighted by ``B·T / kept_i`` before the backward: SpecForge's
   loss in treespec's normalisation (a mean over kept positions instead of over all B·T), whose gradient must
   equal treespec's.

The step loss goes through ``LogSoftmaxLoss`` in SpecForge: a Triton kernel, CUDA only. The worker runs on the
CPU and hands it SpecForge's own reference implementation of the same loss (``specforge.core.loss._compute_loss``,
the same sum over the vocabulary and mean over B·T). Each call also records the step's kept count (positions
whose target argmax has a draft id and whose loss mask is set) and Σ p·log p over them, so that the check can
turn SpecForge's cross-entropy into treespec's KL.

It writes ``result.json`` (per TTT length: step losses, kept counts, accuracies, correct counts) and
``grads.safetensors`` (``{length}/{native|kept_mean}/{parameter}``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


class RecordingLoss:
    """Stands in for SpecForge's ``LogSoftmaxLoss`` inside its EAGLE-3 model module: records, per call (one per
    TTT step), the kept count and Σ position_mask · p · log p, then returns SpecForge's own loss."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.calls: list[dict] = []

    def apply(self, logits, target_p, position_mask):
        with torch.no_grad():
            p = target_p.float()
            plogp = torch.where(p > 0, p * p.clamp_min(1e-45).log(), torch.zeros_like(p)).sum(-1, keepdim=True)
            self.calls.append({"kept": int(position_mask.sum().item()),
                               "neg_entropy_sum": float((position_mask * plogp).sum().item()),
                               "positions": int(logits.shape[0] * logits.shape[1])})
        return self.loss_fn(logits, target_p, position_mask)


def draft_model(folder: Path, target_dir: str):
    """SpecForge's draft model as its trainer builds it (algorithms/model_providers.build_eagle3_draft)."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.model_loading import warm_start_draft_model

    head = folder / "head"
    config = AutoDraftModelConfig.from_file(str(head / "config.json"))
    draft = AutoDraftModel.from_config(config, attention_backend="sdpa", torch_dtype=torch.float32)
    warm_start_draft_model(draft, str(head), draft_config=config, strategy="eagle3", allow_missing_embedding=True)
    exported = (draft.d2t.clone(), draft.t2d.clone())
    draft.load_vocab_mapping(str(folder / "vocab_mapping.pt"))
    if not (torch.equal(exported[0], draft.d2t) and torch.equal(exported[1], draft.t2d)):
        raise SystemExit("the exported head's d2t/t2d differ from the vocabulary map file")
    draft.load_embedding(target_dir, embedding_key="model.embed_tokens.weight")
    draft.freeze_embedding()
    return draft.float()


def rotary_quirk(folder: Path, reference) -> dict:
    """Whether ``from_pretrained`` (transformers 5.8.1) leaves the rotary cos/sin caches uninitialised, as
    seen in SpecForge 0.2.0, and whether ``_init_rope()`` repairs them. The training path above builds the
    model with ``from_config`` and copies only the state_dict (rotary caches are not persistent), so its
    caches are the freshly computed ones: ``reference``."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    loaded = LlamaForCausalLMEagle3.from_pretrained(str(folder / "head"), dtype=torch.float32)
    want = reference.midlayer.self_attn.rotary_emb.cos_cached
    got = loaded.midlayer.self_attn.rotary_emb.cos_cached
    broken = got.shape != want.shape or not torch.allclose(got.float(), want.float())
    loaded.midlayer.self_attn._init_rope()
    repaired = torch.allclose(loaded.midlayer.self_attn.rotary_emb.cos_cached.float(), want.float())
    return {"from_pretrained_rotary_broken": bool(broken), "init_rope_repairs": bool(repaired)}


def offline_batch(inputs: dict):
    """The stored target states as SpecForge's offline reader hands them to its trainer: each sample through
    ``normalize_offline_sample``, stacked (equal lengths, so no padding)."""
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.contracts import TrainBatch

    ids = inputs["input_ids"]
    samples = [normalize_offline_sample({"aux_hidden_state": inputs["aux_hidden_state"][b : b + 1],
                                         "hidden_state": inputs["hidden_state"][b : b + 1],
                                         "input_ids": ids[b], "loss_mask": inputs["loss_mask"][b]},
                                        max_len=ids.shape[1]) for b in range(ids.shape[0])]
    tensors = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    return TrainBatch(sample_ids=[str(b) for b in range(ids.shape[0])], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})


def grads_of(module) -> dict:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()
            if p.requires_grad and p.grad is not None}


def run_length(draft, target_head, batch, length: int, decay: float, recorder: RecordingLoss) -> tuple[dict, dict]:
    """SpecForge's training step at TTT ``length``: (per-step results, gradients by objective)."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.training.strategies.base import Eagle3TrainStrategy

    model = OnlineEagle3Model(draft, length=length, attention_backend="sdpa")
    strategy = Eagle3TrainStrategy(model, target_head=target_head, ploss_decay=decay)

    recorder.calls.clear()
    draft.zero_grad(set_to_none=True)
    out = strategy.forward_loss(batch)
    out.loss.backward()
    grads = {"native": grads_of(draft)}
    calls = list(recorder.calls)
    m = out.metrics
    steps = [{"ploss": float(m["plosses"][i]), "acc": float(m["acces"][i]),
              "correct": int(m["acc_corrects"][i]), "scored": int(m["acc_denoms"][i]),
              "acceptance_rate": float(m["acceptance_rates"][i]), **calls[i]} for i in range(length)]

    # the same step, each step's loss divided by its kept fraction: treespec's normalisation
    t = batch.tensors
    input_ids, target, loss_mask = strategy._prepare_target("hidden_state", t["input_ids"], t["target"],
                                                            t["loss_mask"], torch.device("cpu"))
    recorder.calls.clear()
    draft.zero_grad(set_to_none=True)
    plosses = model(input_ids=input_ids, attention_mask=t["attention_mask"], target=target, loss_mask=loss_mask,
                    hidden_states=t["hidden_state"])[0]
    total = sum(decay**i * p * (c["positions"] / max(c["kept"], 1)) for i, (p, c) in
                enumerate(zip(plosses, recorder.calls, strict=True)))
    total.backward()
    grads["kept_mean"] = grads_of(draft)
    return {"length": length, "loss": float(out.loss), "steps": steps}, grads


def main(folder: Path) -> int:
    from safetensors.torch import load_file, save_file

    torch._dynamo.config.disable = True  # SpecForge's helpers are torch.compile'd: run them eagerly (CPU, no compiler)
    from specforge.algorithms.eagle3 import model as eagle3_module
    from specforge.core import loss as loss_module
    from specforge.modeling.target.target_head import TargetHead

    request = json.loads((folder / "request.json").read_text())
    torch.manual_seed(0)
    recorder = RecordingLoss(loss_module._compute_loss)
    eagle3_module.LogSoftmaxLoss = recorder  # the name OnlineEagle3Model's loss calls

    draft = draft_model(folder, request["target_dir"])
    target_head = TargetHead(request["target_dir"])  # config only; the lm_head comes from the check, in float32
    with torch.no_grad():
        target_head.fc.weight.copy_(load_file(str(folder / "lm_head.safetensors"))["weight"])
    target_head.freeze_weights()
    target_head = target_head.float().eval()
    batch = offline_batch(load_file(str(folder / "inputs.safetensors")))

    from importlib.metadata import version
    results = {"versions": {name: version(name) for name in ("specforge", "torch", "transformers", "triton")},
               "loss_kernel": "reference _compute_loss",
               **rotary_quirk(folder, draft), "lengths": []}
    tensors = {}
    for length in request["ttt_lengths"]:
        result, grads = run_length(draft, target_head, batch, int(length), float(request["decay"]), recorder)
        results["lengths"].append(result)
        for kind, named in grads.items():
            tensors.update({f"{length}/{kind}/{name}": g.contiguous() for name, g in named.items()})
    save_file(tensors, str(folder / "grads.safetensors"))
    (folder / "result.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
