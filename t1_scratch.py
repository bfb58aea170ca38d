import torch
from treespec import generate, Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import PromptLookup, DraftModel
from treespec.inputs import left_padded
from tests.tiny_models import tiny_llama, hf_greedy, perturbed
t = tiny_llama(seed=0)
g = torch.Generator().manual_seed(3)
p = torch.randint(0, 64, (1, 9), generator=g)
for tree in (Tree.chain(3), Tree.full(2,2), DynamicTree(8, 3, 2)):
    out = generate(t, p, drafter=DraftModel(perturbed(t)), tree=tree, max_new_tokens=40)
    print(torch.equal(out.sequences, hf_greedy(t, p, 40)), out.accept_lengths)
prompts = [torch.randint(0, 64, (n,), generator=g) for n in (3, 17, 9, 1)]
ids, mask = left_padded(prompts, 0)
ref = t.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
for tree in (Tree.chain(3), Tree.full(2,2), DynamicTree(8, 3, 2)):
  for d in (t, perturbed(t), tiny_llama(seed=7)):
    out = generate(t, ids, attention_mask=mask, drafter=DraftModel(d), tree=tree, max_new_tokens=30)
    print(tree, torch.equal(out.sequences, ref), [r.mean_accept_length for r in out.rows])
