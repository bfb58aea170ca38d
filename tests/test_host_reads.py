"""Host reads per decoding step (treespec/host_reads.py): each one waits for an accelerator's queue to drain, so
the loop reads back once a step, the accepted tokens (docs/design.md, "Host reads per step"). The counter counts
reads of tensors that derive from the models and inputs and not of host bookkeeping; every drafter and tree kind,
greedy and sampled, is held to its bound so the number cannot creep back."""

import pytest
import torch

from treespec import Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import DraftModel, PromptLookup
from treespec.heads.eagle import Eagle
from treespec.heads.eagle3 import Eagle3
from treespec.heads.medusa import Medusa
from treespec.host_reads import HostReads, reads_per_step

from .helpers import perturbed, random_eagle, random_eagle3, random_heads, tiny_llama


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
    assert (reads.device, reads.all, reads.uploads) == (4, 6, 1)
    assert {call for (_, call) in reads.sites} == {"tolist", "__int__", "cpu", "__getitem__"}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=1)


DRAFTERS = {
    "draft": lambda t: DraftModel(perturbed(t, 0.3)),
    "draft-sampled": lambda t: DraftModel(perturbed(t, 0.3), candidates="sample"),
    "eagle": lambda t: Eagle(random_eagle(t)),
    "eagle3": lambda t: Eagle3(random_eagle3(t, draft_vocab=24)),
    "medusa": lambda t: Medusa(random_heads(t)),
    "prompt_lookup": lambda t: PromptLookup(max_ngram=2),
}
TREES = {"chain": Tree.chain(3), "full": Tree.full(2, 2), "dynamic": DynamicTree(8, 3, 2)}
# device reads per step, greedy and sampled (T = 1): the most each may make
BOUNDS = {
    ('vanilla', None): (2.0, 5.0),
    ('draft', 'chain'): (7.4, 11.5),
    ('draft', 'full'): (6.0, 9.7),
    ('draft', 'dynamic'): (10.8, 14.2),
    ('draft-sampled', 'chain'): (7.4, 18.0),
    ('draft-sampled', 'full'): (6.0, 14.8),
    ('eagle', 'chain'): (9.3, 13.3),
    ('eagle', 'full'): (6.7, 10.9),
    ('eagle', 'dynamic'): (12.0, 16.4),
    ('eagle3', 'chain'): (6.6, 10.5),
    ('eagle3', 'full'): (4.8, 8.8),
    ('eagle3', 'dynamic'): (9.3, 13.3),
    ('medusa', 'chain'): (2.0, 6.0),
    ('medusa', 'full'): (2.0, 6.0),
    ('prompt_lookup', 'chain'): (3.0, 6.3),
    ('prompt_lookup', 'full'): (3.0, 6.2),
}
CASES = [("vanilla", None)] + [(kind, tree) for kind in DRAFTERS for tree in TREES
                               if not (tree == "dynamic" and kind in ("medusa", "prompt_lookup", "draft-sampled"))]


@pytest.mark.parametrize("kind,tree", CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_reads_per_step(target, kind, tree):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (1, 24), generator=g)  # a small alphabet: prompt lookup finds matches
    drafter = None if kind == "vanilla" else DRAFTERS[kind](target)
    found = []
    for temperature in (0.0, 1.0):
        counts = reads_per_step(target, ids, drafter=drafter, tree=None if tree is None else TREES[tree],
                                max_new_tokens=24, temperature=temperature, generator=torch.Generator().manual_seed(0))
        found.append(counts["device"])
    bound = BOUNDS[kind, tree]
    assert found[0] <= bound[0] and found[1] <= bound[1], (found, bound)
