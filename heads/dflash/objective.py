"""Training a DFlash drafter on a frozen target (``scripts/train_heads.py drafter=dflash``), from the same batches as
EAGLE-3: token windows, chat data (a loss mask), packed conversations, or stored target features
(train/training/features.py: the drafter's target layers and the last one).

**What one block sees, as decoding sees it.** At decoding time the root is the last committed token, whose target
feature is not known yet, and the context holds the features of every token before it (heads/dflash/drafter.py).
So a block anchored at position a of a window is [x_a, mask × (b − 1)] at positions a .. a + b − 1; it attends to
the context features of positions < a (of a's own conversation in a packed batch) and to the whole of itself,
never to another block; its position k = 1 .. b − 1 predicts token x_{a+k}. Many anchors per window run in one
forward (``DFlashModel.anchored``): the window's context keys once, every block's queries, a block-sparse mask.

**Anchors.** Up to ``anchors`` per window, drawn uniformly without replacement among the positions a in 1 .. S − 2
whose next token x_{a+1} is trained on (the loss mask; with packing, in a's conversation): a root always has
context (decoding's first root follows the prompt). The draw uses torch's global generator, which the training loop
reseeds from (seed, step, micro-batch): a resumed run draws the same anchors. Evaluation draws from a fixed seed.
``anchors_at="lookup_miss"`` draws them only where prompt lookup with n-grams of at least ``lookup_min_ngram`` finds
no match (heads/training/anchors.py, ``lookup_misses``): the steps a block is asked on as prompt lookup's fallback.

**Loss.** Position k of an anchor's block is scored when x_{a+k} lies in the window, is trained on and (packed) in
a's conversation: ``loss="kl"`` (the default) is the forward KL from the target's next-token distribution at
a + k − 1, teacher forced on the window, to the drafter's at k; ``loss="ce"`` the cross-entropy of the window's token
x_{a+k} (the paper's, on target-generated responses); ``loss="lk"`` or ``"lk_alpha"`` the LK losses
(heads/training/objective.py, ``lk_loss``), each block position k a draft depth of its own (its λ, its mean α). Position
k weighs ``position_decay ** (k − 1)`` (DFlash's decaying weights: early positions gate every later one), normalised
over the scored predictions. Metrics: each depth's KL (``kl{k}``), top-1 agreement with the target's argmax
(``top1_{k}``) and acceptance probability Σ min(p, q) (``alpha_{k}``), and ``tau``: 1 + the mean count of leading
positions whose argmax is the target's, what greedy decoding of the block as a chain would accept (the blocks near a
window's end count only the positions inside it).

**A training vocabulary** (``train_vocab``: N): the block's logits come from N rows of the target's lm_head, the N
most frequent tokens of the training stream (EAGLE-3's draft vocabulary, FR-Spec's ranking), and p is the target's
distribution restricted to them and renormalised (``Teacher``). Predictions whose target argmax (ce: whose token)
lies outside cannot be drafted right and leave the loss, as in EAGLE-3; ``kept_fraction`` reports the share kept, and
``alpha_{k}`` / ``top1_{k}`` / ``tau`` stay measured against the full target (outside: never accepted). The drafter's
forward and backward over the head then cost N/V of the full one; the teacher's full-vocabulary product (no gradient)
remains.
"""

from __future__ import annotations

import torch

from treespec.heads.dflash.drafter import DFlash, rank_accuracy
from treespec.heads.dflash.network import DFlashModel, grow_from, resolve_target_layers
from treespec.heads.training.anchors import anchor_positions, lookup_misses, sample_anchors
from treespec.heads.training.batches import batch_parts
from treespec.heads.training.objective import (
    ROWS,
    TOKEN_LOSSES,
    Recipe,
    acceptance,
    check_loss,
    lk_loss,
    mean_metrics,
)
from treespec.heads.training.segments import packed_positions, segment_ids
from treespec.heads.training.target_states import target_hidden
from treespec.heads.training.vocab_teacher import Teacher, check_train_vocab, training_vocab
from treespec.reference import resolve

LOSSES = (*TOKEN_LOSSES, "ce")
ANCHORS_AT = ("all", "lookup_miss")  # where blocks are anchored (module docstring)


def dflash_loss(target, model: DFlashModel, batch, *, anchors: int = 32, position_decay: float = 0.9,
                loss: str = "kl", lk_eta: float = 3.0, anchors_at: str = "all", lookup_min_ngram: int = 2,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """batch: [b, S] windows or a dict batch (train/training/data.py) → (the weighted loss, metrics: ``kl{k}``,
    ``top1_{k}``, ``alpha_{k}`` per block position k, ``tau``, ``anchors`` per window) (module docstring)."""
    check_loss(loss, LOSSES)
    positions = packed_positions(batch, model.device)
    input_ids, loss_mask, target = batch_parts(batch, target, model.device)
    features, last = target_hidden(target, input_ids, model.feature_layers)  # [b, S, K·H], [b, S, H]
    b, s = input_ids.shape
    size = model.block_size
    segments = None if positions is None else segment_ids(positions)
    allowed = anchor_positions(input_ids, loss_mask, segments)
    if anchors_at == "lookup_miss":
        allowed &= lookup_misses(input_ids, lookup_min_ngram, segments)
    elif anchors_at != "all":
        raise ValueError(f"anchors_at must be one of {ANCHORS_AT}, got {anchors_at!r}")
    chosen, real = sample_anchors(allowed, anchors, generator)
    out = model.anchored(input_ids, features, chosen, positions, segments)  # [b, m, size, H]
    k = torch.arange(1, size, device=input_ids.device)
    at = chosen[:, :, None] + k  # [b, m, size − 1]: the token each position predicts
    clamped = at.clamp(max=s - 1)
    scored = (at < s) & real[:, :, None]
    if loss_mask is not None:
        scored &= loss_mask.bool().gather(1, clamped.flatten(1)).view_as(at)
    if segments is not None:
        scored &= segments.gather(1, clamped.flatten(1)).view_as(at) == segments.gather(1, chosen)[:, :, None]
    rows = torch.arange(b, device=input_ids.device)[:, None, None].expand_as(at)[scored]
    depth = (k - 1).expand_as(at)[scored]  # [n]: k − 1 of each scored prediction
    hidden = out[:, :, 1:][scored]  # [n, H]: the drafter's states of the scored predictions
    teacher_hidden = last[rows, clamped[scored] - 1]  # [n, H]: the target's final states at a + k − 1
    if hidden.shape[0] == 0:  # nothing to learn in this batch: zero, keeping the graph
        return model.logits(hidden).sum() * 0.0, {"tau": 1.0, "anchors": 0.0}
    # [n, V] logits ROWS predictions at a time (heads/training/objective.py); per prediction: the loss terms, α, whether
    # the argmaxes agree, and whether it can be learnt (a training vocabulary holds the target's argmax, or with ce the
    # window's token)
    teacher = Teacher(target.get_output_embeddings(), model.vocab, hidden.device)
    tokens = input_ids[rows, clamped[scored]]
    kls, ces, alphas, alphas_full, hits, keeps = [], [], [], [], [], []
    for a in range(0, hidden.shape[0], ROWS):
        log_q = torch.log_softmax(model.draft_logits(hidden[a : a + ROWS]).float(), dim=-1)  # [r, N]
        log_p, mass, best = teacher(teacher_hidden[a : a + ROWS])
        p = log_p.exp()
        kls.append((p * (log_p - log_q)).sum(-1))
        q = log_q.exp() if loss.startswith("lk") else log_q.detach().exp()
        alphas.append(acceptance(p, q))  # against p renormalised over the vocabulary: what LK raises (EAGLE-3's α_r)
        alphas_full.append(alphas[-1].detach() if mass is None else acceptance(p * mass[:, None], q.detach()))
        hits.append(teacher.target_ids(log_q.detach().argmax(-1)) == best)
        if loss == "ce":
            draft_token, known = teacher.draft_ids(tokens[a : a + ROWS])
            ces.append(-log_q.gather(1, draft_token[:, None])[:, 0])
            keeps.append(known)
        else:
            keeps.append(teacher.holds(best))
    kl, alpha, hit, keep = torch.cat(kls), torch.cat(alphas), torch.cat(hits), torch.cat(keeps)  # [n] each
    weights = float(position_decay) ** depth.to(kl.dtype) * keep
    if loss.startswith("lk"):  # one LK loss per depth (its own λ, its mean α), weighted as its predictions are
        total = sum(weights[(depth == j) & keep].sum() * lk_loss(loss, kl[(depth == j) & keep],
                                                                 alpha[(depth == j) & keep], lk_eta)
                    for j in depth[keep].unique().tolist()) / weights.sum().clamp_min(1e-12)
        total = total + 0.0 * kl.sum()  # nothing kept: zero, keeping the graph
    else:
        per = kl if loss == "kl" else torch.cat(ces)
        total = (weights * per).sum() / weights.sum().clamp_min(1e-12)
    alpha = torch.cat(alphas_full)
    with torch.no_grad():
        matches = torch.zeros_like(scored)
        matches[scored] = hit
        accepted = matches.long().cumprod(-1).sum(-1)[real].float()  # [anchors]: leading positions accepted
        n = torch.zeros(size - 1, device=kl.device).index_add_(0, depth, torch.ones_like(kl))
        kl_sum = torch.zeros_like(n).index_add_(0, depth, kl)
        hit_sum = torch.zeros_like(n).index_add_(0, depth, hit.float())
        alpha_sum = torch.zeros_like(n).index_add_(0, depth, alpha.detach())
        metrics = {"tau": 1.0 + accepted.mean().item(), "anchors": real.float().sum(1).mean().item()}
        if model.vocab is not None:  # the share of predictions a training vocabulary could learn
            metrics["kept_fraction"] = keep.float().mean().item()
        for j, (count, kl_j, hit_j, alpha_j) in enumerate(zip(n.tolist(), kl_sum.tolist(), hit_sum.tolist(),
                                                              alpha_sum.tolist(), strict=True)):
            if count:
                metrics.update({f"kl{j + 1}": kl_j / count, f"top1_{j + 1}": hit_j / count,
                                f"alpha_{j + 1}": alpha_j / count})
    return total, metrics


@torch.no_grad()
def dflash_metrics(target, model: DFlashModel, windows, *, anchors: int, batch_size: int = 8, seed: int = 0,
                   **where) -> dict:
    """The training metrics averaged over ``windows`` (anchors drawn from ``seed``: the same every evaluation;
    ``where``: ``anchors_at`` and ``lookup_min_ngram`` as in training)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    totals = mean_metrics(lambda batch: dflash_loss(target, model, batch, anchors=anchors, generator=generator,
                                                    **where), windows, batch_size)
    model.train(was_training)
    return totals


def target_layers(d, num_hidden_layers: int) -> tuple[int, ...]:
    """The target hidden states (``hidden_states`` indices) the drafter reads: what offline features must hold."""
    return tuple(i + 1 for i in resolve_target_layers(d.target_layer_ids, num_hidden_layers, d.num_layers))


def check_settings(d) -> None:
    """Refuse, before any model loads, a drafter config this recipe cannot train with."""
    check_train_vocab(d.get("train_vocab"))
    for key, low in (("block_size", 2), ("num_layers", 1), ("anchors", 1), ("accuracy_depth", 1)):
        value = d.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"drafter.{key} must be an integer >= {low}, got {value!r}")
    decay = d.get("position_decay")
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
        raise ValueError(f"drafter.position_decay must be a number in (0, 1], got {decay!r}")
    if d.get("anchors_at") not in ANCHORS_AT:
        raise ValueError(f"drafter.anchors_at must be one of {ANCHORS_AT}, got {d.get('anchors_at')!r}")
    ngram = d.get("lookup_min_ngram")
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise ValueError(f"drafter.lookup_min_ngram must be an integer >= 1, got {ngram!r}")
    check_loss(d.get("loss"), LOSSES)  # lk_eta: train/training/config_checks.py, as every drafter's weights


def recipe(cfg, target, train_tokens=None) -> Recipe:
    """The recipe for ``drafter=dflash`` (conf/drafter/dflash.yaml)."""
    d = cfg.drafter
    # target_layer_ids as given (a ListConfig from hydra): DFlashModel resolves and checks it (resolve_target_layers)
    model = DFlashModel(target, block_size=int(d.block_size), num_layers=int(d.num_layers),
                        target_layer_ids=d.target_layer_ids, mask_token_id=d.mask_token_id,
                        root_feature=d.root_feature)
    grown = ""
    if d.get("init_from"):  # a resumed run then loads its checkpoint over these weights
        trained = DFlashModel.from_pretrained(resolve(d.init_from), target)
        grow_from(model, trained)
        grown = f", grown from {d.init_from} ({trained.num_layers} layer(s))"
    vocab_note = training_vocab(model, d.get("train_vocab"), target, train_tokens)

    where = {"anchors_at": d.anchors_at, "lookup_min_ngram": int(d.lookup_min_ngram)}

    def loss(batch):
        return dflash_loss(target, model, batch, anchors=d.anchors, position_decay=d.position_decay, loss=d.loss,
                           lk_eta=d.lk_eta, **where)

    def evaluate(val):
        return {f"dflash_{k}": v for k, v in dflash_metrics(target, model, val, anchors=d.anchors, **where).items()}

    anchored = "" if where["anchors_at"] == "all" else \
        f" where prompt lookup's {where['lookup_min_ngram']}-grams miss"
    description = (f"{model.num_layers} layer(s), block of {model.block_size}, target layers "
                   f"{list(model.target_layer_ids)} (hidden_states {list(model.feature_layers)}), mask token "
                   f"{model.mask_token_id}, {d.anchors} anchors per window{anchored}, {d.loss} loss{vocab_note}{grown}"
                   f"{', the root feature in the block' if model.root_norm is not None else ''}")
    return Recipe(model, loss, evaluate, lambda val: rank_accuracy(target, model, val, depth=d.accuracy_depth),
                  lambda: DFlash(model), description)
