"""`serve()`: start the engine core in its own process (and any extra API-server processes), log the start-up
report, then serve HTTP until drained (http_loop.py) and return the exit status.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import socket

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.core_client import CoreProcessClient
from mlaserve.engine.heap import freeze_start_up_objects
from mlaserve.server.api_servers import ApiServers, catch_early_signals, share_metrics_across_processes
from mlaserve.server.app import build_app
from mlaserve.server.connections import (
    listening_socket,
    listening_sockets,
)
from mlaserve.server.http_loop import run_event_loop, serve_app
from mlaserve.server.report import describe_core, format_report
from mlaserve.server.shared_count import ServerCounts

logger = logging.getLogger("mlaserve.server")

# What these modules log at INFO while the engine is built (the attention backend, the weights loaded, the KV
# cache) is what the start-up report says again, in an operator's order: serve() builds the engine with them quiet.
_REPORTED_BY_THE_ENGINE = (
    "mlaserve.attention.selector",
    "mlaserve.engine.core",
    "mlaserve.executor",
)


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


def _with_bound_ports(settings: ServerSettings, sockets: list[socket.socket]) -> ServerSettings:
    from dataclasses import replace

    port = sockets[0].getsockname()[1]
    metrics_port = sockets[1].getsockname()[1] if len(sockets) > 1 else None
    return replace(settings, port=port, metrics_port=metrics_port)
