"""The core process's step messages: a step's deltas leave before anything else the core does for them."""

from __future__ import annotations

from mlaserve.engine import core_process
from mlaserve.engine.core_output import CoreOutput


class _Conn:
    def __init__(self, log: list) -> None:
        self.log = log

    def send(self, message: tuple) -> None:
        self.log.append(("send", message[0], len(message[1]), message[2] is not None))


class _Core:
    def __init__(self, log: list) -> None:
        self.log = log

    def release_finished(self) -> None:
        self.log.append(("release",))

    def has_unfinished_requests(self) -> bool:
        return False  # the step finished everything: stats are due

    def stats(self) -> dict:
        self.log.append(("stats",))
        return {"kv_blocks_used": 0}


def test_the_last_tokens_leave_before_the_blocks_are_freed_and_the_stats_built() -> None:
    log: list = []
    conns = [_Conn(log), _Conn(log)]
    loop = core_process._CoreLoop(_Core(log), conns, threads=None)
    loop.owner = {"a": conns[0], "b": conns[1], "c": conns[1]}
    outputs = [CoreOutput(rid, [7], finish_reason="length") for rid in ("a", "b", "c")]
    loop._send_outputs(outputs)
    # Freeing hundreds of finished requests' blocks took 5 ms of the H200 host's final step: after the deltas.
    assert log == [
        ("send", "out", 1, False),
        ("send", "out", 2, False),
        ("release",),
        ("stats",),
        ("send", "out", 0, True),
        ("send", "out", 0, True),
    ]
    assert loop.owner == {}
