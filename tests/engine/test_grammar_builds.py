"""A process core's grammar builds: a request waits off the loop for its grammar, is added once it is built, and
an abort or a departed API server before then leaves nothing to add (the aborted request still gets its final)."""

from __future__ import annotations

import queue
from concurrent.futures import Future

from mlaserve.engine.grammar_builds import GrammarBuilds, needs_build
from mlaserve.engine.intake import PreparedRequest
from mlaserve.sampling.structured_output import CompiledGrammar
from mlaserve.sampling_params import SamplingParams


class _Compiler:
    def __init__(self) -> None:
        self.futures: list[Future] = []

    def build_async(self, compiled: CompiledGrammar) -> Future:
        future: Future = Future()
        self.futures.append(future)
        return future


def _prepared(grammar: CompiledGrammar) -> PreparedRequest:
    return PreparedRequest("x", [1], SamplingParams(max_tokens=2), grammar)


def test_a_built_grammar_comes_back_through_the_inbox_once_per_grammar():
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    builds, compiler, conn = GrammarBuilds(inbox), _Compiler(), object()
    grammar = CompiledGrammar("choice", "text", "label")  # as unpickled: no matcher here
    first, second = _prepared(grammar), _prepared(grammar)
    assert needs_build(first)
    builds.start(compiler, conn, "r-0", first)
    builds.start(compiler, conn, "r-1", second)
    assert len(compiler.futures) == 1 and inbox.empty()  # one build for an n > 1 request's shared grammar
    compiler.futures[0].set_result(None)
    got = [inbox.get_nowait() for _ in range(2)]
    assert [(c, m[0], m[1]) for c, m in got] == [(conn, "built", "r-0"), (conn, "built", "r-1")]
    assert builds.finish("r-0", first) and builds.finish("r-1", second)


def test_an_abort_before_the_build_ends_gets_its_final_and_is_never_added():
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    builds, compiler = GrammarBuilds(inbox), _Compiler()
    mine, other = object(), object()
    for rid, conn in (("a", mine), ("b", mine), ("c", other)):
        builds.start(compiler, conn, rid, _prepared(CompiledGrammar("regex", "t", "l")))
    finals = builds.abort(mine, ["a", "c"], "abort")  # "c" is another API server's: not this one's to abort
    assert [(f.request_id, f.finish_reason, f.new_token_ids) for f in finals] == [("a", "abort", [])]
    assert [f.request_id for f in builds.abort(mine, None, "stop")] == ["b"]
    builds.forget(other)
    for future in compiler.futures:
        future.set_result(None)
    built = [inbox.get_nowait()[1] for _ in range(3)]
    assert not any(builds.finish(m[1], m[2]) for m in built)  # none is still wanted
