"""Every helper that more than one test module uses. Test modules import helpers from here (``from .helpers
import ...``), never from one another (tests/test_layering.py checks it)."""

from .chat_data import (
    BAD_ROWS,
    TINY_DRAFT,
    WORDS,
    chat_tokenizer,
    conversations,
    heads_cfg,
    tiny_chat_target,
    write_jsonl,
)
from .lossless_law import NEW, PROMPT, RUNS, VOCAB, accept_everything, chi2_pvalue, exact_distribution, sampled_counts
from .models import (
    CONF,
    compose_cfg,
    hf_greedy,
    perturbed,
    random_eagle,
    random_eagle3,
    random_heads,
    random_hydra,
    tiny_llama,
    tiny_trained_target,
)
from .processes import assert_ok, free_port, run_killed, run_ranks
from .proposals import (
    accept_deepest,
    accept_random_prefix,
    block_proposal,
    expect_batched_greedy,
    proposed_while_accepting,
    record_proposals,
    scratch_logits,
    scratch_proposal,
)
from .upstream_checkpoints import (
    INTEROP_PROMPT,
    UPSTREAM_CASES,
    check_proposal,
    eagle1_official,
    eagle3_layer,
    eagle3_specforge,
    eagle3_speculators,
    fresh_drafter,
    interop_targets,
    medusa1,
    norm_w,
    proposals_of,
    recorded_run,
    rnd,
    speculators_config,
    synthesise,
    target_hidden_states,
    tiny_qwen2,
    write_checkpoint,
)
from .walker_world import ALPHA, GREEDY, T07, T1, UNEVEN, WALKS, World, first_two_counts, logits_with_argmax
from .wandb_logs import wandb_run_contains

__all__ = [
    "ALPHA", "BAD_ROWS", "CONF", "GREEDY", "INTEROP_PROMPT", "NEW", "PROMPT", "RUNS", "T07", "T1", "TINY_DRAFT",
    "UNEVEN",
    "UPSTREAM_CASES", "VOCAB", "WALKS", "WORDS", "World", "accept_deepest", "accept_everything", "assert_ok",
    "accept_random_prefix", "block_proposal", "expect_batched_greedy", "proposed_while_accepting",
    "chat_tokenizer",
    "check_proposal", "chi2_pvalue", "compose_cfg", "conversations", "eagle1_official", "eagle3_layer",
    "eagle3_specforge", "eagle3_speculators", "exact_distribution", "first_two_counts", "free_port", "fresh_drafter",
    "heads_cfg", "hf_greedy", "interop_targets", "logits_with_argmax", "medusa1", "norm_w", "perturbed",
    "proposals_of", "random_eagle", "random_eagle3", "random_heads", "random_hydra", "record_proposals",
    "recorded_run", "rnd",
    "run_killed", "run_ranks", "sampled_counts", "scratch_logits", "scratch_proposal", "speculators_config",
    "synthesise",
    "target_hidden_states", "tiny_chat_target", "tiny_llama", "tiny_qwen2", "tiny_trained_target",
    "wandb_run_contains", "write_checkpoint", "write_jsonl",
]
