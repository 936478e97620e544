"""One HTTP generation request in flight: its engine requests (one per choice), deadline, deltas and metrics.

The engine core sends token deltas; an OutputProcessor here (on the event loop, never the core's thread or process)
turns them into text deltas and finds stop strings. Streaming and non-streaming responses are both built from the
same deltas, so the streamed text is the non-streamed text by construction; whatever tokens are ready when the
reader gets to them leave in one update per choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from mlaserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.output_processor import OutputProcessor, RequestDelta
from mlaserve.error_text import error_text
from mlaserve.outputs import LogprobEntry
from mlaserve.server.errors import OpenAIError
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.protocol import Usage

logger = logging.getLogger(__name__)

SHUTDOWN_ABORT = "the server shut down before this request finished; it was aborted"
GRAMMAR_STOPPED = (
    "the structured-output constraint could not be enforced to the end (the grammar engine hit one of its limits); "
    "the request was stopped rather than go on unconstrained: use a smaller or simpler grammar"
)


@dataclass(slots=True)
class ChoiceUpdate:
    """What one choice gained since its last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    # The prompt's logprobs (first entry None), in the first update after the prompt was computed.
    prompt_logprobs: list[LogprobEntry | None] | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, accumulated from its updates (the non-streaming response)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None


@dataclass(slots=True)
class _ChoiceState:
    num_tokens: int = 0
    last_token_at: float | None = None
    counted: bool = False  # in vLLM's request_success_total (by its finish reason) already


if TYPE_CHECKING:
    from mlaserve.server.state import ServerState


class Generation:
    """Counts itself in the request metrics when closed, so errors it raises carry status=None."""

    @classmethod
    def for_request(
        cls,
        state: ServerState,
        prepared: list[PreparedRequest],
        request_id: str,
        prompt_tokens: int,
        arrival: float,
        discard_output: bool = False,
    ) -> Generation:
        """The one way both endpoints start a generation: the server's engine, metrics and timeout."""
        return cls(
            state.engine,
            state.metrics,
            prepared,
            request_id,
            prompt_tokens,
            state.settings.request_timeout_s,
            arrival,
            discard_output,
            state.intake.tokenizer,
        )

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        prepared: list[PreparedRequest],
        request_id: str,
        usage_prompt_tokens: int,
        timeout_s: float,
        arrival: float,
        discard_output: bool = False,
        tokenizer: object | None = None,
    ) -> None:
        """discard_output: the engine runs one token only to get the prompt scored (echo with max_tokens 0);
        the choices then hold no generated token."""
        self.request_id = request_id
        self._discard = discard_output
        self.prompt_tokens = usage_prompt_tokens
        self.completion_tokens = 0
        self._metrics = metrics
        self._arrival = arrival  # time.monotonic() when the HTTP request arrived
        self._deadline = arrival + timeout_s
        self._timeout_s = timeout_s
        self._ids = [f"{request_id}-{i}" for i in range(len(prepared))]
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._choices = [_ChoiceState() for _ in self._ids]
        self._processor = OutputProcessor(tokenizer)
        for rid, p in zip(self._ids, prepared):
            self._processor.add(rid, p)
        self._prompt_lens = {rid: len(p.prompt_token_ids) for rid, p in zip(self._ids, prepared)}
        self._first_token_seen = False
        self.outcome: str | None = None  # metrics status once known; None at close means the client left
        self._closed = False
        try:
            self._stream = engine.submit(prepared, self._ids)
        except EngineDeadError as error:
            raise OpenAIError(503, str(error), code="engine_dead", status="error") from None
        metrics.prompt_tokens.inc(usage_prompt_tokens)
        metrics.request_started(len(prepared), prepared[0].params.max_tokens)

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, total_tokens=total
        )

    async def updates(self) -> AsyncIterator[list[ChoiceUpdate]]:
        """Batches of choice updates until every choice finished. Raises OpenAIError on timeout, engine failure,
        or a choice the server aborted."""
        while True:
            try:
                outputs = await self._stream.next_outputs(max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                self.outcome = "timeout"
                self._stream.abort()
                raise OpenAIError(
                    408,
                    f"the request did not finish within request_timeout_s={self._timeout_s:g} s and was aborted",
                    code="request_timeout",
                    status=None,
                ) from None
            except Exception as error:  # noqa: BLE001 - EngineStepError, EngineDeadError, or a failed add
                self.outcome = "error"
                status_code = 503 if isinstance(error, EngineDeadError) else 500
                # the log keeps the whole text; the client gets one line of it (error_text.py says why)
                logger.error("request %s failed in the engine: %r", self.request_id, error)
                message = (
                    str(error) if isinstance(error, EngineStepError | EngineDeadError) else error_text(error)
                )
                raise OpenAIError(status_code, message, code="engine_error", status=None) from None
            if not outputs:
                self.outcome = self.outcome or "ok"
                # The streams a step finished were all woken by it; without this pause each would run its
                # completion (usage, [DONE], the response's end) before the next one wrote its last tokens, and
                # with dozens of streams the last one's final tokens waited behind every other stream's ending.
                await asyncio.sleep(0)
                return
            deltas, stopped, finished = self._processor.process(outputs)
            self._stream.finish(stopped)  # stop strings: the core stops those requests
            batch = self._updates(deltas, finished)
            ended = ("abort", "error")
            aborted = next((i for i, u in enumerate(batch) if u.finish_reason in ended), None)
            if aborted is None:
                if batch:
                    yield batch
                continue
            # The server aborted a choice (shutdown grace over, or a grammar it could not keep enforcing): what
            # came before it is still delivered.
            if aborted:
                yield batch[:aborted]
            if batch[aborted].finish_reason == "error":
                self.outcome = "error"
                raise OpenAIError(500, GRAMMAR_STOPPED, code="grammar_not_enforced", status=None)
            raise OpenAIError(503, SHUTDOWN_ABORT, code="aborted", status=None)

    def _updates(self, deltas: list[RequestDelta], finished: dict) -> list[ChoiceUpdate]:
        """One update per choice, merging its deltas (a reader that fell behind sends them in one event)."""
        merged: dict[int, ChoiceUpdate] = {}
        now = time.monotonic()
        for delta in deltas:
            index = self._index[delta.request_id]
            choice = self._choices[index]
            new_ids = delta.new_token_ids
            logprobs = delta.new_logprobs
            if (
                self._discard
            ):  # echo with max_tokens 0: the one token generated to score the prompt is dropped
                new_ids, logprobs = [], None if logprobs is None else []
                text = ""
            else:
                text = delta.text
                self._count_tokens(choice, len(new_ids), now)
            update = merged.get(index)
            if update is None:
                merged[index] = ChoiceUpdate(
                    index, text, list(new_ids), None if logprobs is None else list(logprobs), None
                )
                update = merged[index]
            else:
                update.text += text
                update.token_ids += new_ids
                if logprobs is not None:
                    update.logprobs = (update.logprobs or []) + logprobs
            if delta.prompt_logprobs is not None:
                update.prompt_logprobs = delta.prompt_logprobs
            if delta.finished:
                update.finish_reason = delta.finish_reason
                if delta.finish_reason == "abort" and self.outcome is None:
                    self.outcome = "aborted"  # aborted by the server (shutdown grace over), not by the client
                state = finished.get(delta.request_id)
                if state is not None:
                    choice.counted = True
                    self._metrics.request_finished(
                        self._prompt_lens[delta.request_id],
                        len(state.token_ids),
                        delta.finish_reason,
                        state.metrics,
                    )
        return list(merged.values())

    def _count_tokens(self, choice: _ChoiceState, count: int, now: float) -> None:
        if not count:
            return
        if not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.ttft.observe(now - self._arrival)
        if choice.last_token_at is not None:
            gap = (now - choice.last_token_at) / count  # tokens that arrived together share the gap
            for _ in range(count):
                self._metrics.inter_token_latency(gap)
        choice.last_token_at = now
        self._metrics.generation_tokens.inc(count)
        self.completion_tokens += count
        choice.num_tokens += count

    async def collect(self, request: Request | None = None) -> list[ChoiceResult]:
        """Run to the end; abort at once if the client disconnects first (when `request` is given)."""
        if request is None:
            return await self._accumulate()
        collect = asyncio.ensure_future(self._accumulate())
        watch = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect in done:
                return collect.result()
        finally:  # also when this handler itself is cancelled: no task may outlive the request
            watch.cancel()
            collect.cancel()
        self.close()
        raise OpenAIError(400, "the client disconnected", code="client_disconnected", status=None)

    async def _accumulate(self) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in self._ids]
        async for batch in self.updates():
            for update in batch:
                result = results[update.index]
                result.text += update.text
                result.token_ids += update.token_ids
                if update.logprobs is not None:
                    result.logprobs = (result.logprobs or []) + update.logprobs
                if update.prompt_logprobs is not None:
                    result.prompt_logprobs = update.prompt_logprobs
                result.finish_reason = update.finish_reason or result.finish_reason
        return results

    def close(self) -> None:
        """Abort what is unfinished (freeing its KV blocks now) and count the request once."""
        if self._closed:
            return
        self._closed = True
        self._stream.abort()
        self._metrics.count(self.outcome or "aborted")
        # Choices cut short (client gone, timeout, failure) end as vLLM counts them: finished_reason="abort".
        for rid, choice in zip(self._ids, self._choices):
            if not choice.counted:
                choice.counted = True
                self._metrics.request_finished(self._prompt_lens[rid], choice.num_tokens, "abort", None)
        self._metrics.e2e.observe(time.monotonic() - self._arrival)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
