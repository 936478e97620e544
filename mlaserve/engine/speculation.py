"""Which engines and requests speculate, and what stats() says of it.

Built so far: prompt-lookup (n-gram) drafts, and DeepSeek-V3's and V4's multi-token-prediction layers as a draft
model ("mtp": runner/mtp_draft.py makes each step's drafts for the next; V4's is models/deepseek_v4_mtp.py), verified greedily for greedy requests (the plain
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

Windows and pooled entries (the training-free compress_ratio, DeepSeek-V4's compressed entries) take drafts as they
are: a verify step writes the rows of its drafts and any entry whose last token is a draft, from those rows; when a
draft is rejected, the request's computed tokens stop before it, so the next step computes that position again and
rewrites its row and its entry from the accepted tokens before anything reads them (an entry is read only by
queries past its last token). Prefix-cache blocks are hashed only once full of known tokens. The MTP draft layer
attends by its own cache group's rule, as the target's layers of that group do: under the training-free window
(and sinks) it reads the window's rows, never blocks the window gave back; DeepSeek-V4's layer is a sliding-window
block whose rows sit in the window group beside every block's, and it makes no compressed entries.

With asynchronous scheduling (one full-attention cache group only, and only when asked for explicitly: the None
default resolves to off with speculation until a GPU run checks it), an MTP engine queues the step after a verify step before that step is read: its rows
of the requests the verify step samples are placed as if every draft held (slots reserved for that) and take the
draft layer's drafts from the pass after it. Where that pass was captured and the queued step replays the decode
graphs, the device corrects the rows from the accepted counts before the replay and the host settles them when it
reads the verify step; otherwise the runner reads the verify step first (runner/queued_verify.py). Only greedy
rows take the device path (rejection sampling reads the drafts on the host). Rows with penalties, min_tokens or
logit_bias, and tensor-parallel engines, read each verify step first (LaunchedStep.needs_host). Prompt-lookup
drafts are read from the tokens on the host, so there a step that samples for a drafting request is read before
the next is queued, and only steps that sample nothing (prompt chunks) are followed by a queued step: without the
tokens it could only queue rows without drafts, which would end the drafting for as long as steps keep queuing.

Not yet: MTP drafts under the training-free compress_ratio, whose pooled entries of the draft layer's own rows its
pass does not build, and asynchronous scheduling with drafts on engines with windows or pooled entries (each turned
off, with a logged reason).
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
    if async_scheduling and group_rules != [FULL]:
        reason = "asynchronous scheduling with drafts is built for one full-attention cache group only"
    elif spec.method == "mtp" and config.cache.compress_ratio:
        # DeepSeek-V4's own pooled groups are its compressors': its MTP layer attends over the window alone
        reason = "the draft layer's pass does not build compress_ratio's pooled entries of its own rows"
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
