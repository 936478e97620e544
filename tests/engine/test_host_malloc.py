"""The engine core's malloc settings: applied on glibc, off with MLASERVE_MALLOC_TUNING=0, trims throttled."""

from __future__ import annotations

import platform

import pytest

from mlaserve.engine import host_malloc
from mlaserve.engine.host_malloc import HostMalloc

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt and malloc_trim")


@glibc_only
def test_an_idle_trim_runs_at_most_once_per_interval(monkeypatch):
    clock = iter([100.0, 101.0, 100.0 + host_malloc.TRIM_EVERY_S + 0.1])
    monkeypatch.setattr(host_malloc.time, "monotonic", lambda: next(clock))
    malloc = HostMalloc()
    assert malloc.active
    assert [malloc.trim_when_idle() for _ in range(3)] == [True, False, True]


def test_tuning_off_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv("MLASERVE_MALLOC_TUNING", "0")
    malloc = HostMalloc()
    assert not malloc.active and not malloc.trim_when_idle()
