"""More HTTP processes in front of one engine core (`api_server_count`, vLLM's --api-server-count).

One Python process parsing every request and framing every streamed token bounds what a server delivers once the
GPU's steps are short: at 256 streams and a few milliseconds a step that is tens of thousands of events a second.
Each extra API-server process accepts connections on the same port (a socket of its own where the OS spreads
connections over them, connections.listening_sockets), runs the same app over its own
pipe to the core (core_client.CoreClient), and tokenizes, detokenizes and streams for the requests it accepted.

The first process (the one an operator started) owns the core, the ops port and the signals: SIGTERM and SIGINT
reach it, it passes SIGTERM on, and every process drains its own requests. An API-server process that exits on its
own takes the server down (non-zero exit). Prometheus counters and histograms are kept in files shared by all of
them (prometheus_client's multiprocess mode), so any process answers /metrics for the whole server.

max_concurrent_requests and max_connections hold for the server as a whole, not per process: the kernel does not
spread connections evenly, and a per-process share refused clients while the server was under its limit. The
processes count sequences and connections together (shared_count.ServerCounts, made by the first process and
handed to the others as they are spawned). Slots a process held when it died are not given back, but its death
takes the server down.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.heap import freeze_start_up_objects
from mlaserve.server.shared_count import ServerCounts

logger = logging.getLogger("mlaserve.server")


def catch_early_signals(signals: tuple[signal.Signals, ...]) -> list[int]:
    """Record these signals from now until serve_app's loop handles them (start-up takes seconds, and a process
    manager may stop us meanwhile); serve_app then drains as if they had just arrived."""
    caught: list[int] = []
    for sig in signals:
        signal.signal(sig, lambda number, _frame: caught.append(number))
    return caught


def share_metrics_across_processes() -> str:
    """Put prometheus_client in multiprocess mode (its documented switch, read when a metric is built) for this
    process and every process it spawns from now on; returns the folder to remove at exit."""
    path = tempfile.mkdtemp(prefix="mlaserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    from prometheus_client import values

    values.ValueClass = values.get_value_class()
    return path


class ApiServers:
    """The extra API-server processes: one per extra pipe to the core, each serving its one of `listeners` (the
    main port; the ops port stays with the first process)."""

    def __init__(
        self,
        pipes: Sequence[Connection],
        engine_options: dict,
        settings: ServerSettings,
        listeners: Sequence[socket.socket],
        counts: ServerCounts,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        self.processes: list[BaseProcess] = []
        self._reports: list[Connection] = []  # "attached" from the worker, then the start-up report to it
        for index, (pipe, listener) in enumerate(zip(pipes, listeners, strict=True), start=1):
            mine, theirs = ctx.Pipe(duplex=True)
            worker = ctx.Process(
                target=api_server_main,
                args=(index, pipe, engine_options, settings, listener, level, theirs, counts),
                name=f"mlaserve-api-server-{index}",
            )
            worker.start()
            pipe.close()  # the worker has its own copies
            theirs.close()
            self.processes.append(worker)
            self._reports.append(mine)

    def wait_attached(self, timeout_s: float) -> None:
        """Until every process is attached to the core; raises RuntimeError naming one that exited or did not
        attach in time."""
        deadline = time.monotonic() + timeout_s
        for index, (worker, conn) in enumerate(zip(self.processes, self._reports), start=1):
            while not conn.poll(0.2):
                if worker.exitcode is not None:
                    raise RuntimeError(f"API server {index} exited during start-up (code {worker.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"API server {index} did not start within {timeout_s:g} s")
            conn.recv()

    def start_serving(self, report: dict) -> None:
        """Every process serves, with the first one's start-up report (the pids of all of them)."""
        for conn in self._reports:
            conn.send(report)
            conn.close()

    def stop(self, timeout_s: float) -> bool:
        """Tell the processes still running to drain, wait for them, kill the ones that do not end; True if every
        one ended cleanly (code 0, or the SIGTERM it was sent before it could drain)."""
        for conn in self._reports:  # a worker still waiting for its report sees the pipe end and exits
            conn.close()
        clean = True
        for worker in self.processes:
            if worker.exitcode is None:
                worker.terminate()  # SIGTERM: the worker drains
        for worker in self.processes:
            worker.join(timeout_s)
            if worker.exitcode is None:
                logger.error("%s did not stop within %g s; killing it", worker.name, timeout_s)
                worker.kill()
                worker.join(5)
            clean = clean and worker.exitcode in (0, -signal.SIGTERM)
            if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(worker.pid)
        return clean


def api_server_main(
    index: int,
    pipe: Connection,
    engine_options: dict,
    settings: ServerSettings,
    listener: socket.socket,
    log_level: int,
    report: Connection,
    counts: ServerCounts,
) -> None:
    """An extra API-server process: the first process's app over this process's pipe to the core."""
    # A terminal's Ctrl-C reaches the whole process group; the first process turns it into one SIGTERM each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    early = catch_early_signals((signal.SIGTERM,))
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[api-server-{index}]: %(message)s"
    )
    from mlaserve.engine.core_client import CoreClient
    from mlaserve.server.app import build_app
    from mlaserve.server.http_loop import run_event_loop, serve_app

    try:
        engine = CoreClient(pipe, engine_options)
    except (RuntimeError, ValueError) as error:
        logger.error("API server %d could not attach to the engine core: %s", index, error)
        sys.exit(1)
    report.send("attached")
    try:
        startup_report = report.recv()  # the first process's, naming every process
    except EOFError:  # the first process gave up before serving
        engine.shutdown()
        sys.exit(1)
    app = build_app(engine, replace(settings, api_server_index=index), startup_report, counts)
    freeze_start_up_objects()
    code = 1
    try:
        code = run_event_loop(
            serve_app(app, engine, settings, [listener], signals=(signal.SIGTERM,), early=early)
        )
    finally:
        app.state.server.intake.shutdown()
        engine.shutdown()
    sys.exit(code)
