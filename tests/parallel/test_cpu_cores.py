"""Tensor-parallel ranks on one CPU machine share its cores for torch's threads (unless OMP_NUM_THREADS says)."""

from __future__ import annotations

import os

import pytest
import torch

from mlaserve.parallel.group import share_cpu_cores


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_ranks_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    assert share_cpu_cores(2) == max(1, cores // 2)
    assert share_cpu_cores(4 * cores) == 1  # more ranks than cores: one thread each
    torch.set_num_threads(cores)
    assert share_cpu_cores(1) == cores  # a single rank keeps them all


def test_omp_num_threads_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert share_cpu_cores(2) == 3
