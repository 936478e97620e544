"""On CPU, the engine core's intra-op threads, shared with the API servers as their load asks.

With every core running a model thread, the API servers (HTTP, detokenization, streams) preempt those threads in
the middle of parallel regions, where every thread waits for the slowest: on 2 cores a tiny model served at about
half its offline speed. Leaving a core to the API servers for good costs a model whose step is long, and whose API
servers are nearly idle, a third of its speed instead. So each API server reports how busy it is (CPU seconds over
wall seconds, a few times a second) and the core gives up one thread per busy core's worth of that load at once.
It takes a thread back only once the load has stayed clearly lower for a few seconds: a pause between bursts of
requests (when the threads would sit idle anyway) then does not cost the next burst its first half second.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Hashable

import torch

from mlaserve.parallel.group import available_cores

logger = logging.getLogger(__name__)

LOAD_REPORT_EVERY_S = 0.2  # how often an API server reports its load while the core sends it anything
_IGNORED_LOAD = 0.25  # API-server load below this (in cores) takes no thread from the model
_SHRINK_SLACK = 0.75  # a reserved core is given back only once the load is this far below the reservation,
_SHRINK_AFTER_S = 5.0  # and has stayed there this long


class CoreThreads:
    def __init__(self, device: str, clock: Callable[[], float] = time.monotonic) -> None:
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        # OMP_NUM_THREADS, when set, is the user's choice and stays.
        self.enabled = on_cpu and "OMP_NUM_THREADS" not in os.environ
        self.full = torch.get_num_threads()
        self.cores = available_cores()
        self.reserved = 0
        self.loads: dict[Hashable, float] = {}
        self.clock = clock
        self.low_since: float | None = None  # when the load fell clearly below the reservation

    def report(self, source: Hashable, busy: float) -> None:
        """`source` (an API server) was busy `busy` cores' worth since its last report."""
        self.loads[source] = max(0.0, busy)
        self._apply()

    def forget(self, source: Hashable) -> None:
        self.loads.pop(source, None)
        self._apply()

    def _apply(self) -> None:
        if not self.enabled:
            return
        load = sum(self.loads.values())
        wanted = max(0, math.ceil(load - _IGNORED_LOAD))
        if wanted > self.reserved:
            self.reserved, self.low_since = wanted, None
        elif load >= self.reserved - _SHRINK_SLACK:
            self.low_since = None
        elif self.low_since is None:
            self.low_since = self.clock()
        elif self.clock() - self.low_since >= _SHRINK_AFTER_S:
            self.reserved, self.low_since = wanted, None
        threads = max(1, min(self.full, self.cores - self.reserved))
        if threads != torch.get_num_threads():
            logger.info(
                "engine core: %d CPU thread(s) (the API servers are busy %.2f cores' worth)", threads, load
            )
            torch.set_num_threads(threads)
