"""Keeping Python's cyclic collector off the objects that live as long as the engine.

A full collection walks every tracked object. After importing torch and transformers and building a model that is
hundreds of thousands of objects, and one walk is long enough to notice: inside a generate call it lands in the
middle of a step. Frozen objects are out of the collector's sight, so its collections only walk what the run itself creates.
"""

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_frozen_for_good = False


def freeze_start_up_objects() -> None:
    """For a process that lives for its engine (an API server, the engine core): what start-up built stays frozen
    for good (vLLM does the same)."""
    global _frozen_for_good
    gc.collect()
    gc.freeze()
    if not _frozen_for_good:
        gc.callbacks.append(_SlowCollections())
    _frozen_for_good = True


class _SlowCollections:
    """Logs each full collection that takes longer than threshold_ms: in a serving process, one stalls every
    stream it touches (SGLang warns the same way), and the log says which process it was."""

    def __init__(self, threshold_ms: float = 10.0) -> None:
        self.threshold_ms, self.started = threshold_ms, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        if ms > self.threshold_ms:
            logger.warning(
                "a full garbage collection took %.0f ms (%d objects freed); frozen: %d",
                ms, info["collected"], gc.get_freeze_count(),
            )  # fmt: skip


@contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    """For a run inside the caller's process (LLM.generate): the objects that exist now are frozen for the run and
    given back to the collector after it, so cycles the caller drops later are still collected. Only a freeze for
    good (above) leaves it nothing to do: a nonzero freeze count is no sign, since a library may freeze a few
    objects of its own at import while the engine's objects stay in sight, and a full collection of them stalls
    a decode step. Python has one frozen generation, so the unfreeze also
    returns what others froze: those objects live on, only a full collection walks them again."""
    if _frozen_for_good:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
