"""OutputStream: the outputs of a server request's engine requests, handed from the engine thread to asyncio.

Outputs are cumulative, so only the newest per request is kept: a slow reader skips intermediate states
instead of piling them up. Closing the stream early aborts what is unfinished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from mlaserve.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The loop thread is gone (shut down or broken): no request can run."""


class EngineStepError(RuntimeError):
    """A step raised while this request was in flight; the loop may still serve new requests."""


class OutputStream:
    """The outputs of one or more engine requests, read by one coroutine on the loop that submitted them.

    Outputs are cumulative, so only the newest per request is kept: a slow reader skips intermediate
    states instead of piling them up."""

    def __init__(
        self,
        request_ids: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        abort_fn: Callable[[list[str]], None],
    ) -> None:
        self.request_ids = list(request_ids)
        self.closed = False  # set on the event loop, read by the engine thread (a plain bool is enough)
        self._loop = loop
        self._abort_fn = abort_fn
        self._unfinished = set(request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()

    def deliver_threadsafe(self, outputs: list[RequestOutput], error: BaseException | None) -> bool:
        """Called by the engine thread; False when the reader's event loop has closed."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs, error)
        except RuntimeError:
            return False
        return True

    def _deliver(self, outputs: list[RequestOutput], error: BaseException | None) -> None:
        if self.closed:
            return
        for out in outputs:
            self._pending[out.request_id] = out
        if error is not None and self._error is None:
            self._error = error
        self._wakeup.set()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next_outputs(self, timeout: float | None = None) -> list[RequestOutput]:
        """The newest output of each request that progressed since the last call; [] once all finished.

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
            else:
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    raise TimeoutError("no output before the deadline")
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    raise TimeoutError("no output before the deadline") from None
        outputs = list(self._pending.values())
        self._pending.clear()
        self._unfinished.difference_update(o.request_id for o in outputs if o.finished)
        return outputs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while outputs := await self.next_outputs():
            for out in outputs:
                yield out

    def abort(self) -> None:
        """Stop reading: the unfinished requests are aborted (their KV blocks freed) on the next loop turn."""
        if self.closed:
            return
        self.closed = True
        unfinished = sorted(self._unfinished)
        self._unfinished.clear()
        self._pending.clear()
        self._wakeup.set()  # a reader still waiting sees the stream as ended
        if unfinished:
            self._abort_fn(unfinished)
