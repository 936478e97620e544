"""The engine core in a process of its own: it schedules, runs the model and sends each step's token deltas.

One Python interpreter could not run hundreds of HTTP streams, their detokenization and the GPU's step loop at
once: on an H200 the threaded server delivered 27-40% of the offline API's tokens/s. Here the core process does no
HTTP, tokenization or detokenization; API-server processes (one, or `api_server_count`) do, each over a pipe of
its own with pickled messages: commands in (add, abort, detach, stop; and each API server's CPU load, which sets
the core's CPU threads: core_threads.py), and per step one message out to each API server whose requests moved
(their deltas), then now and then one with the stats. The clients are in core_client.py.

The first pipe belongs to the process that started the core: when it closes, or says "stop", the core ends. A
later pipe that closes takes only its own requests with it (aborted, their blocks freed).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from mlaserve.core.request import RequestStatus
from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.core_threads import CoreThreads
from mlaserve.engine.grammar_builds import GrammarBuilds, needs_build
from mlaserve.engine.heap import freeze_start_up_objects
from mlaserve.engine.host_malloc import HostMalloc
from mlaserve.engine.step_trace import trace
from mlaserve.error_text import error_text
from mlaserve.executor.workers import WorkerDied

logger = logging.getLogger(__name__)

_STATS_EVERY_S = 0.1  # the core sends a stats snapshot with a step's deltas at most this often
_MAX_CONSECUTIVE_STEP_ERRORS = 3


def core_main(
    options: dict,
    conns: list[Connection],
    describe: Callable[[Any], dict] | None,
    log_level: int,
    quiet: tuple[str, ...] = (),
) -> None:
    """Entry point of the core process: build the engine, report "ready" on every pipe, then serve commands and
    step. Loggers in `quiet` pass warnings only (what they log at INFO, `describe`'s report says again)."""
    # The server's processes own SIGINT/SIGTERM and drain; the core stops when told (or when its first pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlaserve.config.engine_config import EngineConfig
    from mlaserve.engine.core import EngineCore

    malloc = HostMalloc()  # first: the arena cap holds only for threads not yet started
    try:
        config = EngineConfig.from_kwargs(**options)
        core = EngineCore(config)
        threads = CoreThreads(
            config.model.device
        )  # after the engine: a tensor-parallel rank 0 has taken its share
        info = {
            "model_config": core.model_config,
            "stats": core.stats(),
            "report": describe(core) if describe is not None else {},
        }
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails its start-up
        for conn in conns:
            _send(conn, ("failed", f"{type(error).__name__}: {error}", traceback.format_exc()))
        return
    for conn in conns:
        _send(conn, ("ready", info))
    freeze_start_up_objects()  # the model's modules, the scheduler: they live as long as the process
    try:
        _CoreLoop(core, conns, threads, malloc).run()
    finally:
        core.close()  # a tensor-parallel engine's other ranks


def _send(conn: Connection, message: tuple) -> bool:
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, OSError):
        return False  # that API server is gone; its next poll says so


class _CoreLoop:
    def __init__(
        self, core: Any, conns: list[Connection], threads: CoreThreads, malloc: HostMalloc | None = None
    ) -> None:
        self.core = core
        self.threads = threads
        self.malloc = malloc
        self.main = conns[0]
        self.conns = list(conns)
        self.owner: dict[str, Connection] = {}  # request id -> the pipe of the API server that added it
        self.last_stats = 0.0
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.builds = GrammarBuilds(self.inbox)

    def run(self) -> None:
        inbox = self.inbox
        reader = threading.Thread(target=_read_pipes, args=(list(self.conns), inbox), daemon=True)
        reader.start()
        errors = 0
        while self.conns:
            busy = self.core.has_unfinished_requests()
            if not self._apply_inbox(inbox, wait_s=None if busy else 0.5):
                return
            if not self.core.has_unfinished_requests():
                self._send_stats()
                if self.malloc is not None:
                    self.malloc.trim_when_idle()  # no stream waits on an idle core
                continue
            try:
                trace("core_step_start")
                outputs = self.core.step()
                trace("core_step_end", len(outputs), sum(o.finish_reason is not None for o in outputs))
                errors = 0
            except Exception as error:  # noqa: BLE001 - the step's requests fail; the core may recover
                errors += 1
                logger.exception("engine step failed; failing %d request(s) in flight", len(self.owner))
                failed, self.owner = self.owner, {}
                try:
                    self.core.abort_requests(sorted(failed))
                    recovered = not self.core.has_unfinished_requests()
                    if recovered:
                        self.core.forget_prefix_cache_after_failure()
                except Exception:  # noqa: BLE001
                    recovered = False
                for conn, ids in _by_conn(failed).items():
                    _send(conn, ("step_failed", ids, error_text(error)))
                if isinstance(error, WorkerDied) or not recovered or errors >= _MAX_CONSECUTIVE_STEP_ERRORS:
                    for conn in self.conns:
                        _send(conn, ("dead", f"the engine core cannot recover from {error_text(error)}"))
                    return
                continue
            self._send_outputs(outputs)
            trace("core_sent")

    def _apply_inbox(self, inbox: queue.SimpleQueue, wait_s: float | None) -> bool:
        """Apply every command received so far (waiting up to wait_s for the first when idle); False when the
        core must end."""
        try:
            item = inbox.get_nowait() if wait_s is None else inbox.get(timeout=wait_s)
        except queue.Empty:
            return True
        while True:
            conn, message = item
            if message is None or message[0] == "detach":  # that API server left
                if not self._detach(conn):
                    return False
            elif not self._handle(conn, message):
                return False
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                return True

    def _detach(self, conn: Connection) -> bool:
        """An API server left: its requests are aborted. False when it was the first (the core ends)."""
        if conn is self.main:
            return False
        self.conns.remove(conn)
        self.threads.forget(conn)
        self.builds.forget(conn)
        conn.close()
        gone = sorted(rid for rid, owner in self.owner.items() if owner is conn)
        for rid in gone:
            del self.owner[rid]
        if gone:
            self.core.abort_requests(gone)
        return True

    def _handle(self, conn: Connection, message: tuple) -> bool:
        kind = message[0]
        if kind == "add":
            for request_id, prepared in message[1]:
                if needs_build(prepared):  # its grammar is built off this loop; "built" adds it
                    self.builds.start(self.core.grammar_compiler(), conn, request_id, prepared)
                else:
                    self._add(conn, request_id, prepared)
        elif kind == "built":
            _, request_id, prepared, future = message
            if self.builds.finish(request_id, prepared):
                error = future.exception()
                if error is None:
                    self._add(conn, request_id, prepared)
                else:
                    _send(conn, ("add_failed", [request_id], f"{type(error).__name__}: {error}"))
        elif kind == "abort":
            # None: every request of the API server that asks (the end of its shutdown grace)
            ids = message[1] if message[1] is not None else [r for r, c in self.owner.items() if c is conn]
            status = (
                RequestStatus.FINISHED_STOPPED if message[2] == "stop" else RequestStatus.FINISHED_ABORTED
            )
            unbuilt = self.builds.abort(conn, message[1], status.finish_reason)
            if unbuilt:
                _send(conn, ("out", unbuilt, None))
            self._send_outputs(self.core.abort_requests(ids, status))
        elif kind == "load":
            self.threads.report(conn, message[1])
        elif kind == "stop":
            return False
        return True

    def _add(self, conn: Connection, request_id: str, prepared: Any) -> None:
        try:
            self.core.add_request(prepared, request_id)
            self.owner[request_id] = conn
        except Exception as error:  # noqa: BLE001 - a bad request fails alone
            _send(conn, ("add_failed", [request_id], f"{type(error).__name__}: {error}"))

    def _send_outputs(self, outputs: list[CoreOutput]) -> None:
        """The step's deltas first; then the finished requests' blocks go back to the pool and, when due, the
        stats follow in a message of their own: both cost milliseconds when hundreds of requests finish at once,
        which every last token would otherwise wait for."""
        by_conn: dict[Connection, list[CoreOutput]] = {}
        for out in outputs:
            conn = self.owner.get(out.request_id)
            if conn is None:
                continue
            by_conn.setdefault(conn, []).append(out)
            if out.finish_reason is not None:
                del self.owner[out.request_id]
        for conn, outs in by_conn.items():
            _send(conn, ("out", outs, None))
        self.core.release_finished()
        self._send_stats(_STATS_EVERY_S if self.core.has_unfinished_requests() else 0.0)

    def _send_stats(self, every_s: float = 1.0) -> None:
        """A stats snapshot to every API server, unless one went less than `every_s` seconds ago."""
        now = time.monotonic()
        if now - self.last_stats >= every_s:
            self.last_stats = now
            stats = self.core.stats()
            for conn in self.conns:
                _send(conn, ("out", [], stats))


def _read_pipes(conns: list[Connection], inbox: queue.SimpleQueue) -> None:
    """The core's input thread: it takes commands off the pipes while the main thread steps (CUDA launches and
    waits let it run), so an API server sending a burst of requests never finds its pipe full and blocks its
    event loop, and a whole burst is there for the next step to schedule. (conn, None) means the pipe ended."""
    while conns:
        for conn in wait(conns):
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None or message[0] in ("detach", "stop"):
                conns.remove(conn)  # before the main thread closes it
            inbox.put((conn, message))


def _by_conn(owner: dict[str, Connection]) -> dict[Connection, list[str]]:
    grouped: dict[Connection, list[str]] = {}
    for rid, conn in owner.items():
        grouped.setdefault(conn, []).append(rid)
    return grouped
