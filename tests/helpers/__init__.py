"""Every helper that more than one test module uses. Test modules import helpers from here (``from .helpers
import ...``), never from one another (tests/test_layering.py checks it)."""

from .batch_rows import (
    BATCH_DRAFTERS,
    BATCH_LENGTHS,
    ROW_COPIES,
    ROW_NEW,
    ROW_PROMPTS,
    ROW_RUNS,
    ROW_VOCAB,
    STATIC_ONLY,
    batch,
    exact_row_distribution,
    hf_batch_greedy,
    sampled_rows,
)
from .chat_data import (
    BAD_ROWS,
    SPEC_BENCH_ROWS,
    TINY_DRAFT,
    WORDS,
    chat_tokenizer,
    conversations,
    heads_cfg,
    stopped_run_resumes_exactly,
    tiny_chat_target,
    write_jsonl,
)
from .dflash_drafters import dflash_prompt, dflash_target, random_dflash, trained_dflash
from .lossless_law import NEW, PROMPT, RUNS, VOCAB, accept_everything, chi2_pvalue, exact_distribution, sampled_counts
from .models import (
    CONF,
    ROOT,
    compose_cfg,
    hf_greedy,
    perturbed,
    random_eagle,
    random_eagle3,
    random_heads,
    random_hydra,
    tiny_llama,
    train_tiny_lm,
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
from .report_results import REPORT_PEERS, REPORT_PLAN, md_table_of, rendered_run, synthetic_result, with_categories
from .upstream_checkpoints import (
    UPSTREAM_CASES,
    eagle1_official,
    eagle3_layer,
    eagle3_specforge,
    eagle3_speculators,
    medusa1,
    norm_w,
    rnd,
    speculators_config,
    synthesise,
    write_checkpoint,
)
from .upstream_reference import (
    INTEROP_PROMPT,
    check_proposal,
    fresh_drafter,
    interop_targets,
    proposals_of,
    recorded_run,
    target_hidden_states,
    tiny_qwen2,
    tiny_qwen3,
)
from .walker_world import ALPHA, GREEDY, T07, T1, UNEVEN, WALKS, World, first_two_counts, logits_with_argmax
from .wandb_logs import wandb_run_contains

__all__ = [
    "BATCH_DRAFTERS",
    "BATCH_LENGTHS",
    "ROW_COPIES",
    "ROW_NEW",
    "ROW_PROMPTS",
    "ROW_RUNS",
    "ROW_VOCAB",
    "STATIC_ONLY",
    "batch",
    "exact_row_distribution",
    "hf_batch_greedy",
    "sampled_rows",
    "accept_deepest", "accept_everything", "accept_random_prefix", "ALPHA", "assert_ok", "BAD_ROWS",
    "block_proposal", "chat_tokenizer", "check_proposal", "chi2_pvalue", "compose_cfg", "CONF", "conversations",
    "dflash_prompt", "dflash_target", "eagle1_official", "eagle3_layer", "expect_batched_greedy", "GREEDY",
    "INTEROP_PROMPT", "NEW", "PROMPT", "proposed_while_accepting", "REPORT_PEERS", "REPORT_PLAN", "ROOT", "RUNS",
    "SPEC_BENCH_ROWS", "T07", "T1", "TINY_DRAFT", "UNEVEN", "UPSTREAM_CASES", "VOCAB", "WALKS", "WORDS", "World",
    "eagle3_specforge", "eagle3_speculators", "exact_distribution", "first_two_counts", "free_port", "fresh_drafter",
    "heads_cfg", "hf_greedy", "interop_targets", "logits_with_argmax", "md_table_of", "medusa1", "norm_w", "perturbed",
    "proposals_of", "random_dflash", "random_eagle", "random_eagle3", "random_heads", "random_hydra",
    "record_proposals", "recorded_run", "rendered_run", "rnd", "run_killed", "run_ranks", "sampled_counts",
    "scratch_logits", "scratch_proposal", "speculators_config", "stopped_run_resumes_exactly", "synthesise",
    "synthetic_result",
    "target_hidden_states", "tiny_chat_target", "tiny_llama", "tiny_qwen2", "tiny_qwen3", "train_tiny_lm",
    "trained_dflash", "wandb_run_contains", "with_categories", "write_checkpoint", "write_jsonl"
]
