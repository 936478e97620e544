"""A library GEMM's one-time check per device: the first call on a device runs a small product against the
reference and remembers its verdict, so a path that fails there is never taken. Never during graph capture (the
check would be captured, not run): then "unchecked", and the next eager call asks again."""

from collections.abc import Callable

import torch


def checked_once(
    verdicts: dict[tuple[int, int], str],
    device: torch.device,
    group_n: int,
    run: Callable[[torch.device, int], str],
) -> str:
    """verdicts[(device index, group_n)], filled by run(device, group_n) the first time it is asked outside capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    known = verdicts.get((index, group_n))
    if known is not None:
        return known
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "unchecked"
    verdicts[(index, group_n)] = run(torch.device("cuda", index), group_n)
    return verdicts[(index, group_n)]
