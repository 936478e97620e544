"""The ranks' process group: NCCL for tensors on GPUs, gloo on CPU, and always a gloo group for host messages."""

from __future__ import annotations

import datetime
import socket

import torch

from mlaserve.parallel import ParallelContext

# A collective that waits this long has lost a rank (a dead worker is noticed sooner: executor/workers.py)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Each rank's device: rank r of a CUDA job takes cuda:r (of the GPUs this process sees)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))


def available_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def share_cpu_cores(local_ranks: int) -> int:
    """On CPU, each of a machine's `local_ranks` ranks takes its share of the cores for torch's threads: with every
    rank running a thread per core, their parallel regions preempted one another (tensor parallelism on a few cores ran
    several times slower than with one thread per rank). OMP_NUM_THREADS, when set, is the user's choice
    and stays. Returns the rank's thread count."""
    import os

    if "OMP_NUM_THREADS" not in os.environ and local_ranks > 1:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), available_cores() // local_ranks)))
    return torch.get_num_threads()


def init_parallel(
    rank: int, size: int, init_method: str, device: torch.device, expert_parallel: bool
) -> ParallelContext:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **options
    )
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else world
    return ParallelContext(rank, size, world, cpu_group, expert_parallel)


def broadcast_object(ctx: ParallelContext, obj: object = None) -> object:
    """Rank 0's obj on every rank (over the gloo group: a host-side message)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
    return box[0]


def min_over_ranks(ctx: ParallelContext, value: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.cpu_group)
    return int(t.item())


def leave(ctx: ParallelContext) -> None:
    """Every rank, after the stop: wait until all have it, then leave the group. Without the barrier a rank could
    tear its group down while another still talks to it, and the process aborts at exit."""
    import torch.distributed as dist

    dist.barrier(group=ctx.cpu_group)
    destroy()


def destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank() -> None:
    """A rank past 0 whose engine has stopped: end the process without the interpreter's teardown, where the
    process group's C++ threads can abort it."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
