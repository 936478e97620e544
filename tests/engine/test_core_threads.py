"""On CPU the engine core gives threads to the API servers as their reported load asks, with slack both ways."""

from __future__ import annotations

import pytest
import torch

from mlaserve.engine.core_threads import CoreThreads


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    now = [0.0]
    share = CoreThreads("cpu", clock=lambda: now[0])
    share.now = now
    share.full, share.cores = 8, 8  # a machine of 8 cores, whatever this one has
    yield share
    torch.set_num_threads(before)


def test_threads_follow_the_api_servers_load(threads):
    threads.report("a", 0.1)
    assert torch.get_num_threads() == 8  # a nearly idle API server takes nothing
    threads.report("a", 0.6)
    assert torch.get_num_threads() == 7
    threads.report("b", 0.9)  # two API servers: 1.5 cores' worth
    assert torch.get_num_threads() == 6
    threads.report("b", 0.7)  # 1.3: just below the reservation, kept (no flapping)
    assert torch.get_num_threads() == 6
    threads.report("b", 0.1)  # 0.7: clearly below, but not for long yet
    assert torch.get_num_threads() == 6
    threads.now[0] += 6.0
    threads.report("b", 0.1)  # still below after 6 s: given back
    assert torch.get_num_threads() == 7
    threads.forget("a")
    threads.report("b", 0.1)
    assert torch.get_num_threads() == 7  # a pause between bursts keeps the reservation a while
    threads.now[0] += 6.0
    threads.report("b", 0.0)
    assert torch.get_num_threads() == 8


def test_at_least_one_thread_and_never_more_than_the_model_had(threads):
    threads.full = 4
    threads.report("a", 0.5)
    assert torch.get_num_threads() == 4  # 8 cores less 1 is still more than the model's 4 threads
    threads.report("a", 30.0)
    assert torch.get_num_threads() == 1


def test_omp_num_threads_and_gpus_are_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not CoreThreads("cpu").enabled
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not CoreThreads("cuda").enabled
