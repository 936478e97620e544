"""Runs one scheduled step: build the batch, forward, logits for the rows that finish a prompt or decode, sample.

Under tensor parallelism every rank runs the forward of each step: rank 0 (this runner, in the engine core) sends
the step's plan (the batch as host tensors, no request objects) to the other ranks before its own forward, samples
alone, and broadcasts the sampled ids, which the next lookahead step reads on every rank.
"""

import dataclasses
import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.metadata import build_metadata
from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.host_copy import queued_values
from mlaserve.kvcache.spec import FULL, AttentionRule
from mlaserve.models.base import CausalLM
from mlaserve.outputs import LogprobEntry
from mlaserve.parallel import SINGLE, ParallelContext
from mlaserve.runner.batch import HostBatch, to_device
from mlaserve.runner.draft_processing import (
    DraftGrammar,
    draft_grammars,
    draft_row_params,
    kept_logprobs,
    sampled_row_inputs,
)
from mlaserve.runner.mtp_draft import MtpDrafter, draft_spans
from mlaserve.runner.mtp_graphs import MtpDraftGraphs, capture_draft_graphs, collect_drafts
from mlaserve.runner.prompt_logprobs import PromptSpan, ScoredSpan, prompt_spans, score_prompt_spans
from mlaserve.runner.queued_verify import plan_step, settle_rows
from mlaserve.runner.spec_verify import accept_drafts, draft_rows, draft_targets
from mlaserve.runner.step import LaunchedStep, StepPlan, StepResult
from mlaserve.runner.verify_graphs import run_captured
from mlaserve.sampling.logits_processors import PendingTokens, held_back_ids, process_logits
from mlaserve.sampling.sampler import Sampler
from mlaserve.sampling.structured_output import Grammar

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        group_rules: list[AttentionRule] | None = None,
        parallel: ParallelContext = SINGLE,
        backend: AttentionBackend | None = None,
    ):
        self.model = model
        self.backend = backend  # its host-side decode plans are made before each graph replay
        self.parallel = parallel
        self.last_sampled: torch.Tensor | None = None  # ranks past 0: the previous step's ids, from rank 0
        self.group_rules = group_rules or [FULL]  # each cache group's window and sinks
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}  # per-request RNG so a seed fixes the output
        self.grammars: dict[str, Grammar] = {}  # structured-output requests' matchers
        self.graphs = None  # DecodeGraphs, when enabled
        self.prefill_graphs = None  # PrefillGraphs, when enabled
        self.drafter: MtpDrafter | None = None  # MTP drafts after every step (speculative method "mtp")
        self.draft_graphs: MtpDraftGraphs | None = None  # its pass after captured steps, captured too
        self._turn = 0
        if device.type == "cuda":
            self._host_ids = [torch.empty(256, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]

    def enable_cuda_graphs(
        self, max_model_len: int, max_num_seqs: int, prefill_tokens: int = 0, rows_per_seq: int = 1
    ) -> None:
        """Captures the decode graphs and, with prefill_tokens, graphs of fresh prefills up to that many tokens.
        rows_per_seq: 1 + the drafts a request may carry, whose verify steps replay the decode graphs too."""
        from mlaserve.runner.cuda_graphs import DecodeGraphs
        from mlaserve.runner.prefill_graphs import PREFILL_SIZES, PrefillGraphs

        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.block_size,
            max_model_len,
            max_num_seqs,
            self.device,
            self.group_rules,
            self.backend,
            rows_per_seq=rows_per_seq,
            keep_prenorm=self.drafter is not None,
        )
        self.graphs.capture()
        self.draft_graphs = None
        if self.drafter is not None:
            eager_only = self.parallel.distributed or len(self.group_rules) > 1
            self.draft_graphs = capture_draft_graphs(self.drafter, self.graphs, max_model_len, eager_only)
        if prefill_tokens >= PREFILL_SIZES[0]:
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv_caches, self.block_size, prefill_tokens, self.device
            )
            self.prefill_graphs.capture()

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        """One dummy prefill step of num_tokens (as prompts of at most max_model_len) through the whole model.

        Long prefills pick kernel variants that no decode graph uses (taller MoE tiles); without this the first
        long prompt a server sees would wait about a second per variant for Triton to compile it. Every dummy
        token writes to slot 0 of the null block, which no block table reads."""
        lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        table = torch.zeros(
            len(lens), -(-max(lens) // self.block_size), dtype=torch.int32, device=self.device
        )
        slots = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta = build_metadata(self.block_size, table, lens, lens, 0, slots)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        self.model(
            torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, self.kv_caches, meta
        )

    def add_generator(self, request_id: str, seed: int) -> None:
        self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def add_grammar(self, request_id: str, grammar: Grammar) -> None:
        self.grammars[request_id] = grammar

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.grammars.pop(request_id, None)

    @torch.inference_mode()
    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queues the step's forward and sampling on the device and returns without waiting for them.

        A step scheduled ahead (Scheduler.schedule_lookahead) is launched before `previous` has been collected: the
        input token of each of its lookahead rows is the one `previous` sampled for the same request, gathered on
        the device; its other rows' tokens (prompt chunks, decodes of requests `previous` did not run) are known.
        Rows queued behind `previous`'s drafts (queued_verify.py) are corrected on the device when the step replays
        the decode graphs behind a captured draft pass, else settled first from `previous` read early; so is
        `previous`'s eager draft pass, whose cache rows this step's own pass reads."""
        host, behind, previous_ids = plan_step(
            output, previous, self.graphs, self.block_size, self.group_rules, self.collect
        )
        # Per token: its index among `previous`'s sampled ids, -1 where known (lookahead_source).
        source_rows = None
        ahead = previous is not None and any(s.lookahead for s in host.order)
        if ahead:  # each request's row among `previous`'s sampled ids
            rows = {s.request.request_id: i for i, s in enumerate(previous.sampled)}
            source_rows = []
            for s in host.order:
                first = [rows[s.request.request_id]] if s.lookahead else [-1]
                source_rows += first + [-1] * (s.num_new_tokens - 1)  # a lookahead row's drafts are known
            if behind is not None:
                source_rows = behind.source_rows
        spans = prompt_spans(host.order)  # graphs keep only the sampled rows' hidden states
        # Every rank computes the draft rows' logits; rank 0 alone verifies them, as it alone samples.
        drafted, verify_rows = draft_rows(host.order)
        if self.parallel.distributed:
            from mlaserve.parallel.group import broadcast_object

            plain = dataclasses.replace(host, order=[], sampled=[])
            plan = StepPlan(plain, spans, source_rows, verify_rows, self.drafter is not None)
            broadcast_object(self.parallel, plan)
        logits, scored, verify_logits, prenorm, captured = self._forward(
            host, spans, source_rows, previous_ids, verify_rows, None if behind is None else behind.shift
        )
        if logits is None:
            if prenorm is not None:  # a prompt chunk's draft-layer rows
                self._propose(draft_spans(host, {}, {}, self.drafter.group), prenorm)
            return LaunchedStep(output, [], [], None, None, None, None, scored)
        params = [s.request.sampling_params for s in host.sampled]
        generators = [self.generators.get(s.request.request_id) for s in host.sampled]
        logits = self.sampler.prepare(logits, params)
        requests = [s.request for s in host.sampled]
        grammars = [self.grammars.get(r.request_id) for r in requests]
        processing = ahead and any(p.needs_processing for p in params)  # not on every decode step
        pending = pending_tokens(host.sampled, rows, previous_ids) if processing else None
        walks: dict[str, DraftGrammar] = {}
        before = None
        if drafted:  # its sampled row comes after its drafts: processed as if they had been generated
            walks = draft_grammars(self.grammars, drafted, logits.shape[1]) if self.grammars else {}
            grammars, before = sampled_row_inputs(host.sampled, grammars, walks)
        processed = process_logits(logits, params, requests, grammars, pending, before)
        token_ids = self.sampler.sample(processed, params, generators)
        # After the sampler's draws: a seeded request's generator gives the bonus row's noise first, then the drafts'.
        verified = None
        if verify_logits is not None:
            verified = draft_targets(verify_logits, drafted, self.generators, walks)
        if self.parallel.distributed:  # the next lookahead step's inputs, on every rank
            import torch.distributed as dist

            dist.broadcast(token_ids, src=0, group=self.parallel.group)
        # Computed now, from logits the next step (a graph replay) may overwrite, and copied out with the ids.
        logprobs = self.sampler.logprobs(logits, params, token_ids)
        if logprobs is not None:
            logprobs = logprobs.to_host()
        host_ids, done = self._copy_out(token_ids)
        step = LaunchedStep(output, host.sampled, params, logprobs, token_ids, host_ids, done, scored)
        step.drafted, step.verified = drafted, verified
        step.num_valid = {rid: walk.num_valid for rid, walk in walks.items()}
        if verified is not None and any(s.request.sampling_params.logprobs is not None for s in drafted):
            # Each draft row's target is the token kept there if any is: the accepted draft, or the replacement.
            row_params = draft_row_params(drafted)
            tensors = self.sampler.logprobs(verify_logits.float(), row_params, verified)
            step.draft_logprobs = (row_params, tensors.to_host())
        step.host, step.prenorm = host, prenorm
        step.drafts_follow = self.drafter is not None and not self.parallel.distributed
        if captured and self.drafter and self.draft_graphs:  # queued behind the token ids' copy out
            draft_ids = None
            if behind is not None and verify_rows:  # its drafts are placeholders on the host
                ids, index = lookahead_source(previous_ids, source_rows, host.ids)
                draft_ids = (
                    ids[queued_values([index[r + 1] for r in verify_rows], torch.long, self.device)],
                    verify_rows,
                )
            step.queued_drafts = self.draft_graphs.launch(
                host, drafted, verified, token_ids, step.num_valid, draft_ids
            )
            step.prenorm = None
        return step

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A rank past 0: the step's forward as rank 0 runs it, then the ids rank 0 sampled, then the MTP draft
        pass over the spans rank 0 sends (its drafts are rank 0's to read; the pass writes this rank's share of
        the draft layer's cache)."""
        *_, prenorm, _ = self._forward(
            plan.host, plan.spans, plan.source_rows, self.last_sampled, plan.verify_rows
        )
        if plan.host.sample_rows:
            import torch.distributed as dist

            ids = torch.empty(len(plan.host.sample_rows), dtype=torch.long, device=self.device)
            dist.broadcast(ids, src=0, group=self.parallel.group)
            self.last_sampled = ids
        if plan.draft_pass:
            from mlaserve.parallel.group import broadcast_object

            self.drafter.propose(broadcast_object(self.parallel), prenorm)

    def _propose(self, spans: list, prenorm: torch.Tensor) -> dict[str, tuple[int, list[int]]]:
        """The MTP drafts for the spans; under tensor parallelism the other ranks get the spans first and run
        the same pass, whose layer is sharded like the model's."""
        if self.parallel.distributed:
            from mlaserve.parallel.group import broadcast_object

            broadcast_object(self.parallel, spans)
        return self.drafter.propose(spans, prenorm)

    def _forward(
        self,
        host: HostBatch,
        spans: list[PromptSpan],
        source_rows: list[int] | None,
        source_ids: torch.Tensor | None,
        verify_rows: list[int] | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, list[ScoredSpan], torch.Tensor | None, torch.Tensor | None, bool]:
        """The logits of the sampled rows (None when no row samples), the prompt logprobs asked for, the logits
        at verify_rows (speculative drafts' positions; None when there are none), with an MTP drafter every
        row's hidden state before the final norm, and whether the step replayed the decode graphs. Decode steps,
        with drafts or without, replay the decode graphs (runner/verify_graphs.py); a step with a prompt chunk runs
        eagerly where a drafter reads its rows."""
        graphs, prefills = self.graphs, self.prefill_graphs
        source = None if source_rows is None else lookahead_source(source_ids, source_rows, host.ids)
        if graphs is not None and not spans:
            captured = run_captured(graphs, host, source, verify_rows, self.drafter is not None, shift)
            if captured is not None:
                logits, verify_logits, prenorm = captured
                return logits, [], verify_logits, prenorm, True
        if shift is not None:  # queued_verify.plan_step checks that it fits the graphs first
            raise RuntimeError("a step queued behind an unread verify step must replay the decode graphs")
        eager = bool(spans or verify_rows) or self.drafter is not None
        if prefills is not None and not eager and host.sample_rows and prefills.can_run(host):
            return prefills.run(host), [], None, None, False  # the sampled sequences' rows, in order
        batch = to_device(
            host,
            self.block_size,
            self.device,
            with_gather_index=graphs is None,
            rules=self.group_rules,
        )
        if source is not None:  # one index per token
            batch.input_ids = source[0].index_select(0, queued_values(source[1], torch.long, self.device))
        prenorm = None
        if self.drafter is not None:
            hidden, prenorm = self.model.forward_with_prenorm(
                batch.input_ids, batch.positions, self.kv_caches, batch.meta
            )
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        scored = score_prompt_spans(self.model, hidden, spans)
        if not host.sample_rows:
            return None, scored, None, prenorm, False
        if not verify_rows:
            return self.model.compute_logits(hidden[batch.sample_rows]), scored, None, prenorm, False
        # One head call for the sampled and the draft rows: every row's logits come from the same GEMM.
        rows = torch.cat((batch.sample_rows, queued_values(verify_rows, torch.long, self.device)))
        logits = self.model.compute_logits(hidden[rows])
        num_sampled = len(host.sample_rows)
        return logits[:num_sampled], scored, logits[num_sampled:], prenorm, False

    def collect(self, step: LaunchedStep) -> StepResult:
        """Waits for a launched step's tokens (and reads the logprobs asked for)."""
        if step.result is not None:  # read early, to launch the step queued behind it
            return step.result
        result = self._collect(step)
        if step.queued_behind is not None:  # its rows planned before these results: moved to where they are
            settle_rows(step.queued_behind, result)
        return result

    def _collect(self, step: LaunchedStep) -> StepResult:
        prompt_logprobs = {s.span.request_id: (s.span.first_position, s.entries()) for s in step.scored}
        if not step.sampled:
            return StepResult({}, {}, prompt_logprobs)
        if step.done is not None:
            step.done.synchronize()
            token_list = step.host_ids[: len(step.sampled)].tolist()
        else:
            token_list = step.token_ids.tolist()
        ids = [s.request.request_id for s in step.sampled]
        result = self._results(step, ids, token_list, prompt_logprobs)
        result.grammar_failed = self._advance_grammars(kept_tokens(step.drafted, result))
        if step.queued_drafts is not None:  # the captured pass, queued at launch
            result.drafts = collect_drafts(step.queued_drafts, result.token_ids, result.num_accepted)
        elif step.prenorm is not None:  # the layer's rows for this step's tokens, and the next step's drafts
            spans = draft_spans(step.host, result.token_ids, result.num_accepted, self.drafter.group)
            result.drafts = self._propose(spans, step.prenorm)
        return result

    def _results(
        self, step: LaunchedStep, ids: list[str], token_list: list[int], prompt_logprobs: dict
    ) -> StepResult:
        token_ids = dict(zip(ids, token_list))
        num_accepted: dict[str, int] = {}
        if step.drafted:
            num_accepted = accept_drafts(step.drafted, step.verified.tolist(), token_ids, step.num_valid)
        logprobs: dict[str, list[LogprobEntry]] = {}
        if step.logprobs is not None:
            result = self.sampler.finish(step.params, token_list, step.logprobs)
            logprobs = {i: [lp] for i, lp in zip(ids, result.logprobs) if lp is not None}
        if step.draft_logprobs is not None:
            row_params, tensors = step.draft_logprobs
            rows = self.sampler.finish(row_params, step.verified.tolist(), tensors).logprobs
            sampled = {rid: entries[0] for rid, entries in logprobs.items()}
            logprobs.update(kept_logprobs(step.drafted, rows, num_accepted, sampled))
        return StepResult(token_ids, logprobs, prompt_logprobs, num_accepted)

    def _advance_grammars(self, kept: dict[str, list[int]]) -> set[str]:
        """Every token a request keeps advances its grammar (tokens of aborted requests go with their grammar).
        Returns the requests whose grammar could not take its token: the grammar engine hit a limit, or its mask
        left nothing to sample. Going on without the grammar would return text the client ruled out."""
        failed: set[str] = set()
        if not self.grammars:
            return failed
        for rid, tokens in kept.items():
            grammar = self.grammars.get(rid)
            if grammar is None:
                continue
            if not all(grammar.accept(t) for t in tokens) or grammar.error is not None:
                # The grammar's label, never its text or llguidance's message, which quotes the grammar.
                logger.warning(
                    "request %s: its grammar (%s) cannot go on; the request ends", rid, grammar.label
                )
                del self.grammars[rid]
                failed.add(rid)
        return failed

    def _copy_out(self, token_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        """Starts the copy of a CUDA step's token ids into pinned memory, with an event that marks it done.

        The copy is queued right behind the sampling, so reading the tokens waits for this step alone, not for a
        step queued after it. Two buffers in turn: a buffer is reused two launches later, and by then the step
        that used it has been collected (at most one step is in flight beside the one being collected)."""
        if token_ids.device.type != "cuda":
            return None, None
        n = token_ids.shape[0]
        self._turn ^= 1
        buffer = self._host_ids[self._turn]
        if buffer.shape[0] < n:
            buffer = torch.empty(max(n, 2 * buffer.shape[0]), dtype=torch.long, pin_memory=True)
            self._host_ids[self._turn] = buffer
        buffer[:n].copy_(token_ids, non_blocking=True)
        done = self._events[self._turn]
        done.record()
        return buffer, done


def kept_tokens(drafted: list[ScheduledRequest], result: StepResult) -> dict[str, list[int]]:
    """The tokens each request keeps from the step: its accepted drafts, then its sampled (or replacement) token,
    up to a stop id among them (the scheduler drops what follows, so a grammar never has to take it)."""
    kept = {rid: [token] for rid, token in result.token_ids.items()}
    for s in drafted:
        rid = s.request.request_id
        if rid in kept:
            tokens = [*s.spec_token_ids[: result.num_accepted[rid]], *kept[rid]]
            stops = held_back_ids(s.request)
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            kept[rid] = tokens[:end]
    return kept


def pending_tokens(
    sampled: list[ScheduledRequest], rows: dict[str, int], previous_ids: torch.Tensor
) -> PendingTokens | None:
    """A lookahead row's request is a token short of where the row samples: that token, still being sampled by the
    step before (previous_ids on the device; rows: each request's index among them), which min_tokens and the
    penalties count. None when no sampled row is a lookahead row."""
    ahead = [s.lookahead for s in sampled]
    if not any(ahead):
        return None
    source = queued_values([rows[s.request.request_id] if s.lookahead else -1 for s in sampled], torch.long,
                           previous_ids.device)  # fmt: skip
    return PendingTokens(ahead, torch.where(source >= 0, previous_ids[source.clamp(min=0)], -1))


def lookahead_source(
    sampled: torch.Tensor, rows: list[int], ids: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """A lookahead step's inputs as (ids on the device, each token's index among them). sampled: the previous
    step's tokens on the device; rows: each token's index among them, or -1 for a token that is known (a prompt
    chunk's, or the decode token of a request the previous step did not sample): those tokens (ids, one per token
    of the step) go after the sampled."""
    known = [i for i, row in enumerate(rows) if row < 0]
    if not known:
        return sampled, rows
    extra = queued_values([ids[i] for i in known], torch.long, sampled.device)
    rows = list(rows)
    for k, i in enumerate(known):
        rows[i] = sampled.shape[0] + k
    return torch.cat((sampled, extra)), rows
