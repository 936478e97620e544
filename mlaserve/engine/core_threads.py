"""On CPU, the engine core's intra-op threads: as many as the cores this process may use and finds free.

A model thread that shares its core with anything else makes every parallel region wait for it, so the core runs
one thread fewer per core's worth of other work rather than one per core:
- the cores it may run on (its affinity), and no more than the cgroup's CPU quota (host_cpus.py): a container
  given two CPUs on a large host otherwise ran a thread per host core, each getting a slice of the quota;
- the API servers' load: with every core running a model thread, the API servers (HTTP, detokenization, streams)
  preempted those threads, and on 2 cores a tiny model served at about half its offline speed. Leaving a core to
  them for good costs a model whose step is long, and whose API servers are nearly idle, a third of its speed
  instead. So each API server reports how busy it is (CPU seconds over wall seconds, a few times a second);
- other processes' load on those cores (measured from /proc/stat, host_cpus.OtherLoad): one busy process beside
  the server made each token many times slower while the core kept a thread per core.
A core's worth of load takes a thread at once; the thread comes back only once that load has stayed clearly lower
for a few seconds: a pause between bursts of requests (when the threads would sit idle anyway) then does not cost
the next burst its first half second. The decision itself is `thread_count`, a pure function of those inputs.

MLASERVE_CPU_THREADS=N fixes the count at N (nothing is measured); OMP_NUM_THREADS, when set, is the user's choice
and stays.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from mlaserve.engine.host_cpus import OtherLoad, cgroup_cpu_quota
from mlaserve.parallel.group import available_cores

logger = logging.getLogger(__name__)

LOAD_REPORT_EVERY_S = 0.2  # how often an API server reports its load while the core sends it anything
THREADS_ENV = "MLASERVE_CPU_THREADS"
_IGNORED_LOAD = 0.25  # load below this (in cores) takes no thread from the model
_SHRINK_SLACK = 0.75  # a reserved core is given back only once the load is this far below the reservation,
_SHRINK_AFTER_S = 5.0  # and has stayed there this long
_OTHER_LOAD_EVERY_S = 1.0  # other processes' load is measured over windows this long (finer is tick noise)


def thread_count(
    model_threads: int, affinity: int, quota: float | None, other_cores: int, api_cores: int
) -> int:
    """The engine core's thread count: the cores it may run on (`affinity`, no more than a CPU `quota` in cores,
    which the API servers share), less the cores other processes (`other_cores`) and the API servers
    (`api_cores`) keep busy; at least one, and no more than the model was given (`model_threads`)."""
    usable = affinity - other_cores
    if quota is not None:
        usable = min(usable, math.floor(quota + 1e-6))
    return max(1, min(model_threads, usable - api_cores))


def threads_override(environ: dict | None = None) -> int | None:
    """MLASERVE_CPU_THREADS as a count, None when unset; a value that is not a positive integer is an error."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
    return int(value)


@dataclass
class Reservation:
    """Whole cores held back for a load: more at once, fewer only after the load stayed lower for a while."""

    cores: int = 0
    low_since: float | None = None  # when the load fell clearly below the reservation

    def update(self, load: float, now: float) -> int:
        wanted = max(0, math.ceil(load - _IGNORED_LOAD))
        if wanted > self.cores:
            self.cores, self.low_since = wanted, None
        elif load >= self.cores - _SHRINK_SLACK:
            self.low_since = None
        elif self.low_since is None:
            self.low_since = now
        elif now - self.low_since >= _SHRINK_AFTER_S:
            self.cores, self.low_since = wanted, None
        return self.cores


class CoreThreads:
    def __init__(
        self, device: str, clock: Callable[[], float] = time.monotonic, measure_host: bool = True
    ) -> None:
        """`measure_host`: read the cgroup quota and measure other processes' load (tests set those inputs)."""
        on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
        user_omp = "OMP_NUM_THREADS" in os.environ
        fixed = threads_override() if on_cpu and not user_omp else None
        self.enabled = on_cpu and not user_omp and fixed is None
        if fixed is not None:
            logger.info("engine core: %d CPU thread(s), as %s says", fixed, THREADS_ENV)
            torch.set_num_threads(fixed)
        self.full = torch.get_num_threads()
        self.cores = available_cores()
        host = self.enabled and measure_host
        self.quota: float | None = cgroup_cpu_quota() if host else None
        self.other_load: OtherLoad | None = None
        if host and hasattr(os, "sched_getaffinity"):
            self.other_load = OtherLoad(os.sched_getaffinity(0), clock=clock)
        self.loads: dict[Hashable, float] = {}
        self.clock = clock
        self.api = Reservation()
        self.others = Reservation()
        self.last_other = clock()
        self.other_now = 0.0  # other processes' load in the last window, in cores
        self._apply()

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
        now = self.clock()
        load = sum(self.loads.values())
        if self.other_load is not None and now - self.last_other >= _OTHER_LOAD_EVERY_S:
            self.last_other = now
            measured = self.other_load.sample(load)
            self.other_now = measured if measured is not None else 0.0
        api, others = self.api.update(load, now), self.others.update(self.other_now, now)
        threads = thread_count(self.full, self.cores, self.quota, others, api)
        if threads != torch.get_num_threads():
            logger.info(
                "engine core: %d CPU thread(s) (the API servers are busy %.2f cores' worth, other processes %.2f)",
                threads,
                load,
                self.other_now,
            )
            torch.set_num_threads(threads)
