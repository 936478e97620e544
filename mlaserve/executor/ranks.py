"""The tensor-parallel ranks of an executor: rank 0 starts the others (unless a launcher did), every rank joins the
process group on its own device, and rank 0 stops them when its executor goes."""

from __future__ import annotations

import logging
import os
import weakref

import torch

from mlaserve.config.engine_config import EngineConfig
from mlaserve.executor.workers import WorkerDied, Workers
from mlaserve.parallel import SINGLE, ParallelContext

logger = logging.getLogger(__name__)


def launched_rank(size: int) -> int:
    """This process's rank, from the launcher's environment (torchrun sets RANK and WORLD_SIZE)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise ValueError(
            "distributed_executor_backend='external_launcher' runs under torchrun (or a launcher that sets RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT); they are not set"
        ) from None
    if world != size:
        raise ValueError(
            f"tensor_parallel_size={size}, but the launcher started {world} processes (WORLD_SIZE)"
        )
    return rank


def stop_ranks(workers: Workers | None, parallel: ParallelContext) -> None:
    """Send the other ranks the stop, wait for them (killing any of ours that hang) and leave the process group.
    workers: None when a launcher (torchrun) started the ranks."""
    from mlaserve.parallel.group import broadcast_object, destroy, leave

    if workers is None or workers.dead is None:
        try:
            broadcast_object(parallel, None)
            leave(parallel)
        except Exception:  # noqa: BLE001 - a rank already gone; stop() kills the rest
            logger.warning("tensor-parallel ranks did not take the stop; killing them")
    if workers is not None:
        workers.stop()
    destroy()


class Ranks:
    """This process's place among the ranks (one process alone until join()); rank 0 also holds the processes it
    started, so a failed step can ask whether one of them died."""

    def __init__(self) -> None:
        self.parallel: ParallelContext = SINGLE
        self.workers: Workers | None = None
        self._stop: weakref.finalize | None = None

    @property
    def pids(self) -> list[int]:
        """The processes of the ranks past 0, when this one started them (not under a launcher)."""
        return list(self.workers.pids) if self.workers is not None else []

    def join(
        self,
        owner: object,
        config: EngineConfig,
        device: torch.device,
        tp_rank: int,
        init_method: str | None,
        external: bool,
    ) -> torch.device:
        """Start the other ranks (rank 0, unless a launcher did) and join the group; returns this rank's device.
        The ranks stop when `owner` is collected, or at exit, whichever comes first."""
        from mlaserve.parallel.group import free_init_method, init_parallel, rank_device, share_cpu_cores

        size, expert_parallel = config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel
        local_rank = int(os.environ.get("LOCAL_RANK", tp_rank)) if external else tp_rank
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if device.type == "cuda" and not external and size > gpus:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; this process sees {gpus}")
        if device.type == "cuda" and local_rank >= gpus:
            raise ValueError(
                f"tensor_parallel_size={size} needs a GPU per rank; rank {tp_rank} is local rank {local_rank} and "
                f"this process sees {torch.cuda.device_count()} GPU(s)"
            )
        if tp_rank == 0 and not external:
            init_method = free_init_method()
            self.workers = Workers(config, init_method)
        device = rank_device(device, local_rank)
        if device.type == "cpu":  # the ranks of one machine share its cores (torchrun says how many)
            share_cpu_cores(int(os.environ.get("LOCAL_WORLD_SIZE", size)) if external else size)
        self.parallel = init_parallel(tp_rank, size, init_method, device, expert_parallel)
        if tp_rank == 0:
            # without holding the owner alive
            self._stop = weakref.finalize(owner, stop_ranks, self.workers, self.parallel)
        logger.info(
            "tensor parallel: rank %d of %d on %s%s", tp_rank, size, device,
            ", experts split across ranks" if expert_parallel else "",
        )  # fmt: skip
        return device

    def check(self) -> None:
        """Raises WorkerDied once a rank this process started has exited."""
        if self.workers is not None:
            self.workers.check()

    def death(self, error: BaseException | None) -> str | None:
        """After a failure (a collective that raised): whether, and how, a rank died. A RuntimeError is what a
        collective raises when a peer's socket closes, possibly before its exit code is readable: wait a little."""
        if self.workers is None:
            return None
        return self.workers.wait_for_death(1.0 if isinstance(error, RuntimeError) else 0.0)

    def start_up_failed(self, error: BaseException) -> WorkerDied | None:
        """Start-up raised: the ranks are stopped; a rank's own death (its traceback is in the log above) is
        returned to raise in the error's place."""
        dead = self.workers.wait_for_death(2.0) if self.workers is not None else None
        self.close()
        return WorkerDied(f"start-up failed: {dead}") if dead is not None else None

    def serve_plans(self, run_plan: object) -> None:
        """A rank past 0: run each step rank 0 sends, until it sends the stop (None)."""
        from mlaserve.parallel.group import broadcast_object, leave

        while (plan := broadcast_object(self.parallel)) is not None:
            run_plan(plan)
        leave(self.parallel)

    def close(self) -> None:
        """Rank 0: stop the other ranks and leave the process group; idempotent (also run when the owner is
        collected, or at exit)."""
        if self._stop is not None:
            self._stop()
        elif self.workers is not None:  # the process group never formed
            self.workers.stop(timeout=0)
