"""Export a drafter checkpoint for another serving stack (treespec.heads.checkpoints.export; formats in
heads/checkpoints/export.py).

    python scripts/export_drafter.py runs/heads/eagle3/final --to vllm --out exports/eagle3-vllm
    python scripts/export_drafter.py runs/heads/eagle/final --to sglang --out exports/eagle-sglang   # variant=upstream
    python scripts/export_drafter.py reference:medusa --to medusa --out exports/medusa --target reference:target \\
        --verifier org/reference-target
    python scripts/export_drafter.py yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --to speculators --out DIR \\
        --target meta-llama/Llama-3.1-8B-Instruct

SOURCE is anything treespec.heads.load reads (a treespec drafter folder, an EAGLE-1/2, EAGLE-3 or Medusa
checkpoint folder, reference:<name>, or a Hub repo id); --target is the model it drafts for (a folder or
reference:<name>). A drafter a consumer cannot represent is refused with the reason, and nothing is written.
"""

import argparse
import sys

from treespec.heads.checkpoints.export import CONSUMERS, export
from treespec.heads.checkpoints.upstream_common import Refused
from treespec.heads.registry import AUTO, FORMATS
from treespec.reference import load_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="drafter folder, reference:<name> or Hugging Face Hub repo id")
    parser.add_argument("--to", required=True, choices=CONSUMERS, help="the consumer whose layout to write")
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier export's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files in --out that no treespec export wrote (refused otherwise)")
    parser.add_argument("--target", default="reference:target", help="the target model: folder or reference:<name>")
    parser.add_argument("--format", default="auto", choices=FORMATS, help="the source's format (default: detect)")
    parser.add_argument("--aux-layers", default=None,
                        help="EAGLE-3 source without aux ids in its config: comma-separated hidden_states indices")
    parser.add_argument("--written-by", default=None, choices=("specforge", "serving"),
                        help="an EAGLE-3 source whose config's norm_output is ambiguous: who wrote it (SpecForge's "
                             "trainer, or an SGLang / speculators serving config)")
    parser.add_argument("--verifier", default=None,
                        help="the target's Hugging Face Hub id, recorded for speculators / Medusa to load it by; "
                             "required when --target is a local folder")
    parser.add_argument("--speculative-tokens", type=int, default=3, help="speculators' proposal length")
    args = parser.parse_args()

    target, _ = load_model(args.target)
    aux = [int(i) for i in args.aux_layers.split(",")] if args.aux_layers else None
    try:
        module = AUTO.load(args.source, target, format=args.format, aux_layers=aux, written_by=args.written_by)
        out = export(module, target, args.out, to=args.to, verifier=args.verifier,
                     speculative_tokens=args.speculative_tokens, overwrite=args.overwrite)
    except Refused as err:
        print(f"refused: {err}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{type(module).__name__} from {args.source} written for {args.to} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
