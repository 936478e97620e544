"""A tensor-parallel rank past 0 (`python -m mlaserve.executor.worker`, started by executor/workers.py): it builds
the same executor on its slice of the weights, then runs each step's forward as rank 0 sends it. It holds no
engine: rank 0's scheduler decides every step."""

from __future__ import annotations

import base64
import logging
import os
import pickle
import signal
import threading
import time

from mlaserve.executor.workers import ENV
from mlaserve.parallel.group import exit_rank


def _exit_with_parent(parent: int) -> None:
    """The engine core is gone (killed, crashed): so is this rank, rather than an orphan holding a GPU."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def main() -> None:
    rank, size, init_method, config, parent = pickle.loads(base64.b64decode(os.environ.pop(ENV)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the engine stops
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    from mlaserve.executor.executor import Executor

    executor = Executor(config, tp_rank=rank, init_method=init_method)
    try:
        executor.serve_plans()
    except RuntimeError as error:  # rank 0 went away mid-collective: its own log says why
        logging.getLogger(__name__).warning("rank %d: leaving, rank 0 is gone (%s)", rank, str(error)[:200])
        raise SystemExit(1) from None
    exit_rank()


if __name__ == "__main__":
    main()
