"""Which engines and requests speculate, and what stats() says of it.

Built so far: prompt-lookup (n-gram) drafts, and DeepSeek-V3's multi-token-prediction layer as a draft model
("mtp": runner/mtp_draft.py makes each step's drafts for the next), verified greedily for greedy requests (the plain
engine's tokens exactly) and by rejection sampling for sampled ones, with temperature, top-k, top-p, min_p and seeds
(the plain engine's distribution exactly; see runner/spec_verify.py). With CUDA graphs, verify steps replay the
decode graphs one row per token (runner/verify_graphs.py).

Every request on such an engine takes drafts, whatever it asks for, and gets what it gets without them: each draft
row's logits are processed as the plain engine would process that row had the drafts before it been generated
(runner/draft_processing.py): logit_bias; min_tokens, which holds EOS and the stop ids back while the would-be
output is shorter; the presence, frequency and repetition penalties, which count the earlier drafts as output;
a grammar's mask, from the matcher's state after the earlier drafts (a draft it cannot take ends the drafts
there, and the matcher advances by the tokens kept alone). Logprobs are the raw logits' at each kept token's row,
one entry per kept token. Stop strings and stop ids that end among the accepted drafts cut the output where the
plain engine stops (the output processor reads the tokens one at a time), and n > 1 fans out into requests that
each take drafts. A seeded sampled request with drafts is reproducible run to run under the same speculative
config, but its tokens differ from the ones it gets without drafts: the verification draws from its generator
too, so the draws differ while the distribution stays the same (as in vLLM). Its draft count also depends on the
step's token budget, so other requests in the batch can change its draws.

Under tensor parallelism every rank computes the draft rows' logits (the plan names them: the head's all-gather
needs the same rows everywhere) and rank 0 verifies them as it samples; with mtp, rank 0 sends each step's draft
spans and every rank runs the layer's pass, which is sharded like the model.

With asynchronous scheduling (only when asked for explicitly: the None default resolves to off with speculation
until a GPU run checks it), an MTP engine queues the step after a verify step before that step is read: its rows
of the requests the verify step samples are placed as if every draft held (slots reserved for that) and take the
draft layer's drafts from the pass after it. Where that pass was captured and the queued step replays the decode
graphs, the device corrects the rows from the accepted counts before the replay and the host settles them when it
reads the verify step; otherwise the runner reads the verify step first (runner/queued_verify.py). Only greedy
rows take the device path (rejection sampling reads the drafts on the host). Rows with penalties, min_tokens or
logit_bias, and tensor-parallel engines, read each verify step first (LaunchedStep.needs_host). Prompt-lookup
drafts are read from the tokens on the host, so there a step that samples for a drafting request is read before
the next is queued, and only steps that sample nothing (prompt chunks) are followed by a queued step: without the
tokens it could only queue rows without drafts, which would end the drafting for as long as steps keep queuing.

Not yet: MTP drafts under a training-free window or pooling (turned off, with a logged reason).
"""

from __future__ import annotations

import logging

from mlaserve.config.engine_config import EngineConfig
from mlaserve.core.scheduler import Scheduler
from mlaserve.kvcache.spec import FULL, AttentionRule
from mlaserve.spec_decode.model_drafts import ModelDrafts
from mlaserve.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)


def build_proposer(
    config: EngineConfig, async_scheduling: bool, group_rules: list[AttentionRule]
) -> NgramProposer | ModelDrafts | None:
    """The drafts' proposer, or None when speculation is off or cannot run on this engine (logged, with why)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    reason = None
    if any(rule.ratio is not None for rule in group_rules):
        reason = "pooled cache entries (compress_ratio, DeepSeek-V4) would be built from rejected drafts"
    elif spec.method == "mtp" and group_rules != [FULL]:
        reason = "the draft layer attends over the full cache, not a window's"
    if reason is not None:
        logger.warning("speculative decoding (%s) is off: %s", spec.method, reason)
        return None
    if async_scheduling and spec.method != "mtp":
        logger.info(
            "speculative decoding with asynchronous scheduling: prompt-lookup drafts are read from the tokens, so "
            "a step that samples for a drafting request is read before the next step is queued"
        )
    if spec.method == "mtp":
        logger.info("speculative decoding: mtp, %d drafts per step", spec.num_speculative_tokens)
        return ModelDrafts(spec.num_speculative_tokens)
    logger.info(
        "speculative decoding: %s, %d drafts per step, n-grams of %d to %d tokens",
        spec.method,
        spec.num_speculative_tokens,
        spec.prompt_lookup_min,
        spec.prompt_lookup_max,
    )
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def speculative_stats(scheduler: Scheduler) -> dict[str, object]:
    drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    per_pos = list(scheduler.num_accepted_per_pos)
    k = scheduler.proposer.num_speculative_tokens if scheduler.proposer is not None else 0
    return {
        "speculative_decoding": scheduler.proposer is not None,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        # accepted drafts by place: [0] counts steps whose first draft held, [1] the second, ...
        "num_accepted_tokens_per_pos": per_pos + [0] * (k - len(per_pos)),
    }
