"""AsyncEngine: the engine core stepped by a background thread of this process; asyncio talks to it by queues.

The in-process twin of CoreProcessClient (core_process.py), with the same interface: `mlaserve serve` runs the core
in its own process, tests and embedders may keep it in a thread. The engine is not thread-safe, so everything that
touches it (adding, aborting, stepping, stats) runs on that thread. Commands go in through a thread-safe queue that
the loop drains before each step; each step's token deltas go back to the requests' event loop with
`call_soon_threadsafe`, where the server detokenizes them. HTTP handlers therefore never wait for a step, and a slow
step never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from mlaserve.core.request import RequestStatus
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.llm_engine import LLMEngine
from mlaserve.engine.output_processor import OutputProcessor
from mlaserve.engine.output_stream import EngineDeadError, EngineStepError, OutputStream
from mlaserve.error_text import error_text
from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Steps that fail one after another with no good step between: past this the engine is treated as broken
# (health goes 503) rather than failing every new request forever.
_MAX_CONSECUTIVE_STEP_ERRORS = 3


@dataclass(slots=True)
class _Add:
    prepared: list[PreparedRequest]
    request_ids: list[str]
    stream: OutputStream


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s  # how long the idle loop blocks on the inbox before re-checking
        self.last_error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # loop thread only
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._stats = engine.stats()
        self._dead = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlaserve-engine-loop", daemon=True)
        self._thread.start()

    # ---- what the server reads of the engine (CoreProcessClient has the same) ---------------------------------
    @property
    def model_config(self) -> object:
        return self.engine.model_config

    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    def grammar_compiler(self) -> object:
        return self.engine.core.grammar_compiler()

    # ---- state, safe from any thread -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead and not self._stopping.is_set()

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished or aborted."""
        return self._in_flight

    def stats(self) -> dict:
        """The engine's stats as of the end of the last loop iteration (a copy; never touches the engine)."""
        return dict(self._stats)

    # ---- asyncio API -----------------------------------------------------------------------------------------
    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the loop thread between steps (tokenizing, chat templates, fresh stats)."""
        return await asyncio.wrap_future(self.call(fn))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future:
        """As run(), for synchronous callers: returns a concurrent Future."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        dead = not self._thread.is_alive() and not future.done()  # it died in between: nobody will run fn
        if dead and future.set_running_or_notify_cancel():
            future.set_exception(EngineDeadError("the engine loop stopped"))
        return future

    async def prepare(self, prompt: str | dict, params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize (raises ValueError/TypeError) with nothing queued in the engine."""
        return await self.run(lambda engine: engine.prepare(prompt, params))

    def submit(self, prepared: Sequence[PreparedRequest], request_ids: Sequence[str]) -> OutputStream:
        """Queue already-prepared requests as one stream (an OpenAI request with n > 1 is several)."""
        if len(prepared) != len(request_ids) or not prepared:
            raise ValueError("submit needs one request id per prepared request, and at least one")
        self._check_alive()
        stream = OutputStream(request_ids, asyncio.get_running_loop(), self._abort_ids)
        with self._in_flight_lock:
            self._in_flight += len(request_ids)
        self._inbox.put(_Add(list(prepared), list(request_ids), stream))
        if not self._thread.is_alive():  # it died in between: nobody will read the inbox again
            stream.deliver_threadsafe([], EngineDeadError("the engine loop stopped"))
        return stream

    async def generate(
        self, prompt: str | dict, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request (its deltas processed here, on the event loop); closing the iterator
        early (client gone) aborts it at once."""
        prepared = await self.prepare(prompt, params)
        stream = self.submit([prepared], [request_id])
        processor = OutputProcessor(self.engine.tokenizer)
        processor.add(request_id, prepared)
        try:
            while outputs := await stream.next_outputs():
                deltas, stopped, finished = processor.process(outputs)
                stream.finish(stopped)
                if deltas:  # one output for everything that arrived together
                    state = finished.get(request_id) or processor.states[request_id]
                    yield state.output(request_id)
                if finished:
                    return
        finally:
            stream.abort()

    def abort_all(self) -> None:
        """Abort every request in flight (end of a shutdown grace period); their streams end with 'abort'."""
        self._inbox.put(_Abort([]))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: requests still in flight are aborted and their streams fail with EngineDeadError."""
        self._stopping.set()
        self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running (last error: {self.last_error!r})")

    def _abort_ids(self, request_ids: list[str], reason: str = "abort") -> None:
        status = RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_ABORTED
        self._inbox.put(_Abort(request_ids, status))

    # ---- the loop thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        consecutive_errors = 0
        while not self._stopping.is_set():
            try:
                if not self._drain_inbox(block=not self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.core.step())
                    self.engine.core.release_finished()
                    consecutive_errors = 0
                self._stats = self.engine.stats()
            except Exception as error:  # noqa: BLE001 - any step failure is reported to its requests
                consecutive_errors += 1
                recovered = self._fail_in_flight(error)
                if not recovered or consecutive_errors >= _MAX_CONSECUTIVE_STEP_ERRORS:
                    logger.critical("engine loop stopped: the engine cannot recover from %r", error)
                    self._dead = True
                    break
        self._close(EngineDeadError("the engine loop stopped"))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop. Blocks (with a timeout) only when idle."""
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, item: _Add | _Abort | _Call) -> None:
        if isinstance(item, _Call):
            if item.future.set_running_or_notify_cancel():
                try:
                    item.future.set_result(item.fn(self.engine))
                except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
                    item.future.set_exception(error)
        elif isinstance(item, _Abort):
            # The final 'abort' outputs go to their streams: a server-side abort (end of a shutdown grace)
            # must end the response; a client's own abort finds its stream closed and is not told.
            finals: dict[OutputStream, list[CoreOutput]] = {}
            for rid in item.request_ids or list(self._streams):
                stream = self._streams.get(rid)
                if stream is not None:
                    finals.setdefault(stream, []).extend(self._abort(rid, item.status))
            for stream, outs in finals.items():
                stream.deliver_threadsafe(outs, None)
        elif item.stream.closed:  # the client left before the loop got to it
            self._release(len(item.request_ids))
        else:
            added: list[str] = []
            try:
                for prepared, rid in zip(item.prepared, item.request_ids):
                    self.engine.core.add_request(prepared, rid)
                    self._streams[rid] = item.stream
                    added.append(rid)
            except Exception as error:  # noqa: BLE001 - e.g. a duplicate request id
                for rid in added:
                    self._abort(rid)
                self._release(len(item.request_ids) - len(added))
                item.stream.deliver_threadsafe([], error)

    def _abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[CoreOutput]:
        self._streams.pop(request_id)
        self._release(1)
        return self.engine.core.abort_requests([request_id], status)

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        by_stream: dict[OutputStream, list[CoreOutput]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_stream.setdefault(stream, []).append(out)
            if out.finished:
                del self._streams[out.request_id]
                self._release(1)
        for stream, outs in by_stream.items():
            if not stream.deliver_threadsafe(outs, None):  # its event loop is gone: nobody will read
                for rid in [r for r, s in self._streams.items() if s is stream]:
                    self._abort(rid)

    def _release(self, count: int) -> None:
        with self._in_flight_lock:
            self._in_flight -= count

    def _fail_in_flight(self, error: Exception) -> bool:
        """Fail every request in flight with the step's error; False if the engine could not be cleaned."""
        logger.exception("engine step failed; failing %d request(s) in flight", len(self._streams))
        self.last_error = error
        failed = EngineStepError(f"the engine failed while running this request: {error_text(error)}")
        streams = set(self._streams.values())
        try:
            for rid in list(self._streams):
                self._abort(rid)
            recovered = not self.engine.has_unfinished_requests()
            if recovered:
                self.engine.core.forget_prefix_cache_after_failure()
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("cleaning up after the failed step failed too")
            recovered = False
        for stream in streams:
            stream.deliver_threadsafe([], failed)
        return recovered

    def _close(self, error: EngineDeadError) -> None:
        """The loop is ending: fail what is in flight and whatever is still queued."""
        streams = set(self._streams.values())
        for rid in list(self._streams):
            try:
                self._abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be what broke
                logger.exception("abort of %s failed during shutdown", rid)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Add):
                self._release(len(item.request_ids))
                streams.add(item.stream)
            elif isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(error)
        try:  # before telling the readers, so that what they see next is the freed state
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - the engine may be what broke
            pass
        for stream in streams:
            stream.deliver_threadsafe([], error)
