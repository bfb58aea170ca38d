"""Host reads per decoding step (treespec/host_reads.py): each one waits for an accelerator's queue to drain, so
the loop reads back once a step, the accepted tokens (docs/design.md, "Host reads per step"). The counter counts
reads of tensors that derive from the models and inputs and not of host bookkeeping; every drafter and tree kind,
greedy and sampled, is held to its bound so the number cannot creep back."""

import pytest
import torch

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, ParallelDraft, PromptLookup
from treespec.heads.eagle import Eagle
from treespec.heads.eagle3 import Eagle3
from treespec.heads.hydra import Hydra
from treespec.heads.medusa import Medusa
from treespec.host_reads import HostReads, reads_per_step

from tests.helpers import perturbed, random_eagle, random_eagle3, random_heads, random_hydra, tiny_llama


def test_the_counter_tells_device_reads_from_host_bookkeeping():
    model = torch.nn.Linear(4, 3)
    host = torch.arange(5)
    with HostReads(model) as reads:
        out = model(torch.ones(2, 4))  # derives from the parameters: on the device
        out.argmax(-1).tolist()
        int(out[0, 0] > 0)
        host.tolist()  # host data: no wait
        copy = out.cpu()  # the one read; the copy is then free to read
        copy.tolist()
        out[out > 0]  # boolean-mask indexing: a value-dependent shape
        torch.tensor([1, 2], device=out.device)  # an upload, not a read
        host.to(out.device)  # an upload too (a no-op on a CPU: the host tensor stays one)
        host.tolist()
    assert (reads.device, reads.all, reads.uploads) == (4, 7, 2)
    assert {call for (_, call) in reads.sites} == {"tolist", "__int__", "cpu", "__getitem__"}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=1)


DRAFTERS = {
    "draft": lambda t: DraftModel(perturbed(t, 0.3)),
    "draft-sampled": lambda t: DraftModel(perturbed(t, 0.3), candidates="sample"),
    "pard": lambda t: ParallelDraft(perturbed(t, 0.3), parallel=4),  # one pass per step, trees over its k depths
    "eagle": lambda t: Eagle(random_eagle(t)),
    "eagle3": lambda t: Eagle3(random_eagle3(t, draft_vocab=24)),
    "medusa": lambda t: Medusa(random_heads(t)),
    "hydra": lambda t: Hydra(random_hydra(t)),
    "hydra-prefix": lambda t: Hydra(random_hydra(t, prefix_attention=True)),  # its layer's cache, fed every step
    "hydra-sampled": lambda t: Hydra(random_hydra(t), candidates="sample"),
    "prompt_lookup": lambda t: PromptLookup(max_ngram=2),
}
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 2)}
CASES = [("vanilla", None)] + [(kind, tree) for kind in DRAFTERS for tree in TREES
                               if not (tree == "dynamic" and (kind in ("medusa", "prompt_lookup", "draft-sampled")
                                                                       or kind.startswith("hydra")))]


def bound(kind, tree) -> int:
    """Device reads per step, greedy or sampled: the accepted tokens; a dynamic tree's shape, read once after its
    last depth (the target's mask is built from it on the host); prompt lookup's committed tokens (its index is
    on the host)."""
    return 2 if tree == "dynamic" or kind == "prompt_lookup" else 1


def counted(target, kind, tree, ids, **options) -> list[float]:
    drafter = None if kind == "vanilla" else DRAFTERS[kind](target)
    return [reads_per_step(target, ids, drafter=drafter, tree=None if tree is None else TREES[tree], max_new_tokens=16,
                           temperature=temperature, generator=torch.Generator().manual_seed(0), **options)["device"]
            for temperature in (0.0, 1.0)]


@pytest.mark.parametrize("kind,tree", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_reads_per_step(target, kind, tree):
    ids = torch.randint(0, 16, (1, 24), generator=torch.Generator().manual_seed(0))  # prompt lookup finds matches
    greedy, sampled = counted(target, kind, tree, ids)
    assert greedy <= bound(kind, tree) and sampled <= bound(kind, tree), (greedy, sampled)


@pytest.mark.parametrize("kind,tree", [("draft", "full"), ("eagle", "dynamic"), ("prompt_lookup", "chain"),
                                       ("hydra-prefix", "full")])
def test_reads_per_step_in_a_batch(target, kind, tree):
    """Rows of different lengths that accept different numbers of tokens and leave the batch at their budget: still
    one read a step for all of them."""
    ids = torch.randint(0, 16, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5], mask[2, :11] = 0, 0
    greedy, sampled = counted(target, kind, tree, ids, attention_mask=mask)
    assert greedy <= bound(kind, tree) and sampled <= bound(kind, tree), (greedy, sampled)
