"""What the host leaves this process of its CPUs: the cgroup's CPU quota, and how busy other processes keep the
cores it may run on. Readers only; core_threads.py decides what to do with them.

Paths are arguments so that tests read files they wrote; every reader returns None (no figure) where the platform
does not have the file, and the decision then goes without that input.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_SELF_CGROUP = Path("/proc/self/cgroup")
_PROC_STAT = Path("/proc/stat")
# The fields of a /proc/stat cpu line that are processes' work: user, nice, system. Idle and iowait are free time;
# interrupts are mostly the server's own network traffic, which no process is charged for, and would read as a
# busy neighbour under a heavy stream load.
_PROCESS_FIELDS = 3


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = _SELF_CGROUP) -> float | None:
    """The CPU quota, in cores, of this process's cgroup and of every cgroup above it (the smallest binds); None
    when there is none. cgroup v2 writes `cpu.max` ("max 100000" or "<quota> <period>"); v1 writes
    cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us in the cpu controller's folder."""
    v2, v1 = _own_cgroups(self_cgroup)
    quotas = []
    for folder in _folders_up(root, v2):
        quotas.append(_v2_quota(folder / "cpu.max"))
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for folder in _folders_up(root / controller, v1):
            quotas.append(_v1_quota(folder))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _own_cgroups(self_cgroup: Path) -> tuple[str, str]:
    """This process's cgroup paths: the unified (v2) one, and the v1 cpu controller's ("/" when not listed)."""
    v2 = v1 = "/"
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _folders_up(root: Path, cgroup: str) -> Iterable[Path]:
    """`root`/`cgroup` and each folder above it up to `root`: inside a container the path often names a cgroup
    that only the host's mount has, so the root's file is read as well."""
    folder = root / cgroup.strip("/")
    while True:
        yield folder
        if folder == root or root not in folder.parents:
            return
        folder = folder.parent


def _v2_quota(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cpu_busy_seconds(cpus: Iterable[int], stat: Path = _PROC_STAT) -> float | None:
    """Seconds the given CPUs have spent working since boot, by every process (None without /proc/stat)."""
    wanted = {f"cpu{c}" for c in cpus}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            busy += sum(int(v) for v in fields[1 : 1 + _PROCESS_FIELDS])
    return busy / tick


class OtherLoad:
    """How many cores' worth of work other processes did on this process's CPUs since the last sample: the CPUs'
    busy time less this process's own CPU time and what its API servers reported. Measured, not the load average:
    that average trails a busy process that starts or stops by about a minute, and counts this process's threads."""

    def __init__(
        self,
        cpus: Iterable[int],
        busy: Callable[[], float | None] | None = None,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cpu_list = sorted(cpus)
        self.busy = busy if busy is not None else lambda: cpu_busy_seconds(cpu_list)
        self.own, self.clock = own, clock
        self.last = self._read()

    def _read(self) -> tuple[float, float | None, float]:
        return self.clock(), self.busy(), self.own()

    def sample(self, api_cores: float) -> float | None:
        """Other processes' cores since the last sample, given that the API servers were busy `api_cores`; None
        without /proc/stat."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self.last, now
        self.last = now
        if busy0 is None or busy1 is None or t1 <= t0:
            return None
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0) - api_cores)
