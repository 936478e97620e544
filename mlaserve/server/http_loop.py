"""One API-server process's HTTP loop: uvicorn serving the app (and the ops app) on given sockets until drained.

Drain: health and new /v1 calls answer 503 at once, running requests get `shutdown_grace_s` to finish, the
rest are aborted (their clients get an error event or a 503), then the servers stop. A second signal skips the
wait. run.py starts the first API server's loop; api_servers.py starts the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn
from fastapi import FastAPI

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.core_client import CoreClient
from mlaserve.server.app import build_ops_app
from mlaserve.server.connections import port_limits, quiet_accept_errors, uvicorn_config
from mlaserve.server.state import ServerState

logger = logging.getLogger("mlaserve.server")

# After the drain, uvicorn gets this long to flush the last responses and close connections.
_CLOSE_TIMEOUT_S = 5


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: serve() owns SIGTERM/SIGINT (uvicorn would re-raise them
    after shutting down, which turns a clean drain into exit status -15)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """uvloop's event loop where it is installed, else asyncio's: every streamed event is a few callbacks and a
    socket write on this one loop, and uvloop's are in C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


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
    # The API port's cap is the server's (all API-server processes); the ops port has its own budget.
    state = app.state.server
    limits = port_limits(
        settings.header_timeout_s,
        settings.max_connections,
        state.counts.connections,
        state.metrics.connection_closed,
    )
    app.state.server.connection_limits = limits["api"]
    servers = [
        _Server(uvicorn_config(a, settings, lim, timeout_graceful_shutdown=_CLOSE_TIMEOUT_S, log_config=None))
        for a, lim in zip(apps, (limits["api"], limits["ops"]))
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
