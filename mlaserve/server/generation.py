"""One HTTP generation request in flight: its engine requests (one per choice), deadline, deltas and metrics.

Streaming and non-streaming responses are both built from the same text deltas, so the streamed text is the
non-streamed text by construction.
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
from mlaserve.outputs import RequestOutput
from mlaserve.server.errors import OpenAIError
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.protocol import Usage

logger = logging.getLogger(__name__)

SHUTDOWN_ABORT = "the server shut down before this request finished; it was aborted"


@dataclass(slots=True)
class ChoiceUpdate:
    """What one choice gained since its last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    # The prompt's logprobs (first entry None), in the first update after the prompt was computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A whole choice, accumulated from its updates (the non-streaming response)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True)
class _ChoiceState:
    sent_text: str = ""
    num_tokens: int = 0
    last_token_at: float | None = None
    sent_prompt_logprobs: bool = False


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
                message = str(error) if isinstance(error, EngineStepError | EngineDeadError) else repr(error)
                logger.error("request %s failed in the engine: %s", self.request_id, message)
                raise OpenAIError(status_code, message, code="engine_error", status=None) from None
            if not outputs:
                self.outcome = self.outcome or "ok"
                return
            batch = [self._update(out) for out in outputs]
            aborted = next((i for i, u in enumerate(batch) if u.finish_reason == "abort"), None)
            if aborted is None:
                yield batch
                continue
            # The server aborted a choice (shutdown grace over): what came before it is still delivered.
            if aborted:
                yield batch[:aborted]
            raise OpenAIError(503, SHUTDOWN_ABORT, code="aborted", status=None)

    def _update(self, out: RequestOutput) -> ChoiceUpdate:
        index = self._index[out.request_id]
        state, choice = self._choices[index], out.outputs[0]
        if out.finished:
            self._metrics.request_finished(out)
        prompt_logprobs = None
        if (
            out.prompt_logprobs is not None
            and not state.sent_prompt_logprobs
            and (choice.token_ids or out.finished)
        ):
            prompt_logprobs, state.sent_prompt_logprobs = out.prompt_logprobs, True
        if self._discard:
            finish = choice.finish_reason if out.finished else None
            return ChoiceUpdate(
                index, "", [], None if choice.logprobs is None else [], finish, prompt_logprobs
            )
        new_ids = choice.token_ids[state.num_tokens :]
        now = time.monotonic()
        if new_ids:
            if not self._first_token_seen:
                self._first_token_seen = True
                self._metrics.ttft.observe(now - self._arrival)
            if state.last_token_at is not None:
                gap = (now - state.last_token_at) / len(new_ids)  # tokens that arrived together share the gap
                for _ in new_ids:
                    self._metrics.itl.observe(gap)
            state.last_token_at = now
            self._metrics.generation_tokens.inc(len(new_ids))
            self.completion_tokens += len(new_ids)
        logprobs = None if choice.logprobs is None else choice.logprobs[state.num_tokens :]
        state.num_tokens = len(choice.token_ids)
        text = choice.text
        if not out.finished:
            # A token that ends inside a UTF-8 character decodes to U+FFFD until the next one completes it.
            text = text.rstrip("\ufffd")
        if text.startswith(state.sent_text):
            delta = text[len(state.sent_text) :]
        else:  # the decoder revised text already sent; it cannot be taken back, so send what follows
            common = 0
            while common < min(len(text), len(state.sent_text)) and text[common] == state.sent_text[common]:
                common += 1
            logger.warning("request %s: detokenized text changed after it was streamed", out.request_id)
            delta = text[max(common, len(state.sent_text)) :]
        state.sent_text += delta
        finish = choice.finish_reason if out.finished else None
        if finish == "abort" and self.outcome is None:
            self.outcome = "aborted"  # aborted by the server (shutdown grace over), not by the client
        return ChoiceUpdate(index, delta, list(new_ids), logprobs, finish, prompt_logprobs)

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
        self._metrics.e2e.observe(time.monotonic() - self._arrival)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
