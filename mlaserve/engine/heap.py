"""Keeping Python's cyclic collector off the objects that live as long as the engine.

A full collection walks every tracked object. After importing torch and transformers and building a model that is
some 400,000 objects, and one walk took 260 ms on the CI machine: inside a generate call it lands in the middle of a
step. Frozen objects are out of the collector's sight, so its collections only walk what the run itself creates.
"""

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_start_up_objects() -> None:
    """For a process that lives for its engine (an API server, the engine core): what start-up built stays frozen
    for good (vLLM does the same)."""
    gc.collect()
    gc.freeze()


@contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    """For a run inside the caller's process (LLM.generate): the objects that exist now are frozen for the run and
    given back to the collector after it, so cycles the caller drops later are still collected. When something
    froze objects already (the caller, or a server in this process), it is left alone."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
