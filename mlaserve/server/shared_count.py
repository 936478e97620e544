"""A count with a ceiling that every API-server process takes from and gives back to: sequences in flight, open
connections. Each process used to enforce its own share of a limit, but the kernel does not spread connections
evenly, so a client got a 429 while the server as a whole was under its limit.

One class for one process and for several: across processes the number lives in shared memory behind a process
lock, both made before the API-server processes are spawned and handed to them with their arguments (a spawn
context's objects, since those processes are spawned); alone, a plain number behind a thread lock.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from typing import Any, Protocol

# Held for a few instructions at a time: a wait this long means a process died holding the lock, and the server
# goes down with that process anyway; an error then beats a hung event loop.
_LOCK_WAIT_S = 5.0


class _Lock(Protocol):
    def acquire(self, block: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...


@dataclass
class SharedCount:
    number: Any  # a ctypes c_int64, in shared memory when processes share it
    lock: _Lock = field(repr=False)

    @classmethod
    def in_process(cls) -> SharedCount:
        return cls(ctypes.c_int64(0), threading.Lock())

    @classmethod
    def across_processes(cls, ctx: SpawnContext) -> SharedCount:
        """To be passed to processes that `ctx` spawns (in their arguments: it cannot be pickled otherwise)."""
        return cls(ctx.RawValue(ctypes.c_int64, 0), ctx.Lock())

    @property
    def value(self) -> int:
        return self.number.value  # one aligned 8-byte read: no lock needed for a gauge

    def try_acquire(self, amount: int, limit: int) -> bool:
        """Add `amount` if the count stays within `limit`; False (and nothing added) otherwise."""
        self._lock()
        try:
            if self.number.value + amount > limit:
                return False
            self.number.value += amount
            return True
        finally:
            self.lock.release()

    def release(self, amount: int) -> None:
        """Give back what one try_acquire took; the caller makes sure it does so once."""
        self._lock()
        try:
            self.number.value -= amount
        finally:
            self.lock.release()

    def _lock(self) -> None:
        if not self.lock.acquire(True, _LOCK_WAIT_S):
            raise RuntimeError(f"a shared count's lock was not free within {_LOCK_WAIT_S:g} s")


@dataclass(frozen=True)
class ServerCounts:
    """What every API-server process of one server counts together."""

    sequences: SharedCount  # admitted and not yet answered (a request counts prompts x n)
    connections: SharedCount  # open client connections, all ports

    @classmethod
    def for_processes(cls, api_server_count: int) -> ServerCounts:
        if api_server_count == 1:
            return cls(SharedCount.in_process(), SharedCount.in_process())
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        return cls(SharedCount.across_processes(ctx), SharedCount.across_processes(ctx))
