"""A toy world for the walker (treespec/walker.py): target and drafter logits that depend only on the token
prefix, the target's exact law of the first two committed tokens, and the counts that many walks give."""

from __future__ import annotations

import functools

import torch

from treespec.drafter import Proposal, Proposals
from treespec.sampling import Sampling, probs, sample
from treespec.tree import Tree
from treespec.walker import walk
from treespec.walker_batch import walk_batch

GREEDY = Sampling(0.0)
T1 = Sampling(1.0)
T07 = Sampling(0.7, top_p=0.9)
WALKS = 20_000
ALPHA = 1e-3


def logits_with_argmax(argmax, vocab):
    """[N, V] logits whose row i has its (unique) maximum at argmax[i]."""
    logits = torch.linspace(0.0, 1.0, vocab).repeat(len(argmax), 1)  # [N, V], distinct values < 2
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 2.0
    return logits


# an uneven tree: siblings of different depths, one branch three deep
UNEVEN = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0)])
# node:                   1     2     3     4       5       6       7       8
# parents: 1, 2, 3 ← 0; 4, 5, 6 ← 1; 7 ← 2; 8 ← 4


class World:
    """A toy target and drafter whose logits depend only on the token prefix (after the root).

    A prefix (x1, ..., xd) has code Σ (x_i + 1)(V + 1)^(d − i), so every prefix up to ``depth`` tokens
    indexes a row of a seeded random table: nodes with equal token paths (duplicate siblings) get equal
    logits, as a real target would give them.
    """

    def __init__(self, vocab, depth, seed, draft_noise=1.0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        rows = (vocab + 1) ** depth
        self.target = torch.randn(rows, vocab, generator=g)  # [rows, V]
        # the drafter: the target plus noise, so acceptance is neither ~0 nor ~1
        self.draft = self.target + draft_noise * torch.randn(rows, vocab, generator=g)  # [rows, V]

    def child_code(self, code, token):
        return code * (self.vocab + 1) + token + 1

    def exact_first_two(self, sampling):
        """float64 [V, V]: the target's P(first token = a, second = b)."""
        p_root = probs(self.target[0], sampling).double()  # [V]
        after = probs(self.target[[self.child_code(0, a) for a in range(self.vocab)]], sampling).double()
        joint = p_root[:, None] * after  # [V, V]
        return (joint / joint.sum()).numpy()

    def deterministic_proposal(self, tree, sampling, duplicate_ranks=False):
        """Top-k ranks of the draft distribution at each parent; with duplicate_ranks, sibling pairs
        share a token (rank r takes the draft's (r // 2)-th token). → (proposal, logits [N, V])."""
        codes = [0] * tree.num_nodes
        tokens = []
        for i in range(1, tree.num_nodes):
            parent, rank = int(tree.parents[i]), int(tree.ranks[i])
            ranked = probs(self.draft[codes[parent]], sampling).argsort(descending=True, stable=True)
            token = int(ranked[rank // 2 if duplicate_ranks else rank])
            tokens.append(token)
            codes[i] = self.child_code(codes[parent], token)
        return Proposal(tree, torch.tensor(tokens)), self.target[codes]

    def sampled_proposals(self, tree, sampling, runs, generator, without_replacement=False):
        """Each run draws node i's children i.i.d. from q_draft[i] = the draft's distribution after node
        i's prefix (or one after another without replacement: each from q_draft[i] without its earlier
        siblings' tokens; once q is spent, the first token not drawn yet). → tokens [R, n], logits [R, N, V],
        q_draft [R, N, V]."""
        codes = torch.zeros(runs, tree.num_nodes, dtype=torch.long)  # [R, N]
        q_table = probs(self.draft, sampling)  # [rows, V]
        tokens = torch.zeros(runs, len(tree), dtype=torch.long)  # [R, n]
        for i in range(1, tree.num_nodes):
            parent_codes = codes[:, int(tree.parents[i])]  # [R]
            q_rows = q_table[parent_codes].clone()  # [R, V]
            if without_replacement:
                untaken = torch.ones_like(q_rows)
                for sibling in tree.children[int(tree.parents[i])]:
                    if sibling < i:
                        q_rows.scatter_(1, tokens[:, sibling - 1 : sibling], 0.0)
                        untaken.scatter_(1, tokens[:, sibling - 1 : sibling], 0.0)
                spent = q_rows.sum(-1) <= 1e-6
                q_rows[spent] = torch.nn.functional.one_hot(untaken[spent].argmax(-1), self.vocab).float()
            tokens[:, i - 1] = sample(q_rows, generator)
            codes[:, i] = self.child_code(parent_codes, tokens[:, i - 1])
        return tokens, self.target[codes], q_table[codes]


def first_two_counts(world, walker, tree, sampling, *, sampled, duplicate_ranks=False, seed=0, runs=WALKS,
                     without_replacement=False):
    """Run the walker ``runs`` times → int64 [V, V] counts of the first two committed tokens.

    When a walk commits a single token (nothing accepted), the second comes from the target after that
    token, as the next decoding step would produce it.
    """
    g = torch.Generator().manual_seed(seed)
    if sampled:
        tokens, logits, q_draft = world.sampled_proposals(tree, sampling, runs, g, without_replacement)
    else:
        fixed, node_logits = world.deterministic_proposal(tree, sampling, duplicate_ranks)
        tokens, logits, q_draft = fixed.tokens.expand(runs, -1), node_logits.expand(runs, -1, -1), None
    if _batched(walker):  # every run at once, as generate walks a batch's rows (treespec/walker_batch.py)
        verdicts = walk_batch(logits, Proposals.shared(tree, tokens, q_draft, without_replacement=without_replacement),
                              sampling, generator=g)
        firsts = verdicts.tokens[:, 0]
        seconds = torch.where(verdicts.lengths > 0, verdicts.tokens[:, 1], -1)
    else:
        firsts, seconds = [], []
        for r in range(runs):
            proposal = Proposal(tree, tokens[r], None if q_draft is None else q_draft[r], without_replacement)
            w = walker(logits[r], proposal, sampling, generator=g)
            committed = proposal.tokens[w.path - 1].tolist() + [w.next_token]
            firsts.append(committed[0])
            seconds.append(committed[1] if len(committed) > 1 else -1)
        firsts, seconds = torch.tensor(firsts), torch.tensor(seconds)
    missing = seconds < 0
    after_first = probs(world.target[world.child_code(0, firsts[missing])], sampling)  # [m, V]
    seconds[missing] = sample(after_first, g)
    return torch.bincount(firsts * world.vocab + seconds, minlength=world.vocab**2).view(world.vocab, -1).numpy()


def _batched(walker) -> bool:
    """Whether ``walker`` is the token-level walk (``walk``, or a partial of it with acceptance="rejection"),
    which runs as the batched walk; any other (block, traversal, a negative control) runs walk by walk."""
    options = walker.keywords if isinstance(walker, functools.partial) else {}
    base = walker.func if isinstance(walker, functools.partial) else walker
    return base is walk and options.get("acceptance", "rejection") == "rejection"
