"""What the interop tests (tests/heads/test_interop_load.py, tests/heads/test_interop_export.py) check upstream drafters
against: tiny random Llama and Qwen2 targets, the reference forwards of EAGLE-1/2, EAGLE-3 and Medusa written out
from the published equations (plain tensor ops, no transformers or treespec modules), ``recorded_run`` and
``check_proposal`` (a loaded drafter's proposals against a reference), and ``proposals_of`` and ``fresh_drafter``
for the export → load round trips. The checkpoints themselves: tests/helpers/upstream_checkpoints.py.
"""

import math

import torch
import torch.nn.functional as F

from treespec import Tree, generate
from treespec.heads.eagle import EagleModel
from treespec.heads.eagle3.network import Eagle3Model, build_vocab_map
from treespec.heads.medusa import MedusaHeads
from treespec.sampling import probs

from .models import tiny_llama
from .proposals import record_proposals


# -- targets ------------------------------------------------------------------------------------------------
def tiny_qwen2(vocab=64, layers=4, seed=0, rope_theta=1e6):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, initializer_range=0.2,
                         attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen2ForCausalLM(config).eval()


def tiny_qwen3(vocab=64, layers=4, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         initializer_range=0.2, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    return Qwen3ForCausalLM(config).eval()


TARGETS = {"llama": lambda: tiny_llama(layers=4, seed=0), "qwen2": lambda: tiny_qwen2()}



def interop_targets() -> dict:
    """The targets by name (a module-scoped fixture in each interop test module builds them once)."""
    return {name: make() for name, make in TARGETS.items()}


INTEROP_PROMPT = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))


# -- the published equations, written out (no transformers or treespec modules) ------------------------------
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """x [heads, n, d] at positions 0..n-1, rotate-half convention (Llama / EAGLE)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def lin(x, t, name):
    y = x @ t[f"{name}.weight"].T
    return y + t[f"{name}.bias"] if f"{name}.bias" in t else y


def attention(x, t, p, heads, kv_heads, d, theta):
    """Causal GQA self-attention over x [n, in] with RoPE; weights ``{p}self_attn.{q,k,v,o}_proj``."""
    n = x.shape[0]
    q = rope(lin(x, t, p + "self_attn.q_proj").view(n, heads, d).transpose(0, 1), theta)
    k = rope(lin(x, t, p + "self_attn.k_proj").view(n, kv_heads, d).transpose(0, 1), theta)
    v = lin(x, t, p + "self_attn.v_proj").view(n, kv_heads, d).transpose(0, 1)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(d) + torch.full((n, n), float("-inf")).triu(1)
    return lin((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d), t, p + "self_attn.o_proj")


def mlp(x, t, p):
    return lin(F.silu(lin(x, t, p + "mlp.gate_proj")) * lin(x, t, p + "mlp.up_proj"), t, p + "mlp.down_proj")


def target_hidden_states(target, ids):
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True).hidden_states  # L + 1 × [1, n, H]


def eagle1_reference(t, c, target):
    """EAGLE-1/2 (cnets1.py): x = fc(cat(embed(token), feature)); layer 0 without input norm; no final norm;
    the target's lm_head. ``logits_at(committed, path)`` → the draft logits after ``path`` (tree tokens)."""
    heads, eps, theta = c["num_attention_heads"], c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
    h = t["fc.weight"].shape[0]
    d, kv = h // heads, t["layers.0.self_attn.k_proj.weight"].shape[0] // (h // heads)
    embed = t.get("embed_tokens.weight", target.get_input_embeddings().weight)
    head = target.get_output_embeddings().weight
    layers = len({k.split(".")[1] for k in t if k.startswith("layers.")})

    def forward(tokens, feats):
        x = lin(torch.cat([embed[tokens], feats], -1), t, "fc")
        for i in range(layers):
            p = f"layers.{i}."
            y = x if i == 0 else rms(x, t[p + "input_layernorm.weight"], eps)
            x = x + attention(y, t, p, heads, kv, d, theta)
            x = x + mlp(rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p)
        return x  # [n, H]: predicted features

    def logits_at(committed, path):
        with torch.no_grad():
            feats = target_hidden_states(target, committed[:, :-1])[-1][0]  # final-norm features of positions 0..L-2
            tokens = committed[0, 1:].tolist()
            for token in path:  # a tree node pairs its token with its parent's output
                out = forward(torch.tensor(tokens), feats)
                tokens, feats = tokens + [token], torch.cat([feats, out[-1:]])
            return forward(torch.tensor(tokens), feats)[-1] @ head.T

    return logits_at


def eagle3_reference(t, c, target, aux, norm_before_residual=False):
    """EAGLE-3 (cnets.py LlamaDecoderLayeremb; speculators' norm_before_residual): h = fc(cat(aux states));
    x = cat(input_layernorm(embed), hidden_norm(h)); h' = residual + attn(x); out = h' + mlp(post_norm(h'));
    logits = lm_head(norm(out)) over the draft vocabulary, target id = draft id + d2t; nodes feed ``out``."""
    heads, eps, theta = c["num_attention_heads"], c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0)
    h = t["fc.weight"].shape[0]
    d = c.get("head_dim") or h // heads
    kv = t["midlayer.self_attn.k_proj.weight"].shape[0] // d
    embed = t.get("embed_tokens.weight", target.get_input_embeddings().weight)
    vocab = target.get_output_embeddings().weight.shape[0]
    ids = torch.arange(t["lm_head.weight"].shape[0]) + t["d2t"] if "d2t" in t else torch.arange(vocab)

    def forward(tokens, hidden):
        normed = rms(hidden, t["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([rms(embed[tokens], t["midlayer.input_layernorm.weight"], eps), normed], -1)
        hidden = (normed if norm_before_residual else hidden) + attention(x, t, "midlayer.", heads, kv, d, theta)
        return hidden + mlp(rms(hidden, t["midlayer.post_attention_layernorm.weight"], eps), t, "midlayer.")

    def logits_at(committed, path):
        with torch.no_grad():
            states = target_hidden_states(target, committed[:, :-1])
            feats = lin(torch.cat([states[i][0] for i in aux], -1), t, "fc")
            tokens = committed[0, 1:].tolist()
            for token in path:
                out = forward(torch.tensor(tokens), feats)
                tokens, feats = tokens + [token], torch.cat([feats, out[-1:]])
            draft = rms(forward(torch.tensor(tokens), feats)[-1], t["norm.weight"], eps) @ t["lm_head.weight"].T
            return torch.full((vocab,), float("-inf")).index_copy(0, ids, draft)

    return logits_at


def medusa_reference(blocks, heads_lm, target):
    """Medusa: head k = lm_k(ResBlock^L(f)), ResBlock(x) = x + SiLU(W x + b), f the final-norm feature before
    the root. ``blocks[k]`` = [(W, b), ...]; ``heads_lm[k]`` = the head's projection (None: the target's)."""
    head = target.get_output_embeddings().weight

    def logits_at(committed, path):
        with torch.no_grad():
            x = target_hidden_states(target, committed[:, :-1])[-1][0, -1]
            for w, b in blocks[len(path)]:
                x = x + F.silu(x @ w.T + (0 if b is None else b))
            lm = heads_lm[len(path)]
            return x @ (head if lm is None else lm).T

    return logits_at


# -- proposals against the reference ---------------------------------------------------------------------------
def recorded_run(drafter, target, tree, max_new_tokens=12, **kwargs):
    """generate() with every proposal recorded: (result, [(committed, proposal), ...]) (one prompt: one row)."""
    propose = drafter.propose
    seen = record_proposals(drafter)
    out = generate(target, INTEROP_PROMPT, drafter=drafter, tree=tree, max_new_tokens=max_new_tokens, **kwargs)
    drafter.propose = propose
    return out, [(committed, proposal) for committed, _, proposal in seen]


def check_proposal(committed, proposal, logits_at, sampling=None):
    """Every node's children are what the reference says: the rank-r child is the reference's r-th likeliest
    token (top-k candidates), or q_draft at the node is the reference's distribution (sampled ones)."""
    tree, tokens = proposal.tree, [None, *proposal.tokens.tolist()]
    paths = {0: []}
    for i in range(1, tree.num_nodes):
        paths[i] = [*paths[int(tree.parents[i])], tokens[i]]
    checked = 0
    for i in range(tree.num_nodes):
        kids = list(tree.children[i])
        if not kids:
            continue
        ref = logits_at(committed, paths[i]).float()
        if proposal.q_draft is None:
            order = ref.sort(descending=True).values
            for kid in kids:
                rank = int(tree.ranks[kid])
                assert abs(float(ref[tokens[kid]] - order[rank])) < 1e-4, (i, kid, rank)
        else:
            q = probs(ref, sampling)
            assert torch.allclose(proposal.q_draft[i].float(), q, atol=1e-5), i
            assert all(float(q[tokens[k]]) > 0 for k in kids)
        checked += 1
    return checked



# -- export → load round trips ----------------------------------------------------------------------------------
ROUND_TRIP_TREE = Tree.full(2, 2)


def proposals_of(drafter, target, tree=ROUND_TRIP_TREE):
    out, seen = recorded_run(drafter, target, tree, max_new_tokens=8)
    return out.sequences.tolist(), [(p.tree.paths, p.tokens.tolist()) for _, p in seen]


def fresh_drafter(kind, target, seed=0):
    """Drafters built in treespec (random weights), in the form each consumer can take."""
    torch.manual_seed(seed)
    if kind == "eagle":
        model = EagleModel(target, variant="upstream", layer_overrides={"num_hidden_layers": 2})
    elif kind == "eagle3":
        model = Eagle3Model(target, vocab_map=build_vocab_map(torch.randint(0, 100, (64,)), 24))
    else:
        model = MedusaHeads(32, 64, num_heads=3, num_layers=1, share_lm_head=False,
                            lm_head=target.get_output_embeddings())
        with torch.no_grad():
            for block in model.blocks:
                block[0].linear.weight.normal_(0, 0.3)
                block[0].linear.bias.normal_(0, 0.1)
    return model.eval()
