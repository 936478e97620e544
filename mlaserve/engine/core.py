"""EngineCore: add, abort, step (schedule -> execute -> update); token ids in, token-id deltas out.

The core holds the scheduler and an executor (executor/executor.py: the device, the ranks, the model, its KV cache
and the model runner). It knows no text: each step returns a CoreOutput per request that got a token (the new ids,
their logprobs, and how it finished), never a cumulative copy. Detokenization and stop strings belong to the
OutputProcessor (output_processor.py) of whoever reads the deltas: LLMEngine in-process, or the server in another
process.
"""

from __future__ import annotations

import itertools
import logging
import time

from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.model_config import ModelConfig
from mlaserve.core.kv_cache_manager import KVCacheManager
from mlaserve.core.request import RequestStatus
from mlaserve.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.core_requests import final_output, new_request
from mlaserve.engine.intake import PreparedRequest, RequestIntake
from mlaserve.engine.speculation import build_proposer, speculative_stats
from mlaserve.engine.step_trace import trace
from mlaserve.executor.build_info import BuildInfo
from mlaserve.executor.executor import Executor
from mlaserve.outputs import LogprobEntry
from mlaserve.runner.step import LaunchedStep, StepResult
from mlaserve.sampling.structured_output import GrammarCompiler
from mlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.executor = Executor(config)
        self.config = config = self.executor.config  # a converted folder's own conversion options
        # The executor's start-up line, from here: serve() keeps this module quiet and its report says it again.
        logger.info(self.executor.describe_kv_cache())
        # Off on CPU by default: there the host and the "device" are the same cores, so nothing overlaps.
        self.async_scheduling = config.scheduler.async_on(
            self.executor.device.type, config.speculative.enabled
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.scheduler.max_num_seqs,
                self.executor.max_num_batched_tokens,
                self.model_config.max_model_len,
                config.scheduler.enable_chunked_prefill,
                config.scheduler.prefill_first,
            ),
            self.kv_manager,
            build_proposer(config, self.async_scheduling, self.executor.kv_cache.group_rules),
        )
        proposer = self.scheduler.proposer
        if proposer is None:  # speculation off here (logged): no draft-layer pass either
            self.executor.runner.drafter = None
        self.kv_manager.drop_last_hit_block = proposer is not None and proposer.reads_next_token
        self._prompt_logprobs: dict[str, list[LogprobEntry | None]] = {}
        self._grammar_compiler: GrammarCompiler | None = None
        self.intake = RequestIntake(self.tokenizer, self.model_config, self.grammar_compiler)
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self._in_flight: LaunchedStep | None = None  # the lookahead step queued by the last step() call

    @property
    def model_config(self) -> ModelConfig:
        return self.executor.model_config

    @property
    def tokenizer(self) -> object | None:
        return self.executor.tokenizer

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.executor.kv_manager

    @property
    def build_info(self) -> BuildInfo:
        return self.executor.build_info

    # ---- requests -------------------------------------------------------------------------------------------
    def prepare(self, prompt: str | dict, params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize without side effects, so a bad request in a batch starts no work."""
        return self.intake.prepare(prompt, params)

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def add_request(self, prepared: PreparedRequest, request_id: str | None = None) -> str:
        """Queue a prepared request; returns its id (a fresh one when none is given)."""
        params = prepared.params
        if params.n != 1:  # the core runs one sequence per request; n is its callers' fan-out
            raise ValueError(
                f"the engine core takes n=1 requests; fan n={params.n} out with child_params first"
            )
        request_id = request_id or self.new_request_id()
        request = new_request(prepared, request_id, next(self._ids), self.model_config, self.tokenizer)
        request.allow_drafts = self.scheduler.proposer is not None
        grammar = None
        if params.structured_outputs is not None:
            compiled = prepared.grammar
            if compiled is None:  # prepared by hand, not by prepare(): compiled here, still within the caps
                compiled = self.grammar_compiler().compile(params.structured_outputs)
            grammar = self.grammar_compiler().new(compiled)
        self.scheduler.add_request(request)  # first: it rejects a duplicate id before any state is replaced
        self.executor.add_request(request_id, params.seed, grammar)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * len(prepared.prompt_token_ids)
        return request_id

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def abort_requests(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[CoreOutput]:
        """Finish these requests from outside (an abort, or a stop string the reader found); unknown ids are
        skipped. Their final outputs carry no new token."""
        finals = []
        for request_id in request_ids:
            request = self.scheduler.finish_request(request_id, status)
            if request is not None:
                finals.append(self._finish(request_id, final_output(request, [])))
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def release_finished(self) -> None:
        """Free the blocks of the requests the last step finished: call once its outputs are sent (the next step
        does it otherwise)."""
        self.scheduler.release_finished()

    def forget_prefix_cache_after_failure(self) -> None:
        """After a step raised and its requests were failed: a scheduled step offers its blocks to the prefix
        cache before its forward writes them, so a step that did not run to its end may have left hashes over
        garbage. With every request gone, forget them all (kept, with a warning, if any block is still held)."""
        self.scheduler.release_finished()
        if not self.kv_manager.reset_prefix_cache():
            logger.warning("the prefix cache was kept after a failed step: blocks are still in use")

    # ---- the step loop ----------------------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Schedule, run the model once, apply the sampled tokens: one CoreOutput per request that got a token.

        With asynchronous scheduling the next step is queued on the device before this step's tokens are
        read, so the GPU does not wait for the host's bookkeeping between steps; that step is the one collected by
        the next call."""
        self.executor.check_ranks()
        launched, self._in_flight = self._in_flight, None
        try:
            if launched is None:
                output = self.scheduler.schedule()
                if output.is_empty:
                    return []
                launched = self.executor.launch(output)
            if self.async_scheduling and not launched.needs_host:
                ahead = self.scheduler.schedule_lookahead(launched.output)
                if ahead is not None:
                    self._in_flight = self.executor.launch(ahead, previous=launched)
            result = self.executor.collect(launched)
            trace("core_collected")
            outputs = self._update(launched.output, result)
        except BaseException as error:
            self._in_flight = None  # its rows are scheduled again from the requests' state
            died = self.executor.rank_death(error)  # a collective that failed: did a rank go?
            if died is not None:
                raise died from error
            raise
        ahead = self._in_flight
        if ahead is not None and all(s.request.is_finished for s in ahead.output.scheduled):
            self._in_flight = None  # every row stopped in this step: nothing to collect
        return outputs

    def _update(self, output: SchedulerOutput, result: StepResult) -> list[CoreOutput]:
        """The sampled tokens into the scheduler's requests, and the step's deltas out."""
        for rid, (first, entries) in result.prompt_logprobs.items():
            slots = self._prompt_logprobs.get(rid)
            if slots is not None:  # positions recomputed after a preemption overwrite equal values
                slots[first : first + len(entries)] = entries
        # A request whose grammar failed ends here, without the token its grammar could not take.
        failed = self.abort_requests(sorted(result.grammar_failed), RequestStatus.FINISHED_ERROR)
        before = {s.request.request_id: s.request.num_output_tokens for s in output.scheduled}
        for s in output.scheduled:  # a draft model's drafts for the next step (Request.drafts_at)
            made = result.drafts.get(s.request.request_id)
            if made is not None:
                s.request.drafts_at, s.request.draft_token_ids = made
        finished = self.scheduler.update_from_output(output, result.token_ids, result.num_accepted)
        finished_ids = {r.request_id for r in finished}
        outputs = failed
        for s in output.scheduled:
            request = s.request
            rid = request.request_id
            # A request finished before this step was collected (aborted, or stopped by the step before a
            # lookahead step) has nothing more to report.
            if rid not in result.token_ids or (request.is_finished and rid not in finished_ids):
                continue
            # One token, or with speculative drafts those accepted and the model's own after them.
            new = request.output_token_ids[before[rid] :]
            self.num_generated_tokens += len(new)
            logprobs = result.logprobs.get(rid)
            if logprobs is not None:  # none for the tokens past a stop the step found
                logprobs = logprobs[: len(new)]
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
                prompt_logprobs = self._prompt_logprobs.pop(rid, None)  # complete once the prompt is computed
            else:
                prompt_logprobs = None
            if rid in finished_ids:
                outputs.append(self._finish(rid, final_output(request, new, logprobs, prompt_logprobs)))
            else:
                outputs.append(CoreOutput(rid, new, logprobs, prompt_logprobs=prompt_logprobs))
        return outputs

    def _finish(self, request_id: str, final: CoreOutput) -> CoreOutput:
        """A finished request's per-request state goes."""
        self.executor.drop_request(request_id)
        self._prompt_logprobs.pop(request_id, None)
        return final

    # ---- lifetime and introspection -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks, and the grammar compiler's workers; idempotent."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()
        self.executor.close()

    def capture_mla_graph(self, max_seq_len: int | None = None) -> int:
        """The MLA guides' call: (re)capture the decode CUDA graphs for sequences up to max_seq_len tokens (default
        max_model_len); shorter limits run short contexts faster and longer sequences run eagerly. Returns how
        many batch sizes were captured."""
        return self.executor.capture_mla_graph(max_seq_len)

    def stats(self) -> dict:
        self.release_finished()  # the block counts are the pool's
        cache = self.kv_manager.prefix_cache_stats()
        return {
            "kv_blocks_total": self.kv_manager.num_total_blocks,
            "kv_blocks_used": self.kv_manager.num_used_blocks,
            "kv_blocks_by_group": self.kv_manager.blocks_per_group(),
            **self.executor.stats(),
            "enable_prefix_caching": self.config.cache.enable_prefix_caching,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": cache["queries"],
            "prefix_cache_hits": cache["hits"],
            "prefix_cache_hit_rate": cache["hits"] / cache["queries"] if cache["queries"] else 0.0,
            "num_generated_tokens": self.num_generated_tokens,
            **speculative_stats(self.scheduler),
        }
