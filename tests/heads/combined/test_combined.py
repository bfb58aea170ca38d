"""Combined drafters (heads/combined/): the union of proposals merged by shared prefixes within a node budget, the
fallback on a weak match; lossless in both modes (greedy equals vanilla, sampled output follows the target, with a
negative control), with model-free, draft-model and feature drafters (EAGLE, EAGLE-3, Medusa, Hydra) as parts; each
drafter told the part of the accepted path it proposed, a feature drafter fed every accepted token's feature (its
proposals equal a recomputation from scratch) and SAM-Decoding's pair, suffix + EAGLE-3, on the reference models."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.drafter import NOT_PROPOSED, Proposal, own_nodes
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, DFlash, DraftModel, PromptLookup, SuffixDecoding, TokenRecycling, registry
from treespec.heads.combined import merge
from treespec.heads.combined.drafter import columns_of, feature_columns
from treespec.heads.eagle import Eagle
from treespec.heads.eagle3 import Eagle3
from treespec.heads.hydra import Hydra
from treespec.heads.medusa import Medusa
from treespec.host_reads import reads_per_step
from treespec.planning.autotree import EngineCost
from treespec.sampling import Sampling
from treespec.train.checks.architectures import BY_NAME, build, expect_greedy, prompt, use_attention
from treespec.train.compare import setup_costs
from treespec.train.compare.job import run_from_config
from treespec.train.training import data
from treespec.walker import row_by_row

from tests.helpers import (
    VOCAB,
    accept_deepest,
    accept_everything,
    chi2_pvalue,
    compose_cfg,
    dflash_target,
    exact_distribution,
    hf_greedy,
    perturbed,
    random_dflash,
    random_eagle,
    random_eagle3,
    random_heads,
    random_hydra,
    record_proposals,
    sampled_counts,
    scratch_logits,
    scratch_proposal,
    tiny_llama,
)


def token_paths(proposal: Proposal) -> set[tuple[int, ...]]:
    """Every node's tokens from the root: what a tree means, whatever its node order."""
    out, parents, tokens = {0: ()}, proposal.tree.parent_list, proposal.tokens.tolist()
    for i in range(1, proposal.tree.num_nodes):
        out[i] = (*out[parents[i]], tokens[i - 1])
    return set(out.values()) - {()}


def test_merge_is_the_union_by_prefix_within_the_budget():
    a = Proposal(Tree.from_paths([(0,), (1,), (0, 0), (0, 1)]), torch.tensor([5, 6, 7, 8]))
    b = Proposal(Tree.from_paths([(0,), (1,), (0, 0), (1, 0)]), torch.tensor([5, 9, 7, 3]))
    merged, maps = merge([a, b], budget=100)
    assert token_paths(merged) == token_paths(a) | token_paths(b) and len(merged.tree) == 6
    for p, mapped in zip((a, b), maps, strict=True):  # each node lands on the node spelling the same tokens
        for i, m in mapped.items():
            assert merged.tree.path_to(m).shape[0] == p.tree.path_to(i).shape[0]
            assert merged.tokens[merged.tree.path_to(m) - 1].tolist() == p.tokens[p.tree.path_to(i) - 1].tolist()
    small, maps = merge([a, b], budget=5)  # a's 4 nodes first, then b's first new one
    assert token_paths(small) == token_paths(a) | {(9,)}
    given, _ = merge([a, b], budget=5, tokens=[[5, 6, 7, 8], [5, 9, 7, 3]])  # tokens read once per batch
    assert given.tree == small.tree and given.tokens.equal(small.tokens)
    for union in (merged, small):  # siblings are distinct tokens: the walker's sibling rule needs no more
        for kids in union.tree.children:
            assert len({int(union.tokens[k - 1]) for k in kids}) == len(kids)


def test_feature_columns_hand_each_drafter_its_own_layers():
    class Wants:  # a feature drafter reading these target layers
        needs_features = True

        def __init__(self, *layers):
            self.feature_layers = layers

    lookup, eagle, eagle3, odd = PromptLookup(), Wants(-1), Wants(2, 3, 4), Wants(4, 2)
    layers, blocks = feature_columns([lookup, eagle3, eagle, odd])
    assert layers == (2, 3, 4, -1) and blocks == [None, [0, 1, 2], [3], [2, 0]]
    features = torch.arange(2 * 4 * 3).reshape(2, 4 * 3)  # [b, 4 layers · h 3]: layer j's columns hold 3j..3j+2
    assert columns_of(features, blocks[0], 4) is None
    assert columns_of(features, blocks[1], 4).equal(features[:, :9])
    assert columns_of(features, blocks[2], 4).equal(features[:, 9:])
    assert columns_of(features, blocks[3], 4).equal(torch.cat([features[:, 6:9], features[:, :3]], -1))


class Recorder(PromptLookup):
    """Prompt lookup that records the paths it is told were accepted, against its own proposals."""

    def __init__(self, depth: int = 8):
        super().__init__(max_ngram=2)
        self.log, self.depth = [], depth

    def propose_row(self, seq, tree):
        proposal = super().propose_row(seq, tree.truncate(self.depth))
        self.log.append([proposal, None])
        return proposal

    def accept(self, paths, features):
        self.log[-1][1] = paths[0]


def test_each_drafter_is_told_its_part_of_the_accepted_path():
    target = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 13, 2, 7] * 4])
    first, second = Recorder(depth=1), Recorder()  # the first proposes one level: the second's paths go deeper
    out = generate(target, ids, drafter=Combined([first, second]), tree=Tree.full(2, 3), max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))
    seq = out.sequences[0].tolist()
    length, partial = ids.shape[1] + 1, 0  # committed after prefill: the prompt and the root
    for (p1, path1), (p2, path2), n in zip(first.log, second.log, out.accept_lengths, strict=False):
        committed = seq[length : length + n - 1]  # the accepted candidates, the bonus token excluded
        for proposal, path in ((p1, path1), (p2, path2)):
            assert len(path) == len(committed)  # every accepted token, whoever proposed it
            mine = torch.tensor(own_nodes(path.tolist()), dtype=torch.long)  # its part: the prefix it proposed
            assert set(path[len(mine):].tolist()) <= {NOT_PROPOSED}
            tokens = proposal.tokens[mine - 1].tolist() if len(mine) else []  # node i holds tokens[i - 1]
            assert tokens == committed[: len(tokens)]
            if len(tokens) < len(committed):
                assert tuple(committed[: len(tokens) + 1]) not in token_paths(proposal)
                partial += 1
        length += n
    assert partial  # some steps accepted more than one of the drafters proposed


CASES = {
    "recycling+lookup": lambda t: Combined([TokenRecycling(), PromptLookup(max_ngram=2)]),
    "suffix+draft": lambda t: Combined([SuffixDecoding(), DraftModel(perturbed(t, 0.3))]),
    "fallback": lambda t: Combined([PromptLookup(max_ngram=2), TokenRecycling()], mode="fallback", min_nodes=2),
    "budget": lambda t: Combined([TokenRecycling(), PromptLookup()], nodes=3),
    "fallback budget": lambda t: Combined([SuffixDecoding(), PromptLookup()], mode="fallback", min_nodes=3, nodes=2),
    # feature drafters: each fed the accepted tokens' target features, whoever proposed them
    "suffix+eagle": lambda t: Combined([SuffixDecoding(), Eagle(random_eagle(t))]),
    "lookup+eagle3 fallback": lambda t: Combined([PromptLookup(max_ngram=2), Eagle3(random_eagle3(t, draft_vocab=24))],
                                                 mode="fallback", min_nodes=2),
    "eagle3+eagle": lambda t: Combined([Eagle3(random_eagle3(t)), Eagle(random_eagle(t, (0, -1)))]),  # 4 layers
    "lookup+medusa": lambda t: Combined([PromptLookup(max_ngram=2), Medusa(random_heads(t))]),
    "suffix+hydra-prefix": lambda t: Combined([SuffixDecoding(), Hydra(random_hydra(t, prefix_attention=True))]),
}
STATIC = [Tree.full(2, 2), Tree.chain(3)]  # Medusa's and Hydra's heads fill static trees of depth <= 3
TREES = {"lookup+medusa": STATIC, "suffix+hydra-prefix": STATIC}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_vanilla(case):
    target = tiny_llama(seed=1)
    drafter = CASES[case](target)
    for ids, tree in itertools.product([torch.tensor([[5, 9, 13, 2, 7] * 3]), torch.tensor([[1, 2, 3]])],
                                       TREES.get(case, [None, Tree.full(2, 2)])):
        out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=16)
        assert torch.equal(out.sequences, hf_greedy(target, ids, 16)), (case, tree)
    rows = [torch.tensor([5, 9, 13, 2, 7] * 3), torch.tensor([1, 2, 3, 1, 2])]
    out = generate(target, rows, drafter=drafter, tree=TREES.get(case, [None])[0], max_new_tokens=12)  # left-padded
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, -12:], hf_greedy(target, row[None], 12)[0, len(row):]), case


@pytest.mark.parametrize("family", ["Qwen3", "Mistral"])  # full attention; a sliding window of 8 (20-token prompts)
def test_families_greedy_equal_transformers(family):
    """Two more families than the reference's Llama: combinations of model-free drafters, union and fallback, on
    a plain and a repetitive prompt, equal transformers' greedy tokens."""
    target = use_attention(build(family), "eager", BY_NAME[family])
    repetitive = torch.tensor([[5, 9, 13, 2, 7] * 4])  # long accepted paths from both members
    for make in (lambda: Combined([SuffixDecoding(), TokenRecycling()]),
                 lambda: Combined([PromptLookup(), SuffixDecoding()], mode="fallback", min_nodes=2)):
        drafter = make()
        for ids in (prompt(), repetitive):
            expect_greedy(target, ids, drafter, None)
            expect_greedy(target, ids, drafter, Tree.full(2, 2))


def test_suffix_and_draft_model_on_dynamic_trees():
    target = tiny_llama(seed=2)
    drafter = Combined([SuffixDecoding(), DraftModel(perturbed(target, 0.3))])
    ids = torch.tensor([[4, 8, 15, 16, 23, 42 % 64] * 3])
    out = generate(target, ids, drafter=drafter, tree=DynamicTree(8, 3, 2), max_new_tokens=16)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 16)) and out.mean_accept_length > 1


@pytest.mark.parametrize("mode", ["union", "fallback"])
@pytest.mark.parametrize("tree", [Tree.full(2, 2), DynamicTree(8, 4, 2)], ids=["full", "dynamic"])
def test_a_feature_drafter_stays_in_sync_with_tokens_it_did_not_propose(mode, tree, monkeypatch):
    """Accepting the merged tree's deepest path, often SuffixDecoding's alone, EAGLE's next proposal still equals
    one recomputed from scratch over the committed tokens: it was fed each of them with its target feature."""
    target = tiny_llama(seed=4)
    eagle = Eagle(random_eagle(target))
    seen, told = record_proposals(eagle), []
    accept = eagle.accept
    monkeypatch.setattr(eagle, "accept", lambda paths, features: (told.append(paths[0]), accept(paths, features)))
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_deepest))
    ids = torch.tensor([[5, 9, 13, 2, 7, 11] * 4])
    out = generate(target, ids, drafter=Combined([SuffixDecoding(), eagle], mode=mode, min_nodes=2), tree=tree,
                   max_new_tokens=24)
    assert len(seen) > 3 and out.mean_accept_length > 2
    assert any(NOT_PROPOSED in path.tolist() for path in told)  # accepted tokens it had not proposed
    with torch.no_grad():
        for committed, step_tree, proposal in seen:
            got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
            assert got == scratch_proposal(scratch_logits(eagle, target, committed), step_tree)


def test_fallback_asks_a_block_drafter_only_when_the_lookup_is_weak(monkeypatch):
    """Fallback with a member that proposes on demand (DFlash): its block runs only on the steps where prompt lookup
    found fewer than min_nodes candidates (in some row), and the output equals vanilla's and the eager
    combination's, accepted lengths included."""
    target = dflash_target()
    ids = torch.tensor([[5, 9, 13, 2, 7, 11] * 3 + [4, 8]])

    def run(on_demand: bool):
        lookup, block = PromptLookup(max_ngram=2), DFlash(random_dflash(target, seed=1))
        block.proposes_on_demand = on_demand
        weak, asked = [], []
        propose_lookup, propose_block = lookup.propose, block.propose

        def looked(*args):
            proposals = propose_lookup(*args)
            weak.append(len(proposals.trees[0]) < 3)
            return proposals

        monkeypatch.setattr(lookup, "propose", looked)
        monkeypatch.setattr(block, "propose", lambda *args: (asked.append(len(weak)), propose_block(*args))[1])
        out = generate(target, ids, drafter=Combined([lookup, block], mode="fallback", min_nodes=3),
                       tree=Tree.chain(3), max_new_tokens=24)
        return out, weak, asked

    lazy, weak, asked = run(True)
    eager, _, eager_asked = run(False)
    assert torch.equal(lazy.sequences, eager.sequences) and lazy.accept_lengths == eager.accept_lengths
    assert torch.equal(lazy.sequences, generate(target, ids, max_new_tokens=24).sequences)
    assert len(eager_asked) == len(weak) and 0 < sum(weak) < len(weak)  # the lookup was strong on some steps only
    assert asked == [i + 1 for i, w in enumerate(weak) if w]  # the block ran on exactly the weak steps


@pytest.fixture(scope="module")
def reference_models():
    target, tokenizer = reference.load("target")
    names = ("eagle", "eagle3", "dflash")
    return target, tokenizer, {name: registry.build(name, target, f"reference:{name}") for name in names}


@pytest.mark.parametrize("feature", ["eagle3", "eagle", "dflash"])
@pytest.mark.parametrize("mode", ["union", "fallback"])
def test_suffix_with_eagle_equals_vanilla_on_the_reference_models(reference_models, feature, mode):
    """SAM-Decoding's pair (a suffix index + EAGLE), and a suffix index + a DFlash block, on held-out code: vanilla
    greedy's tokens, one prompt at a time and in a ragged batch, on EAGLE-2's dynamic tree and a static one."""
    target, tokenizer, shipped = reference_models
    drafter = Combined([SuffixDecoding(), shipped[feature]], mode=mode, min_nodes=4)
    texts = reference.prompts()[:2]
    taus = []
    for text, tree in zip(texts, (DynamicTree(16, 5, 4), Tree.full(2, 3)), strict=True):
        ids = tokenizer(text, return_tensors="pt").input_ids[:, -96:]
        out = generate(target, ids, drafter=drafter, tree=tree, max_new_tokens=32)
        assert torch.equal(out.sequences, generate(target, ids, max_new_tokens=32).sequences), (feature, mode, tree)
        taus.append(out.mean_accept_length)
    assert min(taus) > 1.5  # a trained drafter: it speculates
    tokenizer.padding_side = "left"
    batch = tokenizer([texts[0][:300], texts[1][:60]], return_tensors="pt", padding=True)
    expected = target.generate(batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                               max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    out = generate(target, batch.input_ids, attention_mask=batch.attention_mask, drafter=drafter,
                   tree=DynamicTree(16, 5, 4), max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(out.sequences, expected), (feature, mode)


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)  # tests/test_lossless.py's


SAMPLED = {
    "recycling+lookup": lambda t: Combined([TokenRecycling(k=2), PromptLookup(max_ngram=2)]),
    "lookup+eagle": lambda t: Combined([PromptLookup(max_ngram=2), Eagle(random_eagle(t))]),
    "suffix+eagle3 fallback": lambda t: Combined([SuffixDecoding(), Eagle3(random_eagle3(t))], mode="fallback",
                                                 min_nodes=2),
    "lookup+dflash": lambda t: Combined([PromptLookup(max_ngram=2), DFlash(random_dflash(t))]),  # a block part
    "lookup+dflash fallback": lambda t: Combined([PromptLookup(max_ngram=2), DFlash(random_dflash(t))],
                                                 mode="fallback", min_nodes=2),  # the block asked on weak steps only
    "lookup+dflash own tree": lambda t: Combined([PromptLookup(max_ngram=2), DFlash(random_dflash(t))],
                                                 mode="fallback", min_nodes=2,
                                                 part_trees=[None, DynamicTree(4, 3, 2)]),  # DDTree on weak steps
}


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampling_matches_exact_distribution(small_target, case):
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, SAMPLED[case](small_target), Tree.full(2, 2), sampling, runs=400)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) > 1e-3


@pytest.mark.parametrize("case", ["recycling+lookup", "lookup+eagle", "lookup+dflash", "lookup+dflash own tree"])
def test_wrong_acceptance_is_detected(small_target, case, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    sampling = Sampling(1.0)
    counts = sampled_counts(small_target, SAMPLED[case](small_target), Tree.full(2, 2), sampling, runs=400)
    assert chi2_pvalue(counts, exact_distribution(small_target, sampling)) < 1e-3


def test_host_reads_per_step():
    """Fallback adds no read to its drafters' own (SuffixDecoding: the committed tokens; EAGLE on a dynamic tree: its
    shape; both: the accepted tokens); union reads each network drafter's candidates once a step, to merge them."""
    target = tiny_llama(seed=1)
    ids = torch.randint(0, 16, (1, 24), generator=torch.Generator().manual_seed(0))  # the suffix index finds matches
    for mode, bound in (("fallback", 3), ("union", 4)):
        drafter = Combined([SuffixDecoding(), Eagle(random_eagle(target))], mode=mode, min_nodes=2)
        reads = reads_per_step(target, ids, drafter=drafter, tree=DynamicTree(8, 3, 2), max_new_tokens=16)
        assert reads["device"] <= bound, (mode, reads)


def test_refusals():
    target = tiny_llama()
    with pytest.raises(ValueError, match="two or more treespec Drafters"):
        Combined([PromptLookup()])
    with pytest.raises(ValueError, match="samples them"):
        Combined([PromptLookup(), DraftModel(perturbed(target), candidates="sample")])
    with pytest.raises(ValueError, match="samples them"):
        Combined([PromptLookup(), Eagle(random_eagle(target), candidates="sample")])
    with pytest.raises(ValueError, match="distinct drafters"):
        lookup = PromptLookup()
        Combined([lookup, lookup])
    with pytest.raises(ValueError, match="mode must be one of"):
        Combined([PromptLookup(), TokenRecycling()], mode="best")
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        Combined([PromptLookup(), TokenRecycling()], nodes=0)
    with pytest.raises(ValueError, match="cannot grow DynamicTree"):  # recycling reads static templates only
        generate(target, torch.tensor([[1, 2]]), drafter=Combined([SuffixDecoding(), TokenRecycling()]),
                 tree=DynamicTree(4, 2, 2), max_new_tokens=2)
    with pytest.raises(ValueError, match="deeper than the 3 levels"):  # Medusa's three heads
        generate(target, torch.tensor([[1, 2]]), drafter=Combined([PromptLookup(), Medusa(random_heads(target))]),
                 tree=Tree.chain(4), max_new_tokens=2)
    with pytest.raises(ValueError, match="made from its parts"):
        registry.make("combined", None)
    assert not Combined([PromptLookup(), PromptLookup()]).observes_logits
    assert not Combined([PromptLookup(), PromptLookup()]).needs_features
    both = Combined([TokenRecycling(), PromptLookup()])  # the loop shows it passes, a comparison copies it
    assert both.observes_logits and both.remembers_across_calls
    # the default tree: the first drafter's that every drafter can fill
    assert Combined([SuffixDecoding(), PromptLookup()]).default_tree == Tree.chain(4)  # prompt lookup's, static
    assert Combined([PromptLookup(), Medusa(random_heads(target))]).default_tree == Tree.chain(3)  # 3 heads
    assert Combined([SuffixDecoding(), Eagle(random_eagle(target))]).default_tree == DynamicTree(16, 8, 4)
    featured = Combined([PromptLookup(), Eagle(random_eagle(target, (0, -1))), Eagle(random_eagle(target))])
    assert featured.needs_features and featured.feature_layers == (0, -1)


def test_nested_combinations_share_no_drafter_and_never_contain_themselves():
    target, prompt_ids = tiny_llama(), torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    nested = Combined([Combined([SuffixDecoding(), PromptLookup()]), TokenRecycling()])  # nesting itself works
    out = generate(target, prompt_ids, drafter=nested, max_new_tokens=12)
    assert torch.equal(out.sequences, hf_greedy(target, prompt_ids, 12))
    lookup = PromptLookup()  # a member shared with a nested combination: torch once failed on a reshape
    with pytest.raises(ValueError, match="distinct drafters, nested combinations included: PromptLookup is in it"):
        Combined([Combined([lookup, SuffixDecoding()]), lookup])
    looped = Combined([SuffixDecoding(), PromptLookup()])
    looped.drafters.append(looped)  # a combination inside itself: a RecursionError
    with pytest.raises(ValueError, match="contains itself: a Combined cannot be one of its own drafters"):
        generate(target, prompt_ids, drafter=looped, max_new_tokens=4)


def test_the_comparison_runs_drafter_combined(tmp_path, monkeypatch, no_report_figures):
    """conf/drafter/combined.yaml in the comparison: its parts (suffix, eagle3) made as they are alone, combined, run
    beside vanilla and reported, with the line that makes it again. The setup's timing (the target's cost curve and
    the engine's cost per step, for predictions a combination has none of) is stubbed."""
    monkeypatch.setattr(setup_costs, "measure_engine_cost", lambda target, **kw: EngineCost())
    monkeypatch.setattr(setup_costs, "measure_cost_curve", lambda target, sizes, **kw: {n: 1e-3 * n for n in sizes})
    # the held-out windows (EAGLE-3's accuracies) from a few stdlib files, not all of them; one held-out prompt
    monkeypatch.setattr(data, "STDLIB_CORPUS", {**data.STDLIB_CORPUS, "max_files": 12})
    cfg = compose_cfg("compare", ["drafters=[combined]", "prompts=1", "max_new_tokens=8", "cost_sizes=[1,2]",
                                  "peers=false", "assistant=null", "logger=none", "threads=1", "workload.held_out=1",
                                  "trees=[{kind: default}, {kind: chain, depth: 2}]",
                                  "available.combined.part_trees=[null, {kind: full, width: 2, depth: 2}]",
                                  f"paths.data={tmp_path / 'data'}"])
    result = run_from_config(cfg, tmp_path / "run")
    assert [r["config"] for r in result["records"]] == ["vanilla", "combined | default", "combined | chain γ=2"]
    runs = {r["config"]: r["runs"] for r in result["records"]}
    assert runs["combined | default"]["new_tokens"] == runs["vanilla"]["new_tokens"]
    assert result["records"][1]["tau"] > 1
    entry = result["drafter_entries"]["combined"]
    assert [p["name"] for p in entry["parts"]] == ["suffix", "eagle3"] and entry["mode"] == "union"
    assert entry["part_trees"] == [None, {"kind": "full", "width": 2, "depth": 2}]  # EAGLE-3 on its own tree
    assert result["stamp"]["drafters"]["combined"]["source"] == "suffix + eagle3"
    md = (tmp_path / "run" / "results.md").read_text()
    assert 'Combined([registry.build("suffix", target), registry.build("eagle3", target, ' \
           'source="reference:eagle3")], mode=\'union\', min_nodes=1, part_trees=[None, build_tree({\'kind\': ' \
           '\'full\', \'width\': 2, \'depth\': 2})])' in md
    assert "from treespec.planning.tree_spec import build_tree" in md
