"""generate(..., compile=True): the target's tree pass and a network drafter's depth step as torch.compile'd static
graphs (treespec/static_pass.py). Over 32 decoding steps and more dynamo compiles one graph per shape (rows, tree
tokens, cache capacity) the first time that shape runs, then none, and greedy output equals the uncompiled run, on
the shipped reference models: plain decoding, a draft model's chain, EAGLE's static tree, a ragged batch.

The counting tests trace with ``backend="eager"`` semantics (a backend that counts and runs the traced graph as it
is: dynamo's tracing, guards and fullgraph checks, no code generation); the slow test runs inductor itself."""

import sys

import pytest
import torch

from treespec import Tree, generate, reference
from treespec.heads import DraftModel, load
from treespec.inputs import check_inputs
from treespec.planning.bench import Config, measure
from treespec.static_pass import StaticPass
from treespec.train.checks.architectures import build

MAX_NEW = {"vanilla": 33, "draft chain 3": 96, "eagle full 2x2": 128}  # each run takes 32 steps or more
# the shapes each run meets: the target's tree (N = 1, 4, 7 tokens: the last steps verify the whole tree, not a
# truncated one), and a drafter's depth steps (one frontier node a depth for the chain, two for the 2×2 tree)
SHAPES = {"vanilla": 1, "draft chain 3": 2, "eagle full 2x2": 2}


@pytest.fixture(scope="module")
def models():
    target, tokenizer = reference.load("target")
    draft, _ = reference.load("draft")
    ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    return target, draft, ids


def make(name, target, draft) -> dict:
    if name == "vanilla":
        return {}
    if name == "draft chain 3":
        return {"drafter": DraftModel(draft), "tree": Tree.chain(3)}
    return {"drafter": load("reference:eagle", target), "tree": Tree.full(2, 2)}


class Counting:
    """A dynamo backend that counts the graphs it is given and runs them as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.fixture
def passes(monkeypatch):
    """Every StaticPass a generate call makes (the target's, the drafter's), each recording per call whether the
    shape was new to it and how many graphs the backend compiled during the call."""
    made = []

    class Recorded(StaticPass):
        counter: Counting | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = []
            made.append(self)

        def __call__(self, *args):
            known, before = len(self.shapes), Recorded.counter.graphs
            out = super().__call__(*args)
            self.calls.append((len(self.shapes) > known, Recorded.counter.graphs - before))
            return out

    monkeypatch.setattr(sys.modules["treespec.generate"], "StaticPass", Recorded)  # (the package exports generate())
    monkeypatch.setattr(sys.modules["treespec.heads.drafting.expansion"], "StaticPass", Recorded)
    return Recorded, made


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "draft chain 3" else n
                                  for n in MAX_NEW])  # the chain's shapes are the 2x2 tree's: -m slow
def test_one_compilation_per_shape_then_none_and_greedy_equals_eager(models, passes, name):
    target, draft, ids = models
    recorded, made = passes
    torch._dynamo.reset()  # no graph of an earlier test serves this one
    recorded.counter = counter = Counting()
    eager = generate(target, ids, max_new_tokens=MAX_NEW[name], **make(name, target, draft))
    compiled = generate(target, ids, max_new_tokens=MAX_NEW[name], compile={"backend": counter},
                        **make(name, target, draft))
    assert compiled.passes >= 32
    assert torch.equal(compiled.sequences, eager.sequences)
    first = list(made)
    # one graph per shape, compiled on that shape's first pass, none on any later pass
    assert [graphs for _, graphs in (c for p in first for c in p.calls)] == \
        [int(new) for new, _ in (c for p in first for c in p.calls)]
    assert counter.graphs == sum(len(p.shapes) for p in first) == SHAPES[name]
    if name != "vanilla":  # the drafter's depth step ran compiled too
        assert len(first) == 2 and first[1].calls
    # a second call (new drafter, new cache buffers, the same shapes) compiles nothing
    again = generate(target, ids, max_new_tokens=MAX_NEW[name], compile={"backend": counter},
                     **make(name, target, draft))
    assert torch.equal(again.sequences, eager.sequences)
    assert counter.graphs == sum(len(p.shapes) for p in first)


def test_a_ragged_batch_compiled_equals_eager(models):
    """Rows that accept differently leave holes and finish at different steps: masks and positions per row, a new
    graph when the batch shrinks; the output is the uncompiled run's."""
    target, draft, _ = models
    tokenizer = reference.load("target")[1]
    tokenizer.padding_side = "left"
    batch = tokenizer(["def fibonacci(n):\n", "import os\nimport sys\n", "class A:\n"], return_tensors="pt",
                      padding=True)
    kwargs = {"attention_mask": batch.attention_mask, "max_new_tokens": 24,
              "eos_token_id": tokenizer.eos_token_id}
    torch._dynamo.reset()
    eager = generate(target, batch.input_ids, drafter=DraftModel(draft), tree=Tree.full(2, 2), **kwargs)
    compiled = generate(target, batch.input_ids, drafter=DraftModel(draft), tree=Tree.full(2, 2),
                        compile={"backend": Counting()}, **kwargs)
    assert torch.equal(compiled.sequences, eager.sequences)


@pytest.mark.slow
def test_the_comparisons_warm_up_compiles_every_shape_its_timed_runs_meet(models):
    """bench.measure with compile (the comparison's ``compile: true``): prompts of two cache capacities, each
    configuration warmed up at full budget on one prompt of each, so no graph is compiled inside a timed run."""
    target, draft, ids = models
    torch._dynamo.reset()
    counter, at_first_run = Counting(), []
    prompts = [ids, torch.cat([ids] * 40, dim=1)]  # 7 and 280 tokens: capacities 256 and 512
    rows = measure(target, [Config("chain 3", DraftModel(draft), Tree.chain(3))], prompts, max_new_tokens=12,
                   compile={"backend": counter},
                   progress=lambda name, i: at_first_run.append(counter.graphs) if not at_first_run else None)
    assert [r.name for r in rows] == ["vanilla", "chain 3"]
    assert at_first_run == [counter.graphs] and counter.graphs == 6  # (vanilla 1, the chain 2) × 2 capacities


def test_bad_compile_arguments_are_named(models):
    target, _, ids = models
    with pytest.raises(ValueError, match="unknown key.*fullgraph"):
        generate(target, ids, max_new_tokens=2, compile={"fullgraph": False})
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        generate(target, ids, max_new_tokens=2, compile="yes")


def test_whole_trees_only_where_their_positions_stay_in_range(models):
    """A static pass verifies the whole tree in the last steps (one graph per tree), unless its deepest node would
    pass the target's positions (1,024 here); then the tree is cut as in eager decoding."""
    target, draft, _ = models
    prompt = torch.ones(1, 1000, dtype=torch.long)

    def whole(max_new_tokens, compile_with):
        return check_inputs(target, prompt, drafter=DraftModel(draft), tree=Tree.chain(3), temperature=0.0,
                            max_new_tokens=max_new_tokens, top_p=1.0, eos_token_id=None, generator=None,
                            acceptance="rejection", compile=compile_with).whole_trees

    assert whole(21, {"backend": "eager"}) and not whole(22, {"backend": "eager"}) and not whole(21, False)


def test_a_target_whose_passes_cannot_be_static_is_refused():
    model = build("Mistral", seed=0)  # sliding-window layers keep a cache of their own length
    with pytest.raises(ValueError, match="sliding-window"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, compile=True)


@pytest.mark.slow
def test_inductor_compiles_each_shape_once_and_equals_eager(models):
    """The real backend (inductor's C++ code on a CPU): equal greedy output, and dynamo's own count of compiled
    graphs does not grow on a second run."""
    from torch._dynamo.utils import counters

    target, draft, ids = models
    torch._dynamo.reset()
    for name in ("vanilla", "draft chain 3"):
        eager = generate(target, ids, max_new_tokens=40, **make(name, target, draft))
        compiled = generate(target, ids, max_new_tokens=40, compile=True, **make(name, target, draft))
        assert torch.equal(compiled.sequences, eager.sequences)
        graphs = counters["stats"]["unique_graphs"]
        again = generate(target, ids, max_new_tokens=40, compile=True, **make(name, target, draft))
        assert torch.equal(again.sequences, eager.sequences)
        assert counters["stats"]["unique_graphs"] == graphs > 0
