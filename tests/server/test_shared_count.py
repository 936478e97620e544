"""The counts that max_concurrent_requests and max_connections are held to: taken up to the limit and no further,
given back, and one number for every process that shares them (real spawned processes, as API servers are)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

import pytest

from mlaserve.server.shared_count import ServerCounts, SharedCount

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture(params=["in_process", "across_processes"])
def count(request) -> SharedCount:
    if request.param == "in_process":
        return SharedCount.in_process()
    return SharedCount.across_processes(SPAWN)


def test_takes_up_to_the_limit_and_refuses_past_it(count):
    assert all(count.try_acquire(1, 8) for _ in range(8))
    assert count.value == 8
    assert not count.try_acquire(1, 8)
    assert count.value == 8  # a refusal takes nothing


def test_a_request_of_several_sequences_fits_whole_or_not_at_all(count):
    assert count.try_acquire(6, 8)
    assert not count.try_acquire(3, 8)
    assert count.value == 6
    assert count.try_acquire(2, 8)
    assert count.value == 8


def test_what_is_given_back_can_be_taken_again(count):
    assert count.try_acquire(8, 8)
    count.release(3)
    assert count.value == 5
    assert count.try_acquire(3, 8) and not count.try_acquire(1, 8)
    count.release(8)
    assert count.value == 0


def test_one_api_server_counts_in_process_several_across_processes():
    alone = ServerCounts.for_processes(1)
    assert isinstance(alone.sequences.lock, type(SharedCount.in_process().lock))
    several = ServerCounts.for_processes(2)
    assert several.sequences is not several.connections
    assert several.sequences.try_acquire(1, 1) and several.connections.value == 0


def _take(count: SharedCount, amount: int, limit: int, tries: int, reply: Connection) -> None:
    """In another process: try `tries` times to take `amount`, and say how many tries succeeded."""
    reply.send(sum(count.try_acquire(amount, limit) for _ in range(tries)))


def _give_back(count: SharedCount, amount: int, times: int, done: Connection) -> None:
    for _ in range(times):
        count.release(amount)
    done.send(count.value)


def _in_process(target, *args) -> object:
    mine, theirs = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=target, args=(*args, theirs))
    process.start()
    theirs.close()
    try:
        assert mine.poll(60), "the child process did not answer"
        return mine.recv()
    finally:
        process.join(10)


@pytest.mark.slow  # spawned processes import mlaserve (torch): seconds each
def test_processes_share_one_count():
    count = SharedCount.across_processes(SPAWN)
    assert count.try_acquire(5, 8)  # this process holds 5 of 8
    assert _in_process(_take, count, 1, 8, 10) == 3  # another gets only what is left
    assert count.value == 8 and not count.try_acquire(1, 8)
    assert _in_process(_give_back, count, 1, 3) == 5  # what it gives back shows here
    assert count.try_acquire(3, 8)


def _race(count: SharedCount, together: object, reply: Connection) -> None:
    """In another process, with the other racers: take and give back many times over, then take what it can of
    100."""
    together.wait()
    for _ in range(30_000):
        count.try_acquire(1, 10**9)
    for _ in range(30_000):
        count.release(1)
    together.wait()
    reply.send(sum(count.try_acquire(1, 100) for _ in range(60)))


@pytest.mark.slow
def test_processes_taking_at_once_never_pass_the_limit():
    count, together = SharedCount.across_processes(SPAWN), SPAWN.Barrier(3, timeout=60)
    pipes, processes = [], []
    for _ in range(3):
        mine, theirs = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(target=_race, args=(count, together, theirs))
        process.start()
        theirs.close()
        pipes.append(mine)
        processes.append(process)
    taken = []
    for mine, process in zip(pipes, processes):
        assert mine.poll(60)
        taken.append(mine.recv())
        process.join(10)
    # An update lost while they overlap would leave the count off by it (unlocked, tens of thousands were lost).
    assert sum(taken) == 100 == count.value
