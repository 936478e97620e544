"""Host values onto the device, queued behind the work already there, without the host waiting for that work.

torch's plain host-to-device copy (`.to(device)`, `torch.tensor(values, device=...)`) synchronizes the stream
after it: the host waits until every kernel queued before the copy has run. A step scheduled ahead
(Scheduler.schedule_lookahead) builds its inputs while the step before it still runs, so each such copy would
hold the host there and undo the head start. These copy from pinned memory with non_blocking instead: torch's
pinned-memory allocator keeps each staging buffer until its copy has run.
"""

from __future__ import annotations

import torch


def queued_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (itself where `device` is the CPU)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def queued_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list of numbers as a tensor on `device`."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def copy_queued(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source) without the host waiting for the device's queue (a copy within one device never
    waits)."""
    if target.device.type == "cuda" and source.device.type == "cpu":
        source = source.pin_memory()
    target.copy_(source, non_blocking=True)
