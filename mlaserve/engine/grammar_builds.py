"""Requests that reach an engine core in its own process with a grammar still to build.

A grammar crosses the pipe as llguidance's serialized text (its matcher does not pickle), and building the matcher
again costs what compiling it cost the API server: up to the deadline of grammar_limits.py. The core's loop must
not wait for it, so the build runs on the grammar compiler's workers (llguidance releases the GIL while it
builds), and the request is added once its grammar is ready: the finished build comes back through the core's
inbox as a ("built", ...) command, applied between steps like any other.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from multiprocessing.connection import Connection

from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest
from mlaserve.sampling.structured_output import GrammarCompiler


def needs_build(prepared: PreparedRequest) -> bool:
    return prepared.grammar is not None and not prepared.grammar.ready


class GrammarBuilds:
    def __init__(self, inbox: queue.SimpleQueue) -> None:
        self._inbox = inbox
        self._owner: dict[str, Connection] = {}  # request id -> the pipe that added it, while its build runs
        self._futures: dict[int, Future] = {}  # one build per grammar object (an n > 1 request shares one)

    def start(
        self, compiler: GrammarCompiler, conn: Connection, request_id: str, prepared: PreparedRequest
    ) -> None:
        key = id(prepared.grammar)
        future = self._futures.get(key)
        if future is None:
            future = self._futures[key] = compiler.build_async(prepared.grammar)
        self._owner[request_id] = conn

        def done(f: Future) -> None:
            self._inbox.put((conn, ("built", request_id, prepared, f)))

        future.add_done_callback(done)

    def finish(self, request_id: str, prepared: PreparedRequest) -> bool:
        """The build of this request's grammar ended: True if the request is still wanted (not aborted)."""
        self._futures.pop(id(prepared.grammar), None)
        return self._owner.pop(request_id, None) is not None

    def abort(self, conn: Connection, request_ids: list[str] | None, finish_reason: str) -> list[CoreOutput]:
        """Aborted before their grammar was built: their final outputs (None: every one of `conn`'s)."""
        ids = [r for r, c in self._owner.items() if c is conn] if request_ids is None else request_ids
        gone = [r for r in ids if self._owner.get(r) is conn]
        for rid in gone:
            del self._owner[rid]
        return [CoreOutput(rid, [], finish_reason=finish_reason) for rid in gone]

    def forget(self, conn: Connection) -> None:
        """That API server left: its requests are not added when their builds end."""
        for rid in [r for r, c in self._owner.items() if c is conn]:
            del self._owner[rid]
