"""PARD (heads/draft_model/parallel.py: a draft model filling k depths in one pass after k − 1 mask tokens): its
cache in sync with what the target accepts (each proposal equal to one recomputed with no cache, one row and a
ragged batch), lossless decoding (greedy on the architecture matrix and a ragged batch, chains, static and DDTree
trees; sampled by chi-square, with a negative control), host reads per step no more than DFlash's, bad input named,
the training objective (its anchored pass equals decoding from each anchor; the loss falls), and the recipe ``pard``
adapting a draft model folder into one that loads, drafts in parallel and resumes exactly."""

import importlib

import pytest
import torch
from safetensors.torch import load_file

from treespec import Tree, generate
from treespec.drafter import Committed
from treespec.dynamic_tree import DynamicTree
from treespec.heads import Combined, DFlash, DFlashModel, DraftModel, ParallelDraft, SuffixDecoding, load, registry
from treespec.heads.checkpoints import local_profile
from treespec.heads.draft_model.network import new_draft_model
from treespec.heads.draft_model.parallel import anchor_outputs, anchored_hidden
from treespec.heads.draft_model.pard_objective import pard_loss
from treespec.heads.training.segments import segment_ids
from treespec.host_reads import reads_per_step
from treespec.planning.autotree import measure_cost_curve
from treespec.reference import load_model
from treespec.sampling import Sampling
from treespec.train.checks.architectures import FAMILIES, build, draft_of, expect_greedy, use_attention
from treespec.train.checks.architectures import prompt as matrix_prompt
from treespec.train.training import drafter_job
from treespec.walker import row_by_row

from tests.helpers import (
    VOCAB,
    accept_everything,
    block_proposal,
    chat_tokenizer,
    chi2_pvalue,
    compose_cfg,
    conversations,
    exact_distribution,
    expect_batched_greedy,
    heads_cfg,
    hf_greedy,
    perturbed,
    proposed_while_accepting,
    record_proposals,
    sampled_counts,
    tiny_chat_target,
    tiny_llama,
    write_jsonl,
)

TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 3)}
K, MASK = 4, 63  # four depths per pass; the tiny vocabulary's last id


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=1).requires_grad_(False)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def trained(target, prompt):
    """A jittered copy of the target adapted to PARD on the target's own greedy continuations (the test prompt's
    among them): it is often right at the masks too, so rows accept different lengths."""
    g = torch.Generator().manual_seed(0)
    data = hf_greedy(target, torch.cat([prompt, torch.randint(0, 64, (15, 9), generator=g)]), 24)
    model = perturbed(target, 0.3).train().requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        loss, _ = pard_loss(target, model, data, parallel=K, mask_token_id=MASK, anchors=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


# -- the drafter's cache in sync: each proposal equals one recomputed with no cache ------------------------------------
def scratch_tokens(model, committed, tree) -> dict:
    """{rank path: token} of ``tree`` over the k distributions of one uncached pass over [committed, mask × (k − 1)]."""
    ids = torch.cat([committed, torch.full((1, K - 1), MASK)], dim=1)
    with torch.no_grad():
        log_q = torch.log_softmax(model(input_ids=ids).logits[0, -K:].float(), -1)  # [k, V]
    return block_proposal(log_q, tree)


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("rows", ["one", "ragged"])
def test_proposals_match_recomputation(target, prompt, trained, tree_name, rows, monkeypatch):
    drafter = ParallelDraft(trained, parallel=K, mask_token_id=MASK)
    for committed, step_tree, proposal in proposed_while_accepting(target, prompt, drafter, TREES[tree_name], rows,
                                                                   monkeypatch):
        got = dict(zip(proposal.tree.paths, proposal.tokens.tolist(), strict=True))
        assert got == scratch_tokens(trained, committed, step_tree)


def test_propose_feeds_only_the_uncached_tokens(target, prompt):
    """The cache holds committed tokens only between steps: after a proposal, the prompt; after the next, the
    prompt and the accepted tokens (fed by that pass), never a mask."""
    drafter = ParallelDraft(perturbed(target, 0.3), parallel=K, mask_token_id=MASK)
    committed = torch.cat([prompt, torch.tensor([[5, 7, 9]])], 1)
    drafter.propose(Committed(committed[:, :10], [10]), None, Tree.chain(2), Sampling(0.0))
    assert drafter.cache.get_seq_length() == 10 and drafter.slots.counts == [10]
    drafter.accept([torch.tensor([1, 2])], None)
    drafter.propose(Committed(committed, [12]), None, Tree.chain(2), Sampling(0.0))
    assert drafter.cache.get_seq_length() == 12 and drafter.slots.counts == [12]

# -- lossless: greedy --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
def test_greedy_equals_vanilla(target, prompt, trained, tree_name):
    out = generate(target, prompt, drafter=ParallelDraft(trained, parallel=K, mask_token_id=MASK),
                   tree=TREES[tree_name], max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))
    assert sum(out.accept_lengths) == 24 - 1 and out.mean_accept_length > 1.5


@pytest.mark.parametrize("tree_name", list(TREES))
def test_ragged_batch_equals_transformers_batched_greedy(target, trained, tree_name):
    drafter = ParallelDraft(trained, parallel=K, mask_token_id=MASK, candidates="sample")  # greedy: top-k ranks
    expect_batched_greedy(target, drafter, TREES[tree_name])


@pytest.mark.parametrize("tree_name", ["chain", "full"])
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_architecture_matrix(name, tree_name):
    """Each family's jittered copy (full attention, the draft model's matrix draft) drafting as PARD, greedy equal
    to transformers."""
    target = use_attention(build(name), "eager", next(f for f in FAMILIES if f.name == name))
    expect_greedy(target, matrix_prompt(), ParallelDraft(draft_of(name), parallel=3, mask_token_id=MASK),
                  TREES[tree_name])


@pytest.mark.parametrize("name", ["Mistral", "Gemma-3"])
def test_a_sliding_window_draft(name):
    """The target as its own PARD draft, its sliding windows kept: cropping the masks keeps the committed window."""
    target = build(name)
    expect_greedy(target, matrix_prompt(), ParallelDraft(perturbed(target, 0.05), parallel=3, mask_token_id=MASK),
                  Tree.full(2, 2))


def test_in_a_combination_and_its_timing_call(target, prompt, trained):
    """Beside another drafter in a Combined (accepted paths holding the other's tokens, fed next step), and the
    timing call: one pass per proposal, leaving the cache as it found it."""
    combined = Combined([SuffixDecoding(), ParallelDraft(trained, parallel=K, mask_token_id=MASK)])
    for tree in (Tree.full(2, 3), DynamicTree(8, 3, 2)):
        out = generate(target, prompt, drafter=combined, tree=tree, max_new_tokens=20)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 20))
    drafter = ParallelDraft(trained, parallel=K, mask_token_id=MASK)
    step = drafter.drafting_step(past_len=12, batch=2)
    for _ in range(2):
        step()
        assert drafter.cache.get_seq_length() == 12
    assert drafter.fills_tree_at_once and drafter.default_tree == Tree.chain(K) and drafter.max_tree_depth == K


# -- lossless: sampling ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=11, init_std=0.1)


SAMPLED = {"sampled-chain": ("sample", Tree.chain(2)), "sampled-tree": ("sample", Tree.full(2, 2)),
           "without-replacement": ("without_replacement", Tree.full(3, 2)),
           "ddtree-topk": ("topk", DynamicTree(5, 2, 2))}


NEW = 4  # continuations of four tokens: the first step after the prompt's drafts two depths, the second a mask's


@pytest.fixture(scope="module")
def law(small):
    return exact_distribution(small, Sampling(1.0), new=NEW)


@pytest.mark.parametrize("case", list(SAMPLED))
def test_sampling_is_lossless(small, law, case):
    candidates, tree = SAMPLED[case]
    drafter = ParallelDraft(perturbed(small, 1.0), parallel=3, mask_token_id=VOCAB - 1, candidates=candidates)
    seen = record_proposals(drafter)
    counts = sampled_counts(small, drafter, tree, Sampling(1.0), new=NEW)
    assert chi2_pvalue(counts, law) > 1e-3
    assert any(proposal.tree.depth == 2 for _, _, proposal in seen)  # depth 2 is drawn from the mask's distribution


def test_wrong_acceptance_is_detected(small, law, monkeypatch):
    monkeypatch.setattr(importlib.import_module("treespec.generate"), "walk_rows", row_by_row(accept_everything))
    drafter = ParallelDraft(perturbed(small, 1.0), parallel=3, mask_token_id=VOCAB - 1)
    assert chi2_pvalue(sampled_counts(small, drafter, Tree.chain(2), Sampling(1.0), new=NEW), law) < 1e-3


def test_a_wrong_distribution_at_a_masks_depth_is_detected(small, law, monkeypatch):
    """The second negative control: depth-2 candidates drawn from the mask's distribution but verified as if drawn
    from the root's (q_draft of depth-1 nodes replaced by the root's) must fail the same test."""
    import treespec.block_tree as block_tree

    honest = block_tree.static_block_proposals

    def lying(*args, **kwargs):
        proposals = honest(*args, **kwargs)
        inner = proposals.q_draft[:, 1:].sum(-1, keepdim=True) > 0  # nodes with children below the root
        proposals.q_draft[:, 1:] = torch.where(inner, proposals.q_draft[:, :1], proposals.q_draft[:, 1:])
        return proposals

    monkeypatch.setattr(block_tree, "static_block_proposals", lying)
    drafter = ParallelDraft(perturbed(small, 1.0), parallel=3, mask_token_id=VOCAB - 1, candidates="sample")
    assert chi2_pvalue(sampled_counts(small, drafter, Tree.chain(2), Sampling(1.0), new=NEW), law) < 1e-3

# -- host reads --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("rows", [1, 3])
def test_host_reads_per_step_no_more_than_dflash(target, tree_name, rows):
    ids = torch.randint(0, 16, (rows, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, :4] = 0
    torch.manual_seed(0)
    dflash = DFlashModel(target, block_size=4).eval()
    for temperature, candidates in ((0.0, "topk"), (1.0, "topk" if tree_name == "dynamic" else "sample")):
        reads = {}
        for name, drafter in (("pard", ParallelDraft(perturbed(target, 0.3), parallel=K, mask_token_id=MASK,
                                                     candidates=candidates)),
                              ("dflash", DFlash(dflash, candidates=candidates))):
            reads[name] = reads_per_step(target, ids, drafter=drafter, tree=TREES[tree_name], max_new_tokens=12,
                                         temperature=temperature, generator=torch.Generator().manual_seed(0),
                                         attention_mask=mask if rows > 1 else None)["device"]
        bound = 2 if tree_name == "dynamic" else 1  # a dynamic tree's shape is read once, after the pass
        # (per-step averages of runs with different numbers of passes: a dynamic tree's 2 reads a pass after the
        # first average a little under 2)
        assert reads["pard"] <= bound and reads["pard"] <= reads["dflash"] + 0.1, (temperature, reads)


# -- bad input ---------------------------------------------------------------------------------------------------------
def test_bad_input_is_named(target, prompt):
    draft = perturbed(target, 0.3)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match=r"parallel \(k, the positions one pass fills.*must be an integer >= 2"):
            ParallelDraft(draft, parallel=bad, mask_token_id=MASK)
    for bad in (64, -1, 1.0):
        with pytest.raises(ValueError, match=rf"mask token {bad!r} is not a token id of the draft's vocabulary of 64 "
                                             r"\(0 .. 63\)"):
            ParallelDraft(draft, parallel=K, mask_token_id=bad)
    marked = perturbed(target, 0.3)
    marked.config.pard_token, marked.config.pard_parallel = MASK, 0  # was read as the default 8
    with pytest.raises(ValueError, match=r"parallel \(k, the positions one pass fills.*integer >= 2, got 0"):
        ParallelDraft(marked)
    with pytest.raises(ValueError, match=r"deeper than the 4 levels ParallelDraft can fill: one pass fills 4 depths"):
        generate(target, prompt, drafter=ParallelDraft(draft, parallel=K), tree=Tree.chain(5), max_new_tokens=8)
    with pytest.raises(ValueError, match="grows deterministic top-k candidates"):
        generate(target, prompt, drafter=ParallelDraft(draft, parallel=K, candidates="sample"),
                 tree=DynamicTree(8, 3, 2), max_new_tokens=8, temperature=1.0)
    from treespec.train.checks import hybrids

    with pytest.raises(ValueError, match="a PARD draft needs a cache that can drop its mask tokens"):
        ParallelDraft(hybrids.build("LFM2"), parallel=K)
    # a comparison's drafter=pard entry whose source PARD did not adapt
    kind = registry.get("draft")
    with pytest.raises(ValueError, match="is a draft model that PARD did not adapt"):
        kind.check_module({"name": "draft", "recipe": "pard", "source": "reference:draft"}, draft)


@pytest.mark.parametrize("override, message", [
    ("drafter.parallel=1", r"drafter.parallel must be an integer >= 2, got 1"),
    ("drafter.anchors=0", r"drafter.anchors must be an integer >= 1"),
    ("drafter.mask_token_id=-3", r"drafter.mask_token_id must be a token id"),
    ("drafter.source=null", r"drafter.source must name the trained draft model PARD adapts"),
    ("drafter.ce_weight=-1", r"drafter.ce_weight must be a number >= 0"),
])
def test_bad_pard_configs_are_refused_before_any_model_loads(override, message):
    with pytest.raises(ValueError, match=message):
        drafter_job.check_config(compose_cfg("train_heads", ["drafter=pard", "target=/no/such/target", override]))


# -- the objective -----------------------------------------------------------------------------------------------------
def test_anchored_pass_equals_decoding_from_each_anchor(target):
    """Every anchor's masks in one pass (packed conversations too) give the outputs of the plain pass over [the
    tokens up to the anchor in its conversation, mask × (k − 1)]: what decoding computes."""
    draft = perturbed(target, 0.3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[1, 4, 9], [2, 6, 10]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        out = anchor_outputs(anchored_hidden(draft, ids, anchors, K, MASK, positions, segment_ids(positions)),
                             anchors, 12, K)  # [b, m, k, h]
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                start = a - int(positions[b, a])  # the anchor's conversation starts there
                seq = torch.cat([ids[b, start : a + 1], torch.full((K - 1,), MASK)])[None]
                expected = draft.base_model(input_ids=seq).last_hidden_state[0, -K:]
                torch.testing.assert_close(out[b, i], expected, atol=1e-5, rtol=1e-5)


def test_loss_falls_on_a_tiny_batch(target):
    model = perturbed(target, 0.3).train().requires_grad_(True)
    data = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, first = [], None
    torch.manual_seed(0)
    for _ in range(25):
        loss, metrics = pard_loss(target, model, data, parallel=K, mask_token_id=MASK, anchors=8)
        first = first or metrics
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert {f"kl{d}" for d in range(1, K + 1)} <= set(first) and first["kl"] == pytest.approx(first["kl1"])
    assert metrics["tau"] > first["tau"]
    # a loss mask scores only the trained tokens: none trained, nothing to learn
    none = pard_loss(target, model, {"input_ids": data, "loss_mask": torch.zeros_like(data)}, parallel=K,
                     mask_token_id=MASK)[0]
    assert none.item() == 0.0


# -- the recipe --------------------------------------------------------------------------------------------------------
def test_recipe_adapts_a_draft_folder_exports_loads_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(local_profile, "measure_cost_curve", lambda model, sizes, past_len, before=None:
                        measure_cost_curve(model, sizes, past_len=8, repeats=2, before=before))
    target_dir = tiny_chat_target(tmp_path / "target")
    target, _ = load_model(target_dir)
    torch.manual_seed(0)
    source_dir = tmp_path / "draft"
    chat_tokenizer(source_dir)
    new_draft_model(target, {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_key_value_heads": 2}).save_pretrained(source_dir)
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    common = [f"drafter.source={source_dir}", "drafter.parallel=3", "drafter.anchors=8", "drafter.accuracy_depth=3",
              "drafter.eval_tree.depth=3", "trainer.max_steps=6", "optim.lr=1e-2", "eval.expected_tau=null"]
    drafter_job.run(heads_cfg(tmp_path / "a", target_dir, data, *common, "trainer.stop_after=3", drafter="pard"))
    resumed = drafter_job.run(heads_cfg(tmp_path / "a", target_dir, data, *common, "resume=true", drafter="pard"))
    whole = drafter_job.run(heads_cfg(tmp_path / "b", target_dir, data, *common, drafter="pard"))
    assert whole["steps"] == resumed["steps"] == 6
    a, b = (load_file(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    final = tmp_path / "b" / "final"
    module, _ = load_model(final)
    assert (module.config.pard_token, module.config.pard_parallel, module.config.spd_type) == \
        (module.config.vocab_size - 1, 3, "pard")
    kind = registry.get("draft")
    assert kind.max_depth(module) == 3 and len(kind.rank_accuracy(target, module, torch.randint(0, 50, (2, 12)))) == 3
    drafter = load(final, target)
    assert isinstance(drafter, ParallelDraft) and drafter.parallel == 3
    assert type(kind.make(load_model(source_dir)[0])) is DraftModel  # the source stays a plain draft
    prompt = torch.randint(0, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    for tree in (Tree.chain(3), Tree.full(2, 2), DynamicTree(6, 3, 2)):
        out = generate(target, prompt, drafter=drafter, tree=tree, max_new_tokens=12)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 12)), tree

