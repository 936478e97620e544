"""The engine core in a process of its own, and the client the server talks to it through.

One Python interpreter could not run hundreds of HTTP streams, their detokenization and the GPU's step loop at
once: on an H200 the threaded server delivered 27-40% of the offline API's tokens/s. Here the core process only
schedules, runs the model and sends each step's token deltas; the server's process does HTTP, tokenization,
detokenization and streaming. They talk over one multiprocessing pipe with pickled messages: commands in (add,
abort, stop), and one message per step out (that step's deltas for every request, and now and then the stats).

The client has AsyncEngine's interface (submit -> OutputStream of deltas, abort_all, stats, is_alive, shutdown),
so the server runs on either. If the core process dies, every stream fails with EngineDeadError, is_alive turns
False and `on_death` is called (serve() then stops with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from mlaserve.core.request import RequestStatus
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.output_stream import EngineDeadError, EngineStepError, OutputStream

logger = logging.getLogger(__name__)

_STATS_EVERY_S = 0.1  # the core sends a stats snapshot with a step's deltas at most this often
_MAX_CONSECUTIVE_STEP_ERRORS = 3


# ---- the core process ---------------------------------------------------------------------------------------
def core_main(
    options: dict,
    conn: Connection,
    describe: Callable[[Any], dict] | None,
    log_level: int,
    quiet: tuple[str, ...] = (),
) -> None:
    """Entry point of the core process: build the engine, report "ready", then serve commands and step. Loggers
    in `quiet` pass warnings only (what they log at INFO, `describe`'s report says again)."""
    # The server's process owns SIGINT/SIGTERM and drains; the core stops when told (or when the pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlaserve.config.engine_config import EngineConfig
    from mlaserve.engine.core import EngineCore

    try:
        core = EngineCore(EngineConfig.from_kwargs(**options))
        _leave_a_core_to_the_server(core.device)
        info = {
            "model_config": core.model_config,
            "stats": core.stats(),
            "report": describe(core) if describe is not None else {},
        }
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails its start-up
        conn.send(("failed", f"{type(error).__name__}: {error}", traceback.format_exc()))
        return
    conn.send(("ready", info))
    _CoreLoop(core, conn).run()


def _leave_a_core_to_the_server(device: Any) -> None:
    """On CPU the model's threads would take every core, and the server's process (HTTP, detokenization, streams)
    would preempt them at every step; one core is left to it, as vLLM's CPU back end advises. An explicit
    OMP_NUM_THREADS is the operator's choice and is kept."""
    import os

    import torch

    if str(device) != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores > 1:
        torch.set_num_threads(min(torch.get_num_threads(), cores - 1))
        logger.info("engine core: %d torch thread(s), one core left to the server", torch.get_num_threads())


class _CoreLoop:
    def __init__(self, core: Any, conn: Connection) -> None:
        self.core, self.conn = core, conn
        self.in_flight: set[str] = set()
        self.last_stats = 0.0

    def run(self) -> None:
        errors = 0
        while True:
            busy = self.core.has_unfinished_requests()
            try:
                if self.conn.poll(0 if busy else 0.5):
                    while True:
                        if not self._handle(self.conn.recv()):
                            return
                        if not self.conn.poll(0):
                            break
            except (EOFError, OSError):  # the server's process is gone
                return
            if not self.core.has_unfinished_requests():
                self._send_stats()
                continue
            try:
                outputs = self.core.step_core()
                errors = 0
            except Exception as error:  # noqa: BLE001 - the step's requests fail; the core may recover
                errors += 1
                logger.exception("engine step failed; failing %d request(s) in flight", len(self.in_flight))
                failed = sorted(self.in_flight)
                try:
                    self.core.abort_core(failed)
                    recovered = not self.core.has_unfinished_requests()
                except Exception:  # noqa: BLE001
                    recovered = False
                self.in_flight.clear()
                self._send(("step_failed", failed, repr(error)))
                if not recovered or errors >= _MAX_CONSECUTIVE_STEP_ERRORS:
                    self._send(("dead", f"the engine core cannot recover from {error!r}"))
                    return
                continue
            self._send_outputs(outputs)

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            for request_id, prepared in message[1]:
                try:
                    self.core.add_core(prepared, request_id)
                    self.in_flight.add(request_id)
                except Exception as error:  # noqa: BLE001 - a bad request fails alone
                    self._send(("add_failed", [request_id], f"{type(error).__name__}: {error}"))
        elif kind == "abort":
            ids = message[1] if message[1] is not None else sorted(self.in_flight)
            status = (
                RequestStatus.FINISHED_STOPPED if message[2] == "stop" else RequestStatus.FINISHED_ABORTED
            )
            self._send_outputs(self.core.abort_core(ids, status))
        elif kind == "stop":
            return False
        return True

    def _send_outputs(self, outputs: list[CoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self.in_flight.discard(out.request_id)
        now = time.monotonic()
        stats = None
        if now - self.last_stats >= _STATS_EVERY_S or not self.core.has_unfinished_requests():
            stats, self.last_stats = self.core.stats(), now
        if outputs or stats is not None:
            self._send(("out", outputs, stats))

    def _send_stats(self) -> None:
        now = time.monotonic()
        if now - self.last_stats >= 1.0:
            self.last_stats = now
            self._send(("out", [], self.core.stats()))

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # the server's process is gone; the next poll ends the loop


# ---- the client, in the server's process ----------------------------------------------------------------------
class CoreProcessClient:
    """AsyncEngine's interface over an engine core in its own process."""

    def __init__(
        self,
        options: dict,
        describe: Callable[[Any], dict] | None = None,
        on_death: Callable[[], None] | None = None,
        start_timeout_s: float = 3600.0,
        quiet: tuple[str, ...] = (),
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child = ctx.Pipe(duplex=True)
        level = logging.getLogger().getEffectiveLevel()
        self.process = ctx.Process(
            target=core_main,
            args=(options, child, describe, level, quiet),
            name="mlaserve-engine-core",
            daemon=True,
        )
        self.process.start()
        child.close()
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
        self._reader = threading.Thread(target=self._read, name="mlaserve-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"the engine core process exited during start-up (code {self.process.exitcode})"
                )
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine core did not start within {timeout_s:g} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(
                f"the engine core process exited during start-up (code {self.process.exitcode})"
            ) from None
        if message[0] == "failed":
            self.process.join(10)
            logger.debug("engine core start-up failed:\n%s", message[2])
            raise ValueError(f"the engine could not start: {message[1]}")
        return message[1]

    def grammar_compiler(self) -> Any:
        from mlaserve.engine.structured_output import GrammarCompiler

        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    # ---- state, safe from any thread -------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return not self._dead and not self._stopping and self.process.is_alive()

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
        """Stop the core process (its requests end); streams still open fail with EngineDeadError."""
        self._stopping = True
        self._send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
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
                if stats is not None:
                    self._stats = stats
                if outputs:
                    self._dispatch(outputs)
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
            logger.critical("the engine core process stopped (exit code %s)", self.process.exitcode)
        self._fail_streams(None, EngineDeadError("the engine core process stopped"))
        if self.on_death is not None and not self._stopping:
            self.on_death()

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
    by_stream: dict[OutputStream, list[CoreOutput]] = {}
    for stream, out in items:
        by_stream.setdefault(stream, []).append(out)
    for stream, outs in by_stream.items():
        stream.deliver(outs, None)
