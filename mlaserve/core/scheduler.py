"""Continuous-batching scheduler: one token budget per step, shared by prefills, prompt chunks and decodes.

Every request simply tries to catch up: it has num_tokens known tokens and num_computed_tokens whose KV is
in the cache, and asks for the difference. Prefix-cache hits start a request with more computed tokens.
When the pool runs dry, the newest running request is preempted (its KV dropped, recomputed later).

Two policies share that loop. Decode-first (the default, as vLLM's): every running request gets its decode token,
and prompt chunks fill the rest of the budget, so streams never stall but a burst of prompts slows every step.
Prefill-first (`prefill_first`, SGLang's default): while prompts wait and can be admitted, a step holds prompt
chunks only; decodes resume once they are in. After a burst every stream then runs at the pure decode step, as
offline; the price is that each arriving prompt pauses the running streams for its prefill.

Speculative decoding (with a proposer): a decoding request that allows drafts runs its last token and up to k
drafts in one step, like a short prompt chunk on its cached context, within the token budget and only when the
pool has their slots (never preempting for drafts). update_from_output keeps the drafts the runner accepted, gives
back the slots of the rejected ones, and applies the stops token by token, so tokens past a stop are dropped.
A draft model's drafts (ModelDrafts) also take slots past the step's tokens, where its chained drafts' rows go.
A step scheduled ahead (schedule_lookahead) gives the proposer's drafts only to rows whose input the host knows; a
lookahead row takes a draft model's next drafts as placeholders, and behind a step that checks drafts it is placed
as if they all hold, until the runner settles it.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from mlaserve.core.kv_cache_manager import KVCacheManager
from mlaserve.core.request import Request, RequestStatus
from mlaserve.core.request_limits import validate_new_request
from mlaserve.core.scheduled import ScheduledRequest, SchedulerOutput
from mlaserve.spec_decode.model_drafts import ModelDrafts
from mlaserve.spec_decode.ngram import NgramProposer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    prefill_first: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with enable_chunked_prefill=False, SchedulerConfig.max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}), "
                "or a long prompt could never be scheduled"
            )


__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        proposer: NgramProposer | ModelDrafts | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.proposer = proposer  # drafts for requests that allow them; None: no speculation
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, the ones the model agreed with
        # accepted drafts by their place in the step's drafts (vLLM's num_accepted_tokens_per_pos)
        self.num_accepted_per_pos = [0] * (proposer.num_speculative_tokens if proposer else 0)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        # Kept sorted by arrival_index: the front gets the budget first, the back is preempted first.
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests a step finished whose blocks are not yet back in the pool: release_finished() frees them once
        # their last tokens are on their way (when hundreds of requests finish at once, freeing
        # their blocks is long enough for every stream's last token to notice). The next schedule frees them in any case.
        self._unreleased: list[Request] = []
        self._queued: SchedulerOutput | None = None  # the lookahead step not yet applied

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        validate_new_request(request, self.requests, self.config.max_model_len, self.kv_cache_manager)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def release_finished(self) -> None:
        """Return the blocks of the requests finished by update_from_output to the pool."""
        for request in self._unreleased:
            self.kv_cache_manager.free(request)
        self._unreleased = []

    def schedule(self) -> SchedulerOutput:
        self.release_finished()
        self._queued = None  # nothing is in flight when the engine schedules this way
        output = self._pick(None)
        assert output is not None  # only a lookahead gives up
        return output

    def schedule_lookahead(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """The step schedule() would pick once `previous` is applied, scheduled before `previous`'s sampled tokens
        are known, so the runner can queue it on the device while the host waits for those tokens (asynchronous
        scheduling, as vLLM's).

        Every request is taken as `previous` leaves it: its tokens there computed, and a token more where `previous`
        samples one (the row after it is a lookahead row: its input comes from the device). Prompt chunks, decode
        rows of requests `previous` left out and admissions from the queue are as schedule() makes them. A request
        whose token from `previous` is its last by length is left out; one that stops on EOS or a stop string
        there wastes its row, which update_from_output skips (the request is finished by then). Either keeps its
        seat and blocks until `previous` is applied, so a request they would have let in waits a step longer.
        Never preempts: None when a running request's row finds the pool short, and the caller falls back to
        schedule() once the tokens are in. Blocks taken for rows before a failing one stay with their requests,
        which need them next step anyway, but join the prefix cache only once the step is sure to run (a hit on
        a block no step writes would read garbage).

        A request whose row in `previous` carries d drafts gets a row placed as if all d hold (pending_drafts = d),
        with slots for that case; with a draft model (ModelDrafts) the row also takes the drafts of its pass after
        `previous` (placeholders, as many as that pass makes whatever `previous` accepts). The runner settles such
        rows once `previous`'s results are read (ScheduledRequest.settle), and the blocks past the request's tokens
        stay with it while a queued step may use them.
        """
        self.release_finished()
        items = {item.request.request_id: item for item in previous.scheduled}
        if any(item.request.is_finished for item in items.values()):
            return None
        output = self._pick(items)
        output = output if output is not None and output.scheduled else None
        self._queued = output
        return output

    def _pick(self, previous: dict[str, ScheduledRequest] | None) -> SchedulerOutput | None:
        """The step by the policy. previous: a lookahead's in-flight step by request id (see schedule_lookahead)."""
        if self.config.prefill_first and (
            self.waiting or any(_catching_up(r, *self._ahead(r, previous)[:2]) for r in self.running)
        ):
            output = self._schedule(decodes=False, previous=previous)
            if output is None or output.scheduled:
                return output
            # nothing admissible (the pool or max_num_seqs is full): decode, or the running never free room
        return self._schedule(decodes=True, previous=previous)

    def _ahead(self, request: Request, previous: dict[str, ScheduledRequest] | None) -> tuple[int, bool, int]:
        """(tokens `previous` computes for the request, whether it samples one there, the drafts it checks there
        while sampling); (0, False, 0) outside a lookahead or for a request `previous` does not run."""
        item = previous.get(request.request_id) if previous else None
        if item is None:
            return 0, False, 0
        sampling = item.needs_sample
        return item.num_new_tokens, sampling, len(item.spec_token_ids) if sampling else 0

    def _last_by_length(self, request: Request, pending: int = 0) -> bool:
        """The token the request samples next (after `pending` drafts that may hold) may be its last (max_tokens
        or max_model_len), as _check_stop finds."""
        return (
            request.num_output_tokens + 1 + pending >= request.max_tokens
            or request.num_tokens + 1 + pending >= self.config.max_model_len
        )

    def _schedule(
        self, decodes: bool, previous: dict[str, ScheduledRequest] | None = None
    ) -> SchedulerOutput | None:
        """None only for a lookahead (previous given) that would have to preempt."""
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        kv = self.kv_cache_manager
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # 1. Running requests, oldest first: a decode token or the next prompt chunk each.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            ahead, sampling, pending = self._ahead(request, previous)
            computed = request.num_computed_tokens + ahead  # with every pending draft held
            num_new = request.num_tokens + sampling + pending - computed
            if (
                num_new == 0
                or (sampling and self._last_by_length(request, pending))  # `previous` may end it
                or (not chunked and num_new > budget)
                or (not decodes and not _catching_up(request, ahead, sampling))
            ):
                index += 1
                continue
            num_new = min(num_new, budget)
            if ahead:  # the blocks that leave its window in `previous`, as schedule() would find them
                kv.free_skipped(request, ahead)
            if sampling:  # its input is still being sampled: only a draft model's pass has its drafts
                drafts = [0] * self._queued_drafts(request, previous[request.request_id], pending, budget)
                extra = self._lookahead(request, computed + num_new, request.num_tokens + 1 + pending)
            else:
                drafts = self._drafts(request, num_new, budget)
                extra = self._lookahead(request, computed + num_new)
            cache = previous is None
            block_ids = (
                kv.allocate_slots(request, ahead + num_new + len(drafts) + extra, cache=cache)
                if drafts
                else None
            )
            if block_ids is None:  # no drafts, or no slots for them: a plain step (which may preempt)
                drafts = []
                # A lookahead may still give up below: its blocks join the prefix cache once it cannot.
                block_ids = kv.allocate_slots(request, ahead + num_new + extra, cache=cache)
                if block_ids is None and extra:
                    block_ids = kv.allocate_slots(request, ahead + num_new, cache=cache)
            if block_ids is None and not decodes:
                break  # a prompt chunk never preempts a stream here; the decode-first pass below may
            if block_ids is None and previous is not None:
                return None  # a lookahead never preempts
            while block_ids is None:
                victim = self.running.pop()  # newest; never one scheduled already (those are in front)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                block_ids = kv.allocate_slots(request, num_new)
            if block_ids is None:
                break
            num_new += len(drafts)
            scheduled.append(
                ScheduledRequest(
                    request,
                    num_new,
                    computed,
                    block_ids,
                    lookahead=sampling,
                    spec_token_ids=drafts,
                    pending_drafts=pending,
                    settled=not (sampling and (pending or drafts)),
                )  # fmt: skip
            )
            budget -= num_new
            index += 1
        if previous is not None:  # the step will run: its rows' full blocks are hits from here on
            for item in scheduled:
                kv.cache_blocks(item.request, item.num_computed_tokens + item.num_new_tokens)

        # 2. Waiting requests in FCFS order. Skipped after a preemption: memory is short, a new request
        # would only evict the one just preempted (and never schedule a request twice in one step).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if not chunked and num_new > budget:
                break
            num_new = min(num_new, budget)
            extra = self._lookahead(request, request.num_computed_tokens + num_hit_tokens + num_new)
            block_ids = kv.allocate_slots(request, num_new + extra, hits) if extra else None
            block_ids = block_ids or kv.allocate_slots(request, num_new, hits)
            if block_ids is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_arrival)
            scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens, block_ids))
            budget -= num_new

        num_batched = self.config.max_num_batched_tokens - budget
        return SchedulerOutput(
            scheduled=scheduled, num_batched_tokens=num_batched, preempted_request_ids=preempted
        )

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Drafts for a decoding request that allows them, as many as the budget, max_tokens and max_model_len
        leave room for (the step yields at most one token more than it has drafts)."""
        if (
            self.proposer is None
            or not request.allow_drafts
            or num_new != 1
            or request.num_output_tokens == 0
        ):
            return []
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.drafts_for(request, room) if room > 0 else []

    def _queued_drafts(self, request: Request, item: ScheduledRequest, pending: int, budget: int) -> int:
        """How many drafts a lookahead row takes from the draft model's pass after `item`'s step: as many as that
        pass makes whatever the step accepts (mtp_graphs.collect_drafts: draft j >= 1 needs a slot at the accepted
        end + j within the blocks `item` holds, fewest when every pending draft holds), within _drafts' caps."""
        if not isinstance(self.proposer, ModelDrafts) or not request.allow_drafts:
            return 0
        size = self.kv_cache_manager.managers[0].block_size
        room = min(len(item.block_ids[0]) * size, self.config.max_model_len)
        made = min(
            self.proposer.num_speculative_tokens, room - (item.num_computed_tokens + item.num_new_tokens - 1)
        )
        caps = (
            budget - 1,
            request.max_tokens - (request.num_output_tokens + 1 + pending) - 1,
            self.config.max_model_len - (request.num_tokens + 1 + pending) - 1,
        )
        return max(0, min(made, *caps))

    def _lookahead(self, request: Request, end: int, known: int | None = None) -> int:
        """Slots past a step's last token (end) for a draft model's rows of its own drafts, when the step ends
        where the request's known tokens do (known: their count, the request's own unless the step is queued behind
        one that samples for it; up to max_model_len; without them the drafts come out shorter)."""
        known = request.num_tokens if known is None else known
        if self.proposer is None or not request.allow_drafts or end != known:
            return 0
        return max(0, min(self.proposer.num_lookahead_slots, self.config.max_model_len - end))

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        num_accepted: dict[str, int] | None = None,
    ) -> list[Request]:
        """Record the step: KV written for the scheduled tokens, sampled tokens appended, stops applied.

        Tokens sampled for a request whose prompt is still being chunked are ignored (its logits came
        from the middle of the prompt). num_accepted: for a request that ran drafts, how many of them the model
        agreed with; its sampled token is then the model's own after those (at the first rejected draft, or after
        the last). Returns the requests that finished in this step; their blocks go back to the pool at
        release_finished().
        """
        finished: list[Request] = []
        if output is self._queued:
            self._queued = None
        queued = {s.request.request_id for s in self._queued.scheduled} if self._queued else set()
        for item in output.scheduled:
            request = item.request
            if not item.settled:
                raise ValueError(
                    f"request {request.request_id!r}: its row was never settled (ScheduledRequest.settle)"
                )
            if request.is_finished:  # aborted between schedule() and now
                continue
            token_id = sampled_token_ids.get(request.request_id)
            drafts = item.spec_token_ids
            accepted: list[int] = []
            if drafts and token_id is not None:
                accepted = drafts[: (num_accepted or {}).get(request.request_id, 0)]
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(accepted)
                per_pos = self.num_accepted_per_pos
                per_pos.extend([0] * (len(accepted) - len(per_pos)))
                for pos in range(len(accepted)):
                    per_pos[pos] += 1
            # The rejected drafts' KV is garbage: they are not computed, and a later step overwrites their slots.
            request.num_computed_tokens += item.num_new_tokens - (len(drafts) - len(accepted))
            self.kv_cache_manager.free_skipped(request)
            if token_id is None or not item.needs_sample:
                continue
            for new_token in [*accepted, token_id]:
                request.append_output_token(new_token)
                status = self._check_stop(request, new_token)
                if status is not None:  # what the step found past the stop is dropped
                    request.status = status
                    self._unreleased.append(request)
                    del self.requests[request.request_id]
                    finished.append(request)
                    break
            # The blocks of rejected drafts that no known token needs, unless a queued step may still use them.
            if (
                (drafts or item.pending_drafts)
                and not request.is_finished
                and request.request_id not in queued
            ):
                self.kv_cache_manager.trim(request, request.num_tokens)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a waiting or running request from outside (stop string, abort). None if unknown."""
        if not status.is_finished:
            raise ValueError(f"status must be one of the FINISHED_* statuses, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache_manager.free(request)
        return request

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if not request.ignore_eos and token_id == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: dropping the KV is free, and its full blocks stay cached until evicted, so
        # the recompute is often mostly prefix-cache hits.
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def _arrival(request: Request) -> int:
    return request.arrival_index


def _catching_up(request: Request, ahead: int = 0, sampling: bool = False) -> bool:
    """Still reading its prompt (or, after a preemption, recomputing), rather than decoding one token a step.
    ahead, sampling: as Scheduler._ahead, for a request seen past the step in flight."""
    num_tokens = request.num_tokens + sampling
    return num_tokens - request.num_computed_tokens - ahead > 1 or request.num_output_tokens + sampling == 0
