import torch
from treespec import generate, Tree
from treespec.dynamic_tree import DynamicTree
from treespec.heads import PromptLookup, DraftModel
from treespec.inputs import left_padded
from tests.tiny_models import tiny_llama, hf_greedy, perturbed
t = tiny_llama(seed=0)
g = torch.Generator().manual_seed(3)
prompts = [torch.randint(0, 64, (n,), generator=g) for n in (3, 17, 9, 1)]
ids, mask = left_padded(prompts, 0)
ref = t.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
for scale in (0.05, 0.1, 0.2):
  for tree in (Tree.chain(3), Tree.full(2,2), DynamicTree(8, 3, 2)):
    out = generate(t, ids, attention_mask=mask, drafter=DraftModel(perturbed(t, scale)), tree=tree, max_new_tokens=30)
    print(scale, tree, torch.equal(out.sequences, ref), [round(r.mean_accept_length,2) for r in out.rows], out.target_passes)
# eos at different steps
eos = int(ref[1, ids.shape[1] + 4])
refe = t.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0, eos_token_id=eos)
print(refe[:, ids.shape[1]:])
out = generate(t, ids, attention_mask=mask, drafter=DraftModel(perturbed(t, 0.1)), tree=Tree.full(2,2), max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
print(torch.equal(out.sequences, refe), out.sequences.shape, refe.shape)
