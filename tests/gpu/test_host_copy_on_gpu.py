"""On a GPU (skipped in CI): host_copy's copies leave the host free while the device is busy, where torch's plain
copy waits for the queue (the premise of building a step while the one before it runs)."""

import time

import pytest
import torch

from mlaserve.host_copy import copy_queued, queued_tensor, queued_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUSY_CYCLES = 2_000_000_000  # about a second of the device's clock


def busy_then(copy) -> float:
    """Seconds the host spends in `copy` while the device runs a long kernel queued before it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    start = time.perf_counter()
    copy()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return spent


def test_queued_copies_do_not_wait_for_the_device() -> None:
    device = torch.device("cuda")
    out = {}

    def queued() -> None:
        out["ids"] = queued_values(list(range(8192)), torch.long, device)
        out["tables"] = queued_tensor(torch.arange(64, dtype=torch.int32).view(8, 8), device)
        out["static"] = torch.zeros(16, 8, dtype=torch.long, device=device)
        copy_queued(out["static"][:4, :3], torch.ones(4, 3, dtype=torch.long))

    plain = busy_then(lambda: torch.tensor(list(range(8192)), device=device))
    fast = busy_then(queued)
    assert plain > 0.3, "torch's plain copy no longer waits for the queue: host_copy may be unneeded"
    assert fast < 0.1, fast
    assert out["ids"].tolist() == list(range(8192)) and out["tables"].dtype == torch.int32
    assert int(out["tables"].sum()) == 2016 and int(out["static"].sum()) == 12
