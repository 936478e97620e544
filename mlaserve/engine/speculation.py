"""Which engines and requests speculate, and what stats() says of it.

Built so far: prompt-lookup (n-gram) drafts verified greedily, exact for greedy requests on the eager path. Not yet:
rejection sampling for requests that sample (temperature > 0), so they run without drafts; drafts for requests with
logprobs or processed logits (penalties, logit_bias, min_p, min_tokens, grammars), which run without them too;
CUDA graphs for verify steps (a step with drafts runs eagerly); asynchronous scheduling with drafts and tensor
parallelism (speculation is turned off, with a logged reason); the MTP method (refused by SpeculativeOptions).
"""

from __future__ import annotations

import logging

from mlaserve.config.engine_config import EngineConfig
from mlaserve.core.scheduler import Scheduler
from mlaserve.kvcache.spec import AttentionRule
from mlaserve.sampling_params import SamplingParams
from mlaserve.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)


def build_proposer(
    config: EngineConfig, async_scheduling: bool, group_rules: list[AttentionRule]
) -> NgramProposer | None:
    """The drafts' proposer, or None when speculation is off or cannot run on this engine (logged, with why)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    reason = None
    if async_scheduling:
        reason = "asynchronous scheduling queues a step before the drafts of the one before it are checked"
    elif config.parallel.distributed:
        reason = "drafts are verified on rank 0 alone, not yet across tensor-parallel ranks"
    elif any(rule.ratio is not None for rule in group_rules):
        reason = "pooled cache entries (compress_ratio, DeepSeek-V4) would be built from rejected drafts"
    if reason is not None:
        logger.warning("speculative decoding (%s) is off: %s", spec.method, reason)
        return None
    logger.info(
        "speculative decoding: %s, %d drafts per step, n-grams of %d to %d tokens, greedy requests only",
        spec.method,
        spec.num_speculative_tokens,
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
    )
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def exact_under_greedy_drafts(params: SamplingParams) -> bool:
    """Whether greedy verification gives this request exactly the tokens it gets without drafts: greedy, no
    logits processing, no logprobs (not yet computed at draft positions)."""
    return params.is_greedy and params.logprobs is None and not params.needs_processing


def speculative_stats(scheduler: Scheduler) -> dict[str, object]:
    drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    return {
        "speculative_decoding": scheduler.proposer is not None,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
    }
