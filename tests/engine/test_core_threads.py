"""The engine core on CPU leaves one core per API server to the HTTP processes (unless OMP_NUM_THREADS says)."""

from __future__ import annotations

import os
import subprocess
import sys

_PROBE = """
import os, torch
from mlaserve.engine.core_process import _leave_cores_for_api_servers
before = torch.get_num_threads()
_leave_cores_for_api_servers("cpu", 1)
print(before, torch.get_num_threads(), len(os.sched_getaffinity(0)))
"""


def _probe(env: dict[str, str]) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    before, after, cores = (int(v) for v in out.stdout.split())
    return before, after, cores


def test_cpu_core_leaves_a_core_per_api_server():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    before, after, cores = _probe(env)
    assert after == max(1, min(before, cores - 1))


def test_omp_num_threads_is_kept():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    before, after, _ = _probe(env)
    assert before == after == 2
