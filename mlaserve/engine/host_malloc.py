"""glibc malloc settings for the engine core's process, so that tensors of ever-changing sizes do not grow it.

Every step allocates host tensors whose sizes follow the batch: a new prompt length is a new size. glibc serves
an allocation past its mmap threshold with a mapping of its own, returned to the system when freed, but each such
free raises the threshold to that size (up to 32 MiB), so later tensors of up to that size come from the heap
instead; freed there in a different order than they were allocated, they leave holes the heap can only hand out
again for requests that fit them. With prompts of many lengths the holes add up: the core's resident memory
creeps for thousands of requests. A trim when the core goes idle returns the heaps' free pages. The threshold is
left to glibc: fixed low, every large CPU tensor would be a fresh mapping whose pages fault in on each step.
Each thread that allocates may get its own heap (an arena); the core has a few threads, and capping arenas keeps
one heap per thread from holding its own free pages.

MLASERVE_MALLOC_TUNING=0 leaves malloc as it is (to compare, or where another allocator is preloaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h
MAX_ARENAS = 4
# An idle core trims at most this often: a trim walks every heap, which costs milliseconds on a large one.
TRIM_EVERY_S = 5.0


class HostMalloc:
    """Tunes glibc's malloc in this process (once, at start-up) and trims its heaps when asked, at most every
    TRIM_EVERY_S; does nothing where the C library is not glibc or MLASERVE_MALLOC_TUNING=0."""

    def __init__(self) -> None:
        self._libc = _glibc() if os.environ.get("MLASERVE_MALLOC_TUNING", "1") != "0" else None
        self._last_trim = 0.0
        if self._libc is not None:
            if not self._libc.mallopt(_M_ARENA_MAX, MAX_ARENAS):
                logger.warning("glibc refused the malloc settings; host memory may creep with varied prompts")

    @property
    def active(self) -> bool:
        return self._libc is not None

    def trim_when_idle(self) -> bool:
        """Give the heaps' free pages back to the system, unless a trim ran in the last TRIM_EVERY_S; True if
        it trimmed."""
        now = time.monotonic()
        if self._libc is None or now - self._last_trim < TRIM_EVERY_S:
            return False
        self._last_trim = now
        self._libc.malloc_trim(0)
        return True


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl, macOS do not)
    except (OSError, AttributeError):
        return None
    return libc
