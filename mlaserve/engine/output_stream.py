"""OutputStream: the core's deltas for a server request's engine requests, handed from the engine to asyncio.

Deltas pile up until the reader takes them, all at once: a reader that fell behind gets every token that is ready
in one read (and sends them in one event). Closing the stream early aborts what is unfinished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from mlaserve.engine.core_output import CoreOutput


class EngineDeadError(RuntimeError):
    """The loop thread is gone (shut down or broken): no request can run."""


class EngineStepError(RuntimeError):
    """A step raised while this request was in flight; the loop may still serve new requests."""


class OutputStream:
    """The deltas of one or more engine requests, read by one coroutine on the loop that submitted them."""

    def __init__(
        self,
        request_ids: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        abort_fn: Callable[..., None],
    ) -> None:
        self.request_ids = list(request_ids)
        self.closed = False  # set on the event loop, read by the engine thread (a plain bool is enough)
        self._loop = loop
        self._abort_fn = abort_fn
        self._unfinished = set(request_ids)
        self._pending: list[CoreOutput] = []
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()

    def deliver_threadsafe(self, outputs: list[CoreOutput], error: BaseException | None) -> bool:
        """Called by the engine thread; False when the reader's event loop has closed."""
        try:
            self._loop.call_soon_threadsafe(self.deliver, outputs, error)
        except RuntimeError:
            return False
        return True

    def deliver(self, outputs: list[CoreOutput], error: BaseException | None) -> None:
        """On the stream's event loop."""
        if self.closed:
            return
        self._pending.extend(outputs)
        if error is not None and self._error is None:
            self._error = error
        self._wakeup.set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next_outputs(self, timeout: float | None = None) -> list[CoreOutput]:
        """Every delta since the last call, in order; [] once all finished.

        Raises TimeoutError after `timeout` seconds without news, and the engine's error if a step failed."""
        deadline = None if timeout is None else self._loop.time() + timeout
        while not self._pending:
            if self._error is not None:
                raise self._error
            if not self._unfinished:
                return []
            self._wakeup.clear()
            if deadline is None:
                await self._wakeup.wait()
                continue
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                raise TimeoutError("no output before the deadline")
            # A timer that sets the event, not asyncio.wait_for: that wraps the wait in a new task on every call,
            # which a server reading 256 streams' tokens paid for at every step.
            timer = self._loop.call_at(deadline, self._wakeup.set)
            try:
                await self._wakeup.wait()
            finally:
                timer.cancel()
        outputs, self._pending = self._pending, []
        self._unfinished.difference_update(o.request_id for o in outputs if o.finished)
        return outputs

    async def __aiter__(self) -> AsyncIterator[CoreOutput]:
        while outputs := await self.next_outputs():
            for out in outputs:
                yield out

    def finish(self, request_ids: list[str]) -> None:
        """End these requests early (a stop string found in their text): the core stops them, as stopped, and
        their later deltas are not read."""
        ids = [rid for rid in request_ids if rid in self._unfinished]
        self._unfinished.difference_update(ids)
        if ids:
            self._abort_fn(ids, "stop")

    def abort(self) -> None:
        """Stop reading: the unfinished requests are aborted (their KV blocks freed) on the next loop turn."""
        if self.closed:
            return
        self.closed = True
        unfinished = sorted(self._unfinished)
        self._unfinished.clear()
        self._pending = []
        self._wakeup.set()  # a reader still waiting sees the stream as ended
        if unfinished:
            self._abort_fn(unfinished)
