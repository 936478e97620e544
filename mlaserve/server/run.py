"""`serve()`: start the engine core in its own process, log the start-up report, run uvicorn, drain on SIGTERM.

Drain: health and new /v1 calls answer 503 at once, running requests get `shutdown_grace_s` to finish, the
rest are aborted (their clients get an error event or a 503), then the servers stop and serve() returns 0.
A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from mlaserve.engine.core_process import CoreProcessClient
from mlaserve.server.app import build_app, build_ops_app
from mlaserve.server.connections import (
    ConnectionLimits,
    connection_cap,
    listening_socket,
    quiet_accept_errors,
    uvicorn_config,
)
from mlaserve.server.report import describe_core, format_report
from mlaserve.server.settings import ServerSettings
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
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sockets = [listening_socket(settings.host, settings.port)]
        if settings.metrics_port is not None:
            sockets.append(listening_socket(settings.host, settings.metrics_port))
    except OSError as e:
        logger.error("cannot listen: %s", e)
        return 1
    # Port 0 (tests) asks the OS for a free port: report the one we got.
    settings = _with_bound_ports(settings, sockets)
    describe = functools.partial(describe_core, settings=settings)
    engine = CoreProcessClient(engine_options, describe, quiet=_REPORTED_BY_THE_ENGINE)
    report = engine.startup_report
    for line in format_report(report):
        logger.info(line)
    app = build_app(engine, settings, report)
    try:
        return _run_event_loop(_serve(app, engine, settings, sockets))
    finally:
        app.state.server.intake.shutdown()
        engine.shutdown()


def _run_event_loop(main: Coroutine[Any, Any, int]) -> int:
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


async def _serve(
    app: FastAPI, engine: CoreProcessClient, settings: ServerSettings, sockets: list[socket.socket]
) -> int:
    apps = [app] + ([build_ops_app(app)] if len(sockets) > 1 else [])
    # One cap for all listeners: the descriptors are the process's.
    limits = ConnectionLimits(settings.header_timeout_s, connection_cap(settings.max_connections))
    app.state.server.connection_limits = limits
    servers = [
        _Server(
            uvicorn_config(a, settings, limits, timeout_graceful_shutdown=_CLOSE_TIMEOUT_S, log_config=None)
        )
        for a in apps
    ]
    drain = _Drain(app.state.server, engine, servers, settings.shutdown_grace_s)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_accept_errors())
    engine.on_death = lambda: loop.call_soon_threadsafe(drain.engine_died)
    if not engine.is_alive:  # it died before the callback was set
        drain.engine_died()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain.begin, sig)
    try:
        await asyncio.gather(*(s.serve(sockets=[sock]) for s, sock in zip(servers, sockets)))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if not all(s.started for s in servers):
        logger.error("the HTTP server did not start")
        return 1
    if drain.failed:
        logger.critical("server stopped: the engine core process died")
        return 1
    logger.info("server stopped")
    return 0


class _Drain:
    def __init__(
        self, state: ServerState, engine: CoreProcessClient, servers: list[_Server], grace_s: float
    ) -> None:
        self.state, self.engine, self.servers, self.grace_s = state, engine, servers, grace_s
        self.task: asyncio.Task | None = None
        self.failed = False

    def engine_died(self) -> None:
        """The core process is gone: requests in flight already failed (503); stop serving, exit non-zero."""
        self.failed = True
        self.state.draining = True
        self._stop_servers()

    def begin(self, sig: int) -> None:
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
        self._stop_servers()

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.should_exit = True
