"""How well the shipped EAGLE drafter's confidence predicts acceptance, at depth 1 on held-out text.

EAGLE-2 grows its dynamic tree by the drafter's cumulative log-probability, assuming the draft's
confidence tracks the chance its token is accepted. This measures that, teacher forced on the same
held-out windows as the accuracies (32 × 256 tokens):

* greedy acceptance of the draft's top-1 token (it equals the target's argmax) per bin of its probability q;
* temperature-1 acceptance of a deterministic top-1 candidate: p_target(x) (EAGLE-2's rule);
* temperature-1 acceptance of a candidate sampled from q: Σ_x min(p, q) (Leviathan/Chen).

    python scripts/eagle_calibration.py
"""

import torch

from treespec import reference
from treespec.heads.eagle import EagleModel
from treespec.heads.eagle.objective import training_unroll
from treespec.train.training.data import held_out_windows

WINDOWS, WINDOW_LEN = 32, 256  # the held-out windows the shipped accuracies were measured on
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)


@torch.no_grad()
def main() -> None:
    target, tokenizer = reference.load("target")
    model = EagleModel.from_pretrained(reference.MODELS_DIR / "eagle", target)
    q_top, hit, p_of_top, overlap, p_max = [], [], [], [], []
    for batch in held_out_windows(tokenizer, WINDOW_LEN, WINDOWS).split(4):
        _, target_logits, steps = training_unroll(target, model, batch, steps=0)
        p_target = torch.softmax(target_logits, dim=-1)  # [b, n, V] at temperature 1
        _, g, _ = next(steps)
        q = torch.softmax(model.logits(g).float(), dim=-1)  # [b, n, V]
        q_max, top = q.max(-1)
        q_top.append(q_max.flatten())
        hit.append((top == p_target.argmax(-1)).flatten().float())
        p_of_top.append(p_target.gather(-1, top[..., None]).flatten())
        overlap.append(torch.minimum(p_target, q).sum(-1).flatten())
        p_max.append(p_target.max(-1).values.flatten())
    q_top, hit, p_of_top, overlap, p_max = map(torch.cat, (q_top, hit, p_of_top, overlap, p_max))
    print(f"{len(hit)} positions, depth 1")
    print(f"greedy acceptance (draft top-1 = target argmax): {hit.mean():.3f}")
    print(f"mean draft confidence q(top-1):                  {q_top.mean():.3f}")
    print(f"mean target confidence p(argmax):                {p_max.mean():.3f}")
    print(f"T=1 acceptance, deterministic top-1 (p(x)):      {p_of_top.mean():.3f}")
    print(f"T=1 acceptance, sampled from q (sum min(p, q)):  {overlap.mean():.3f}")
    print("q(top-1) bin  share  greedy acceptance  T=1 acceptance p(x)")
    for lo, hi in zip(BINS[:-1], BINS[1:], strict=True):
        inside = (q_top >= lo) & (q_top < hi if hi < 1 else q_top <= hi)
        if inside.any():
            print(f"[{lo:.1f}, {hi:.1f})    {inside.float().mean():.3f}  {hit[inside].mean():.3f}"
                  f"              {p_of_top[inside].mean():.3f}")


if __name__ == "__main__":
    main()
