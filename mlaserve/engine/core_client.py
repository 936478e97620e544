"""Clients of an engine core in another process (core_process.py), with AsyncEngine's interface.

The interface (submit -> OutputStream of deltas, abort_all, stats, is_alive, shutdown) is AsyncEngine's, so the
server runs on either. CoreProcessClient starts the core; CoreClient alone is an extra API-server process's end of
one of its pipes. If the core dies, every stream fails with EngineDeadError, is_alive turns False and `on_death` is
called (serve() then stops with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.process
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.core_process import core_main
from mlaserve.engine.core_threads import LOAD_REPORT_EVERY_S
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.output_stream import EngineDeadError, EngineStepError, OutputStream
from mlaserve.engine.step_trace import trace

logger = logging.getLogger(__name__)


class CoreClient:
    """AsyncEngine's interface over one pipe to an engine core in another process."""

    def __init__(
        self,
        conn: Connection,
        options: dict,
        on_death: Callable[[], None] | None = None,
        start_timeout_s: float = 3600.0,
        process: multiprocessing.process.BaseProcess | None = None,
    ) -> None:
        """`options` are the core's engine options (this process loads the same tokenizer); `process` is the core's,
        when this process started it."""
        self._conn = conn
        self.process = process
        # The server's own tokenizer (for intake and detokenization), loaded while the core builds the model.
        self.tokenizer = None
        if not options.get("skip_tokenizer_init"):
            from mlaserve.loader.model_files import resolve_model
            from mlaserve.loader.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(resolve_model(options.get("model"), need_weights=False))
        self._grammar_compiler = None
        self.on_death = on_death
        self.last_error: BaseException | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _streams and _in_flight (the reader thread and the event loop)
        self._streams: dict[str, OutputStream] = {}
        self._in_flight = 0
        self._dead = False
        self._stopping = False
        info = self._wait_ready(start_timeout_s)
        self.model_config = info["model_config"]
        self.startup_report = info["report"]
        self._stats = info["stats"]
        self._load_at, self._load_cpu = time.monotonic(), time.process_time()
        self._reader = threading.Thread(target=self._read, name="mlaserve-core-reader", daemon=True)
        self._reader.start()

    def _core_exited(self) -> bool:
        return self.process is not None and not self.process.is_alive()

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if self._core_exited():
                raise RuntimeError(
                    f"the engine core process exited during start-up (code {self.process.exitcode})"
                )
            if time.monotonic() > deadline:
                if self.process is not None:
                    self.process.kill()
                raise RuntimeError(f"the engine core did not start within {timeout_s:g} s")
        try:
            message = self._conn.recv()
        except EOFError:
            if self.process is not None:
                self.process.join(10)
            raise RuntimeError("the engine core process exited during start-up") from None
        if message[0] == "failed":
            if self.process is not None:
                self.process.join(10)
            logger.debug("engine core start-up failed:\n%s", message[2])
            raise ValueError(f"the engine could not start: {message[1]}")
        return message[1]

    def grammar_compiler(self) -> Any:
        from mlaserve.sampling.structured_output import GrammarCompiler

        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    # ---- state, safe from any thread -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._stopping and not self._core_exited()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def stats(self) -> dict:
        return dict(self._stats)

    # ---- asyncio API -----------------------------------------------------------------------------------------
    def submit(self, prepared: Sequence[PreparedRequest], request_ids: Sequence[str]) -> OutputStream:
        if len(prepared) != len(request_ids) or not prepared:
            raise ValueError("submit needs one request id per prepared request, and at least one")
        self._check_alive()
        stream = OutputStream(request_ids, asyncio.get_running_loop(), self._abort_ids)
        with self._lock:
            for rid in request_ids:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in flight")
            for rid in request_ids:
                self._streams[rid] = stream
            self._in_flight += len(request_ids)
        if not self._send(("add", list(zip(request_ids, prepared, strict=True)))):
            self._fail_streams({stream}, EngineDeadError("the engine core process is gone"))
        return stream

    def abort_all(self) -> None:
        self._send(("abort", None, "abort"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close this pipe (the core aborts this process's requests); streams still open fail with
        EngineDeadError. CoreProcessClient also stops the core."""
        self._stopping = True
        if self._send(("detach",)):
            self._reader.join(timeout)  # the core closes its end: the reader sees the pipe end
        self._conn.close()
        self._fail_streams(None, EngineDeadError("the engine core was shut down"))

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"the engine core is not running (last error: {self.last_error!r})")

    def _abort_ids(self, request_ids: list[str], reason: str = "abort") -> None:
        self._send(("abort", list(request_ids), reason))

    def _send(self, message: tuple) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False

    # ---- the reader thread -----------------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                outputs, stats = message[1], message[2]
                if outputs:
                    trace("api_recv", len(outputs), sum(o.finish_reason is not None for o in outputs))
                if stats is not None:
                    self._stats = stats
                if outputs:
                    self._dispatch(outputs)
                self._report_load()
            elif kind in ("add_failed", "step_failed"):
                ids, text = message[1], message[2]
                error: BaseException = (
                    ValueError(text)
                    if kind == "add_failed"
                    else EngineStepError(f"the engine failed while running this request: {text}")
                )
                if kind == "step_failed":
                    self.last_error = RuntimeError(text)
                self._fail_ids(ids, error)
            elif kind == "dead":
                self.last_error = RuntimeError(message[1])
                break
        self._dead = True
        if not self._stopping:
            code = f" (exit code {self.process.exitcode})" if self.process is not None else ""
            logger.critical("the engine core process stopped%s", code)
        self._fail_streams(None, EngineDeadError("the engine core process stopped"))
        if self.on_death is not None and not self._stopping:
            self.on_death()

    def _report_load(self) -> None:
        """How busy this process was (CPU seconds over wall seconds) since its last report: on CPU the core
        leaves this process cores to match (core_threads.py)."""
        now = time.monotonic()
        if now - self._load_at >= LOAD_REPORT_EVERY_S:
            cpu = time.process_time()
            self._send(("load", (cpu - self._load_cpu) / (now - self._load_at)))
            self._load_at, self._load_cpu = now, cpu

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        """Hand a step's deltas to their streams: one call into each event loop per step, not one per stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, CoreOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                by_loop.setdefault(stream.loop, []).append((stream, out))
                if out.finish_reason is not None:
                    del self._streams[out.request_id]
                    self._in_flight -= 1
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the loop closed: nobody reads these any more
                self._abort_ids([out.request_id for _, out in items if not out.finished])

    def _fail_ids(self, request_ids: list[str], error: BaseException) -> None:
        streams = set()
        with self._lock:
            for rid in request_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    streams.add(stream)
                    self._in_flight -= 1
        for stream in streams:
            stream.deliver_threadsafe([], error)

    def _fail_streams(self, only: set | None, error: BaseException) -> None:
        with self._lock:
            ids = [rid for rid, s in self._streams.items() if only is None or s in only]
        self._fail_ids(ids, error)


def _deliver_all(items: list[tuple[OutputStream, CoreOutput]]) -> None:
    trace("api_deliver", len(items), sum(o.finish_reason is not None for _, o in items))
    by_stream: dict[OutputStream, list[CoreOutput]] = {}
    for stream, out in items:
        by_stream.setdefault(stream, []).append(out)
    for stream, outs in by_stream.items():
        stream.deliver(outs, None)


class CoreProcessClient(CoreClient):
    """Starts the engine core's process and talks to it over the first pipe; with `api_servers` > 1 the core
    also listens on one more pipe per extra API-server process (`extra_pipes`, handed to those processes)."""

    def __init__(
        self,
        options: dict,
        describe: Callable[[Any], dict] | None = None,
        on_death: Callable[[], None] | None = None,
        start_timeout_s: float = 3600.0,
        quiet: tuple[str, ...] = (),
        api_servers: int = 1,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        pipes = [ctx.Pipe(duplex=True) for _ in range(api_servers)]
        level = logging.getLogger().getEffectiveLevel()
        process = ctx.Process(
            target=core_main,
            args=(options, [core_end for _, core_end in pipes], describe, level, quiet),
            name="mlaserve-engine-core",
            daemon=True,
        )
        process.start()
        for _, core_end in pipes:
            core_end.close()
        self.extra_pipes = [mine for mine, _ in pipes[1:]]
        try:
            super().__init__(pipes[0][0], options, on_death, start_timeout_s, process)
        except BaseException:
            for conn in self.extra_pipes:
                conn.close()
            raise

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (its requests end); streams still open fail with EngineDeadError."""
        self._stopping = True
        self._send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for conn in self.extra_pipes:
            conn.close()
        self._conn.close()
        self._fail_streams(None, EngineDeadError("the engine core was shut down"))
