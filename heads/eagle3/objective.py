"""Training an EAGLE-3 drafter on a frozen target (``scripts/train_heads.py drafter=eagle3``).

EAGLE-3 recipe (Li et al. 2025), training-time test: the target's aux hidden states and logits are
computed online (frozen, no grad); the drafter is unrolled ``unroll_steps`` times on its own outputs
(``treespec.heads.training.unroll.unrolled``, by root): step i scores, for every root entry j of the window, the node at
draft depth i + 1, seeing exactly what sequential drafting sees (step-0 keys causally, then its own chain).
Step i's loss is weighted ``decay ** i``.

The loss is token-only: the forward KL from the target's next-token distribution restricted to the draft
vocabulary (renormalised) to the drafter's, KL(p_target|draft || q_draft), averaged over the positions
whose target argmax lies inside the draft vocabulary (the others cannot be drafted right and are masked
out, as upstream; upstream divides by all positions, here by the kept ones). No feature regression and
no feature noise: the unrolled steps are what makes the drafter robust to its own outputs. ``loss=lk`` or
``lk_alpha`` trains on the LK losses instead (heads/training/objective.py, ``lk_loss``), against the same
restricted, renormalised p: α_r = Σ min(p_r, q) is maximal exactly at q = p_r, KL's optimum too (the hybrid's two
terms agree), and q = p_r also reaches the true acceptance's ceiling, the target's mass inside the draft
vocabulary. The full target's α = Σ_{x ∈ draft vocabulary} min(p(x), q(x)) (mass outside it is never accepted)
would leave q free wherever it exceeds p and let its λ saturate below that mass; it is what ``alpha_{i}`` reports.

The draft vocabulary is the ``draft_vocab_size`` most frequent tokens of the training stream
(``token_counts`` → ``heads.eagle3_model.build_vocab_map``).

Batches are token windows [b, S] or dicts with a loss mask (chat data: position p is scored when token p + 1
is trained on) and possibly the target's stored hidden states (train/training/features.py, a ``StoredTarget``). A
packed batch (several conversations per row, heads/training/segments.py) keeps the drafter's attention inside each
conversation (heads/training/unroll.py) and scores step i's root r only when r and the token it predicts, r + 2 + i,
lie in
one conversation.
"""

from __future__ import annotations

import torch

from treespec.heads.checkpoints.drafter_folder import vocab_size_of
from treespec.heads.drafting.vocab import token_counts
from treespec.heads.eagle3.drafter import Eagle3, rank_accuracy
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map, resolve_aux_layers
from treespec.heads.training.batches import batch_parts, shifted_mask
from treespec.heads.training.objective import (
    ROWS,
    Recipe,
    acceptance,
    check_loss,
    lk_loss,
    mean_metrics,
    topk_distillation,
)
from treespec.heads.training.segments import packed_positions, same_segment, segment_ids
from treespec.heads.training.target_states import target_hidden
from treespec.heads.training.unroll import unrolled
from treespec.heads.training.vocab_teacher import Teacher


class RestrictedTarget:
    """The target's next-token distribution restricted to the draft vocabulary and renormalised, on the scored
    positions of a batch [b, S] (given ``scored`` [b, S] bool, the loss mask; else every position).

    Per scored row n (``row_of`` [b, S]: a position's row, -1 elsewhere): ``p`` [n, Vd], its draft-id argmax
    ``argmax_rows``, its negative entropy Σ p log p ``neg_entropy_rows`` and the full distribution's mass inside
    the draft vocabulary ``mass_rows`` [n] (p × mass is the full target's probability of each draft token). Per
    position [b, S]: ``neg_entropy`` (zero where not scored) and ``valid``: scored and the target's argmax lies in
    the draft vocabulary.

    The target's logits come from ``target_logits`` [b, S, V], or from its final-norm hidden states ``hidden``
    [b, S, H] through ``lm_head`` (``from_hidden``): then the [., V] logits only ever exist ROWS scored rows at a
    time. ``kl`` runs the draft head on the valid positions only, ROWS at a time too: padding and prompt tokens
    are most of a chat batch, and the [.., V] softmaxes, not the matmuls, dominate a CPU training step."""

    def __init__(self, target_logits: torch.Tensor | None, model: Eagle3Model, scored: torch.Tensor | None = None,
                 *, hidden: torch.Tensor | None = None, lm_head=None):
        source = target_logits if target_logits is not None else hidden
        b, s = source.shape[:2]
        device = source.device
        rows = torch.ones(b, s, dtype=torch.bool, device=device) if scored is None else scored
        flat = source.reshape(b * s, source.shape[-1])
        index = rows.reshape(-1).nonzero().squeeze(1)  # [n]: the scored positions, flattened
        n = index.numel()
        teacher = Teacher(lm_head, model.draft_vocab, device)  # the restriction, as EAGLE-1 and DFlash train theirs
        self.p = torch.empty(n, len(model.draft_vocab), device=device)
        neg_entropy, mass, argmax = (torch.empty(n, device=device) for _ in range(3))
        in_vocab = torch.empty(n, dtype=torch.bool, device=device)
        with torch.no_grad():  # the frozen target's side
            for a in range(0, n, ROWS):
                piece = flat[index[a : a + ROWS]]
                log_p, inside, best = teacher.split(piece.float()) if target_logits is not None else teacher(piece)
                p = self.p[a : a + ROWS]
                torch.exp(log_p, out=p)
                neg_entropy[a : a + ROWS] = (p * log_p).sum(-1)
                mass[a : a + ROWS] = inside
                argmax[a : a + ROWS] = p.argmax(-1)
                in_vocab[a : a + ROWS] = teacher.holds(best)
        self.argmax_rows, self.neg_entropy_rows, self.mass_rows = argmax.long(), neg_entropy, mass
        self.row_of = torch.full((b, s), -1, dtype=torch.long, device=device)
        self.row_of[rows] = torch.arange(n, device=device)
        self.neg_entropy = neg_entropy.new_zeros(b, s)
        self.neg_entropy[rows] = neg_entropy
        self.valid = torch.zeros(b, s, dtype=torch.bool, device=device)
        self.valid[rows] = in_vocab
        self.scored = scored

    @classmethod
    def from_hidden(cls, hidden: torch.Tensor, lm_head, model: Eagle3Model, scored: torch.Tensor | None = None):
        """From the target's final-norm hidden states [b, S, H] and its ``lm_head``: the same values as from
        ``lm_head(hidden)``, without the [b, S, V] logits."""
        return cls(None, model, scored, hidden=hidden, lm_head=lm_head)

    def kl(self, draft_logits, start: int, topk_distill: int = 0, topk_weight: float = 1.0,
           inside: torch.Tensor | None = None, loss: str = "kl", eta: float = 3.0,
           reach: torch.Tensor | None = None) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """The token loss of q = softmax(draft logits) at positions start.., over the valid ones → (loss, metrics):
        ``loss`` kl: KL(p || q) averaged; lk, lk_alpha: the LK losses (heads/training/objective.py, ``lk_loss``), this
        call's positions being one draft depth's. Metrics, floats over the valid positions: ``kl`` (with HASS's term
        below when on; under kl, the loss), ``top1`` (agreement with p's argmax), ``alpha`` (the acceptance rate
        against the full target, Σ_{x ∈ draft vocabulary} min(p_full(x), q(x))) and, under lk*, ``lk`` (the loss).
        ``draft_logits``: the logits [b, S - start, Vd], or a function from the draft outputs' rows to logits
        together with those outputs, ``(head, out)``, so that the head runs on the valid rows only (ROWS at a time).
        ``topk_distill`` = K > 0 adds HASS's top-K distillation over the draft vocabulary × ``topk_weight``
        (heads/training/objective.py). ``inside`` [b, S - start] bool: only these positions (a packed batch's, whose
        prediction stays inside one conversation). ``reach`` [b, S - start]: each position's KL weighted by it (the
        on-policy weighting, ``eagle3_loss``), still averaged over the valid positions; kl loss only. Also returns
        each position's α against the full target [b, S - start] (no gradient; 0 where not valid)."""
        valid = self.valid[:, start:] if inside is None else self.valid[:, start:] & inside
        rows = self.row_of[:, start:][valid]  # [m]: each valid position's row of p
        if isinstance(draft_logits, tuple):
            head, out = draft_logits
            inputs = out[valid]  # [m, H]
        else:
            head, inputs = (lambda x: x), draft_logits[valid]  # [m, Vd]
        m = rows.numel()
        alpha_grid = torch.zeros(valid.shape, device=valid.device)
        if m == 0:  # a batch with nothing to learn: zero, keeping the graph
            return head(inputs).sum() * 0.0, {"kl": 0.0, "top1": 0.0, "alpha": 0.0,
                                              **({} if loss == "kl" else {"lk": 0.0})}, alpha_grid
        kls, alphas, topks, agree, alpha_full = [], [], [], [], []
        for a in range(0, m, ROWS):
            r = rows[a : a + ROWS]
            logits = head(inputs[a : a + ROWS])  # [r, Vd]
            p = self.p[r]  # [r, Vd]
            log_q = torch.log_softmax(logits.float(), dim=-1)
            kls.append(self.neg_entropy_rows[r] - (p * log_q).sum(-1))
            if topk_distill:
                topks.append(topk_weight * topk_distillation(p, log_q, topk_distill))
            agree.append(logits.detach().argmax(-1) == self.argmax_rows[r])
            q = log_q.exp()
            with torch.no_grad():
                alpha_full.append(acceptance(p * self.mass_rows[r, None], q))
            if loss != "kl":
                alphas.append(acceptance(p, q))
        kl = torch.cat(kls)  # [m]
        topk = torch.cat(topks) if topks else None
        alpha_grid[valid] = torch.cat(alpha_full)
        metrics = {"top1": torch.cat(agree).float().mean().item(), "alpha": alpha_grid[valid].mean().item()}
        if loss == "kl":
            if topk is not None:
                kl = kl + topk
            if reach is None:
                total = kl.mean()
            else:
                weights = reach[valid]  # [m]
                total = (weights * kl).sum() / m
                metrics["reach"] = float(weights.mean())
            metrics["kl"] = total.item()
            return total, metrics, alpha_grid
        if reach is not None:
            raise ValueError("the on-policy weighting (drafter.on_policy) is an option of the kl loss only")
        total = lk_loss(loss, kl, torch.cat(alphas), eta)
        if topk is not None:
            total = total + topk.mean()
        metrics.update({"kl": kl.mean().item(), "lk": total.item()})
        return total, metrics, alpha_grid


def eagle3_loss(target, model: Eagle3Model, batch: torch.Tensor, *, unroll_steps: int = 7,
                decay: float = 0.8, topk_distill: int = 0, topk_weight: float = 1.0, loss: str = "kl",
                lk_eta: float = 3.0, on_policy: bool = False) -> tuple[torch.Tensor, dict]:
    """batch [b, S] token windows (or a dict batch, train/training/data.py) → (Σ_i decay^i · loss_i over unrolled
    steps i = 0..unroll_steps, loss_i the step's KL, or its LK loss under ``loss`` lk / lk_alpha with ``lk_eta``;
    metrics: ``kl{i}``, ``top1_{i}`` (draft argmax = restricted target argmax, on kept positions), ``alpha_{i}``
    (the mean acceptance probability against the full target, on kept positions), under lk* ``lk{i}``, and
    ``kept_fraction`` (scored positions whose target argmax is in the draft vocabulary)).

    ``on_policy`` (kl loss): step i's KL at root r is weighted by reach_{r,i} = Π_{j<i} α_{r,j}, the probability
    that the drafter's own chain from r gets past depths 1..i under verification (α_{r,j}: its acceptance
    probability at depth j + 1, against the full target, no gradient), with the mean reach logged as
    ``reach_{i}``. Verification discards everything after a rejection, so a state deeper than the first rejection
    is never drafted from at inference; on the target's own greedy answers a state that is reached is exactly the
    training-time-test state (its tokens are the target's, its features the drafter's), so the weights give the
    states the drafter visits under speculative decoding their on-policy share (Draft-OPD's aim, arXiv 2605.29343:
    train where the drafter's own proposals lead, with the target's feedback on accepted and rejected proposals;
    its rollouts are what scripts/regenerate.py writes when decoding is greedy)."""
    check_loss(loss)
    if on_policy and loss != "kl":
        raise ValueError(f"drafter.on_policy weights the kl loss; drafter.loss={loss!r} has its own weighting")
    positions = packed_positions(batch, model.device)
    batch, loss_mask, target = batch_parts(batch, target, model.device)
    features, last = target_hidden(target, batch, model.aux_layers)  # [b, S, 3H], [b, S, H]
    scored = None if loss_mask is None else shifted_mask(loss_mask, 1, batch.shape[1])  # p predicts token p + 1
    restricted = RestrictedTarget.from_hidden(last, target.get_output_embeddings(), model, scored)
    kept = restricted.valid[:, 1:].float().sum() / (scored[:, 1:].sum().clamp(min=1) if scored is not None
                                                    else restricted.valid[:, 1:].numel())
    total, metrics = 0.0, {"kept_fraction": kept.item()}
    segments = None if positions is None else segment_ids(positions)
    n = batch.shape[1] - 1
    reach = None  # [b, n − i]: by root, the probability that the drafter's chain gets to depth i + 1
    for i, out in unrolled(model, batch, model.fuse(features[:, :-1]), unroll_steps, by_root=True,
                           positions=positions):
        # out[:, j] predicts the token after position j + 1 + i: the target's logits there
        inside = None if segments is None else same_segment(segments, 0, 2 + i, n - i)  # root j, token j + 2 + i
        step, got, alpha = restricted.kl((model.draft_logits, out), 1 + i, topk_distill, topk_weight, inside, loss,
                                         lk_eta, reach=reach)
        if on_policy:
            reach = alpha[:, : n - i - 1] if reach is None else reach[:, : n - i - 1] * alpha[:, : n - i - 1]
        total = total + decay**i * step
        metrics.update({f"{k}{i}" if k in ("kl", "lk") else f"{k}_{i}": v for k, v in got.items()})
    return total, metrics


@torch.no_grad()
def eagle3_metrics(target, model: Eagle3Model, windows: torch.Tensor, unroll_steps: int,
                   batch_size: int = 8) -> dict:
    """The training metrics averaged over ``windows`` [n, S] (per step KL, top-1 agreement and acceptance α)."""
    was_training = model.training
    model.eval()
    totals = mean_metrics(lambda batch: eagle3_loss(target, model, batch, unroll_steps=unroll_steps), windows,
                          batch_size)
    model.train(was_training)
    return totals


def target_layers(d, num_hidden_layers: int) -> tuple[int, ...]:
    """The aux hidden states the drafter fuses: what offline features must hold besides the last one."""
    return resolve_aux_layers(d.aux_layers, num_hidden_layers)


def recipe(cfg, target, train_tokens: torch.Tensor) -> Recipe:
    """The recipe for ``drafter=eagle3`` (conf/drafter/eagle3.yaml). The draft vocabulary is the
    ``draft_vocab_size`` most frequent tokens of ``train_tokens`` (the training stream)."""
    d = cfg.drafter
    vocab = vocab_size_of(target)
    counts = token_counts(train_tokens, vocab)
    draft_vocab = min(int(d.draft_vocab_size or vocab), vocab)
    d2t, t2d = build_vocab_map(counts, draft_vocab)
    coverage = counts[t2d].sum().item() / max(1, counts.sum().item())
    model = Eagle3Model(target, aux_layers=d.aux_layers, vocab_map=(d2t, t2d), layer=d.get("layer", "llama"))

    def loss(batch):
        return eagle3_loss(target, model, batch, unroll_steps=d.unroll_steps, decay=d.unroll_decay,
                           topk_distill=d.get("topk_distill", 0), topk_weight=d.get("topk_weight", 1.0),
                           loss=d.loss, lk_eta=d.lk_eta, on_policy=bool(d.get("on_policy", False)))

    def evaluate(val):
        return {f"eagle3_{k}": v for k, v in eagle3_metrics(target, model, val, d.unroll_steps).items()}

    description = (f"aux layers {model.aux_layers}, draft vocabulary {draft_vocab} of {vocab} tokens "
                   f"({coverage:.1%} of training tokens), {d.unroll_steps} unrolled training step(s), {d.loss} loss"
                   f"{', on-policy weights' if d.get('on_policy') else ''}")
    return Recipe(model, loss, evaluate, lambda val: rank_accuracy(target, model, val, depth=d.accuracy_depth),
                  lambda: Eagle3(model), description)
