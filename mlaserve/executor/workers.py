"""Ranks 1..N-1 of a tensor-parallel engine: child processes of the engine core (rank 0), watched for death.

Started with subprocess, not multiprocessing: the engine core may itself be a daemonic multiprocessing child (the
server's), which multiprocessing forbids to have children. A worker that exits while the engine runs ends the
engine: the core raises WorkerDied at its next step, and if it is stuck in a collective with the dead rank (NCCL
never notices) the watcher ends the whole process with a clear message after a short grace, so a server's health
goes 503 and it exits non-zero instead of hanging.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "MLASERVE_TP_WORKER"
_GRACE_S = (
    5.0  # how long the core may take to notice a dead worker itself before the watcher ends the process
)


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited while the engine ran: the engine cannot continue."""


class Workers:
    def __init__(self, config: object, init_method: str) -> None:
        """config: the engine's, pickled to each rank, which builds its own executor from it."""
        size = config.parallel.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        self.dead: str | None = None  # what went wrong, once a worker exited unexpectedly
        self.noticed = threading.Event()  # set by the core once it raised WorkerDied
        # the workers import this same mlaserve, wherever it came from (installed, PYTHONPATH or a sys.path entry)
        source = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
        for rank in range(1, size):
            payload = base64.b64encode(pickle.dumps((rank, size, init_method, config, os.getpid())))
            env = {**os.environ, ENV: payload.decode(), "PYTHONPATH": path}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "mlaserve.executor.worker"], env=env))
        threading.Thread(target=self._watch, name="mlaserve-tp-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_for_death(self, timeout: float) -> str | None:
        """After a failed collective: whether (and how) a worker died. A collective fails as soon as a peer's
        socket closes, possibly before its exit code is readable: this waits up to `timeout` for one."""
        deadline = time.monotonic() + timeout
        while self._poll() is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        self.noticed.set()
        return self.dead

    def _poll(self) -> str | None:
        """The first worker found exited, described (recorded once); None while every worker runs."""
        if self.dead is None:
            for rank, proc in enumerate(self.procs, start=1):
                if (code := proc.poll()) is not None:
                    self.dead = (
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}: "
                        "the engine cannot go on without it"
                    )
                    break
        return self.dead

    def check(self) -> None:
        """Raises WorkerDied once a worker has exited unexpectedly."""
        if self.dead is not None:
            self.noticed.set()
            raise WorkerDied(self.dead)

    def _watch(self) -> None:
        while not self.stopping:
            if self._poll() is not None and not self.stopping:
                logger.error(self.dead)
                if not self.noticed.wait(_GRACE_S):  # the core is stuck in a collective with that rank
                    print(f"mlaserve: {self.dead}; ending the engine process", file=sys.stderr, flush=True)
                    os._exit(1)
                self._kill()
                return
            time.sleep(0.2)

    def stop(self, timeout: float = 10.0) -> None:
        """Workers exit after the stop plan (the caller sends it); any still running after `timeout` is killed."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
