"""`serve()`: start the engine core in its own process (and any extra API-server processes), log the start-up
report, run uvicorn, drain on SIGTERM.

Drain: health and new /v1 calls answer 503 at once, running requests get `shutdown_grace_s` to finish, the
rest are aborted (their clients get an error event or a 503), then the servers stop and serve() returns 0.
A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Coroutine, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn
from fastapi import FastAPI

from mlaserve.engine.core_client import CoreClient, CoreProcessClient
from mlaserve.engine.heap import freeze_start_up_objects
from mlaserve.server.api_servers import ApiServers, catch_early_signals, share_metrics_across_processes
from mlaserve.server.app import build_app, build_ops_app
from mlaserve.server.connections import (
    ConnectionLimits,
    connection_cap,
    listening_socket,
    listening_sockets,
    quiet_accept_errors,
    uvicorn_config,
)
from mlaserve.server.report import describe_core, format_report
from mlaserve.server.settings import ServerSettings
from mlaserve.server.shared_count import ServerCounts
from mlaserve.server.state import ServerState

logger = logging.getLogger("mlaserve.server")

# After the drain, uvicorn gets this long to flush the last responses and close connections.
_CLOSE_TIMEOUT_S = 5
# What these modules log at INFO while the engine is built (the attention backend, the weights loaded, the KV
# cache) is what the start-up report says again, in an operator's order: serve() builds the engine with them quiet.
_REPORTED_BY_THE_ENGINE = (
    "mlaserve.attention.selector",
    "mlaserve.loader.model_loader",
    "mlaserve.engine.core",
)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: serve() owns SIGTERM/SIGINT (uvicorn would re-raise them
    after shutting down, which turns a clean drain into exit status -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(engine_options: dict, settings: ServerSettings) -> int:
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    early = catch_early_signals(signals)
    try:
        return _serve(engine_options, settings, early)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(engine_options: dict, settings: ServerSettings, early: list[int]) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        listeners = listening_sockets(settings.host, settings.port, settings.api_server_count)
        sockets = listeners[:1]
        if settings.metrics_port is not None:
            sockets.append(listening_socket(settings.host, settings.metrics_port))
    except OSError as e:
        logger.error("cannot listen: %s", e)
        return 1
    # Port 0 (tests) asks the OS for a free port: report the one we got.
    settings = _with_bound_ports(settings, sockets)
    metrics_dir = share_metrics_across_processes() if settings.api_server_count > 1 else None
    try:
        return _run_processes(engine_options, settings, sockets, listeners[1:], early)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _run_processes(
    engine_options: dict,
    settings: ServerSettings,
    sockets: list[socket.socket],
    listeners: list[socket.socket],
    early: list[int],
) -> int:
    """Start the engine core and the extra API-server processes (one of `listeners` each), serve until drained,
    then stop them all."""
    describe = functools.partial(describe_core, settings=settings)
    engine = CoreProcessClient(
        engine_options, describe, quiet=_REPORTED_BY_THE_ENGINE, api_servers=settings.api_server_count
    )
    app, workers, code = None, None, 1
    counts = ServerCounts.for_processes(settings.api_server_count)  # before the processes that share it
    try:
        workers = ApiServers(engine.extra_pipes, engine_options, settings, listeners, counts)
        try:
            workers.wait_attached(timeout_s=600)
        except RuntimeError as error:  # an API-server process that could not start
            logger.error("%s", error)
            return 1
        # Each extra process has its socket now: a copy left open here would keep its queue after the process.
        for listener in listeners:
            if listener is not sockets[0]:
                listener.close()
        pids = [os.getpid()] + [w.pid for w in workers.processes]
        report = {
            **engine.startup_report,
            "processes": {"engine_core": engine.process.pid, "api_servers": pids},
        }
        for line in format_report(report):
            logger.info(line)
        app = build_app(engine, settings, report, counts)
        freeze_start_up_objects()
        workers.start_serving(report)
        code = run_event_loop(serve_app(app, engine, settings, sockets, workers.processes, early=early))
    finally:
        if app is not None:
            app.state.server.intake.shutdown()
        if workers is not None and not workers.stop(settings.shutdown_grace_s + 10):
            code = 1
        engine.shutdown()
    return code


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """uvloop's event loop where it is installed, else asyncio's: every streamed event is a few callbacks and a
    socket write on this one loop, and uvloop's are in C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _with_bound_ports(settings: ServerSettings, sockets: list[socket.socket]) -> ServerSettings:
    from dataclasses import replace

    port = sockets[0].getsockname()[1]
    metrics_port = sockets[1].getsockname()[1] if len(sockets) > 1 else None
    return replace(settings, port=port, metrics_port=metrics_port)


async def serve_app(
    app: FastAPI,
    engine: CoreClient,
    settings: ServerSettings,
    sockets: list[socket.socket],
    workers: Sequence[BaseProcess] = (),
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
    early: Sequence[int] = (),
) -> int:
    """Serve `app` (and the ops app on sockets[1]) until drained; `workers` are the extra API-server processes the
    first one watches and passes its signals to."""
    apps = [app] + ([build_ops_app(app)] if len(sockets) > 1 else [])
    # One cap for all listeners and all API-server processes: the count is the server's.
    cap = connection_cap(settings.max_connections)
    limits = ConnectionLimits(settings.header_timeout_s, cap, app.state.server.counts.connections)
    app.state.server.connection_limits = limits
    servers = [
        _Server(
            uvicorn_config(a, settings, limits, timeout_graceful_shutdown=_CLOSE_TIMEOUT_S, log_config=None)
        )
        for a in apps
    ]
    drain = _Drain(app.state.server, engine, servers, settings.shutdown_grace_s, workers)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_accept_errors())
    engine.on_death = lambda: loop.call_soon_threadsafe(drain.engine_died)
    if not engine.is_alive:  # it died before the callback was set
        drain.engine_died()
    for sig in signals:
        loop.add_signal_handler(sig, drain.begin, sig)
    for sig in early:  # what arrived during start-up
        drain.begin(sig)
    watch = loop.create_task(drain.watch_workers()) if workers else None
    try:
        await asyncio.gather(*(s.serve(sockets=[sock]) for s, sock in zip(servers, sockets)))
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if watch is not None:
            watch.cancel()
    if not all(s.started for s in servers):
        logger.error("the HTTP server did not start")
        return 1
    if drain.failed:
        logger.critical("server stopped: %s", drain.failed)
        return 1
    logger.info("server stopped")
    return 0


class _Drain:
    def __init__(
        self,
        state: ServerState,
        engine: CoreClient,
        servers: list[_Server],
        grace_s: float,
        workers: Sequence[BaseProcess] = (),
    ) -> None:
        self.state, self.engine, self.servers, self.grace_s = state, engine, servers, grace_s
        self.workers = workers
        self.task: asyncio.Task | None = None
        self.failed: str | None = None  # why the server stops with a non-zero exit

    def engine_died(self) -> None:
        """The core process is gone: requests in flight already failed (503); stop serving, exit non-zero."""
        self.failed = "the engine core process died"
        self.state.draining = True
        self._stop_servers()

    async def watch_workers(self) -> None:
        """An API-server process that exits on its own (not drained by us) takes the server down: an operator's
        supervisor restarts the whole unit rather than run on with part of its HTTP capacity."""
        while True:
            await asyncio.sleep(0.25)
            if self.task is not None:
                return  # draining: the workers exit because they were told to
            for index, worker in enumerate(self.workers, start=1):
                if worker.exitcode is not None:
                    self.failed = f"API server {index} (pid {worker.pid}) exited with code {worker.exitcode}"
                    self.state.draining = True
                    self._stop_servers()
                    return

    def begin(self, sig: int) -> None:
        for worker in self.workers:  # each API server drains its own requests
            if worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)
        if self.task is not None:  # a second signal: stop waiting
            logger.warning(
                "%s again: aborting %d request(s) now", signal.Signals(sig).name, self.state.in_flight
            )
            self.engine.abort_all()
            self._stop_servers()
            return
        logger.info(
            "%s: draining; %d request(s) in flight get up to %gs to finish",
            signal.Signals(sig).name,
            self.state.in_flight,
            self.grace_s,
        )
        self.state.draining = True
        self.task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("grace period over: aborting %d request(s)", self.state.in_flight)
            self.engine.abort_all()
            # Let the aborted handlers send their error and close (bounded: a stuck client cannot hold us).
            until = time.monotonic() + 2.0
            while self.state.in_flight and time.monotonic() < until:
                await asyncio.sleep(0.02)
        # The other API servers drain their own requests under the same deadline; until they are done this one
        # keeps answering (health 503, new requests 503) on the ports they share and on the ops port.
        until = deadline + 3.0
        while any(w.exitcode is None for w in self.workers) and time.monotonic() < until:
            await asyncio.sleep(0.05)
        self._stop_servers()

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.should_exit = True
