"""treespec's EAGLE-3 training step checked against SpecForge's, step for step (docs/specforge_check.md).

    python scripts/specforge_check.py                         # TTT lengths 1, 2 and the published 7
    python scripts/specforge_check.py --ttt 7 --loss-mask spans --draft-vocab 1024
    python scripts/specforge_check.py --loss-mask spans --raw-mask    # measure the loss-mask offset (disagrees)

Same weights, same batch, same number of TTT steps on both sides: the shipped reference target, a random
EAGLE-3 head (``--seed``), ``--batch`` windows of ``--seq-len`` held-out stdlib tokens, a draft vocabulary of the
``--draft-vocab`` most frequent of them. treespec computes its training loss (``eagle3_loss``), per-step KL,
top-1 and parameter gradients here; the head goes out in SpecForge's checkpoint layout (``export(to="sglang")``:
``LlamaForCausalLMEagle3``, what SpecForge's trainer warm-starts from) with the target states it consumes, and
``train/checks/specforge_worker.py`` runs SpecForge's own offline training step on them under SpecForge's Python
(``--specforge-python`` or env TREESPEC_SPECFORGE_PYTHON, one of them required; its venv pins transformers 5.8.1).

``--ttt L`` counts forward passes as SpecForge's ``ttt_length`` does (the published 7 = depths 1-7); treespec's
``unroll_steps`` counts the passes after the first, so it runs with ``unroll_steps = L - 1``.

The two differ by design in two conventions; both are compared, and the check fails on any disagreement beyond
tolerance in either:
- **normalisation**: treespec's step loss is KL(p || q) averaged over kept positions; SpecForge's is the cross-
  entropy summed over kept positions divided by all B·T positions. "kept-mean" rows put SpecForge's loss in
  treespec's terms (its gradient is that of SpecForge's step losses re-weighted by B·T / kept_i); "B·T-sum" rows
  put treespec's in SpecForge's (treespec's per-step losses re-weighted by kept_i / B·T).
- **loss mask**: treespec scores a prediction when the predicted token is trained on; SpecForge when the token
  two before it is. SpecForge is handed the mask shifted by two unless ``--raw-mask``.
Exit status 0: agreement; 1: a disagreement; 2: SpecForge's Python is missing or its worker failed.
"""

import argparse
import sys

from treespec.train.checks import specforge_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specforge-python", default=None,
                        help=f"SpecForge venv's python (default: env {specforge_step.ENV}; one of the two is required)")
    parser.add_argument("--ttt", type=int, nargs="+", default=[1, 2, 7],
                        help="TTT lengths (forward passes, SpecForge's ttt_length; published 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random EAGLE-3 head and the span mask")
    parser.add_argument("--batch", type=int, default=2, help="windows in the batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window")
    parser.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size (the target has 8192)")
    parser.add_argument("--loss-mask", choices=("none", "spans"), default="none",
                        help="none: every position scored (plain windows); spans: a chat-like mask")
    parser.add_argument("--raw-mask", action="store_true",
                        help="hand SpecForge the token mask unshifted, as its parser writes it (measures the offset)")
    parser.add_argument("--decay", type=float, default=0.8, help="step i's weight decay ** i (published 0.8)")
    parser.add_argument("--loss-rtol", type=float, default=1e-5)
    parser.add_argument("--grad-rtol", type=float, default=1e-4, help="max |Δgrad| per group over its max |grad|")
    parser.add_argument("--keep", default=None, help="write the exchange folder here and keep it")
    args = parser.parse_args()

    if min(args.ttt) < 1:
        parser.error("--ttt lengths are forward passes: at least 1")
    return specforge_step.run(args)


if __name__ == "__main__":
    sys.exit(main())
