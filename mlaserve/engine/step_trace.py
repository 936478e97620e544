"""An opt-in timing trace of each step's way from the engine core to the HTTP client.

With MLASERVE_STEP_TRACE=DIR every process (engine core, API servers, and benchmarks/serving.py's clients) appends
one line per event to DIR/trace-<pid>.txt: `perf_counter seconds, event, fields`. Processes on one machine share
that clock (CLOCK_MONOTONIC), so a core's send, an API server's receipt and writes and a client's arrival line up;
benchmarks/step_trace.py reads them. Unset (the default), each call is one global lookup.

Events: core_step_start; core_collected (the step's tokens are on the host); core_step_end (outputs, finished);
core_sent; api_recv and api_deliver (outputs, finished); api_written (1 for a stream's finishing event);
client_final (the client's stamps of a stream's last and previous token).
"""

from __future__ import annotations

import os
import time
from typing import TextIO

ENV = "MLASERVE_STEP_TRACE"
_dir = os.environ.get(ENV) or None
_file: TextIO | None = None


def trace(event: str, *fields: object) -> None:
    global _file
    if _dir is None:
        return
    if _file is None:
        # Line-buffered: a process ended by a signal (an API server, the core) keeps what it wrote.
        _file = open(os.path.join(_dir, f"trace-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
    _file.write(" ".join(map(str, (time.perf_counter(), event, *fields))) + "\n")
