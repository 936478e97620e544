"""On CPU the engine core runs as many threads as its cores, less what the cgroup quota, other processes and the API
servers' reported load take, with slack both ways; MLASERVE_CPU_THREADS fixes the count."""

from __future__ import annotations

import pytest
import torch

from mlaserve.engine.core_threads import CoreThreads, thread_count, threads_override
from mlaserve.engine.host_cpus import OtherLoad, cgroup_cpu_quota, cpu_busy_seconds


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    now = [0.0]
    share = CoreThreads("cpu", clock=lambda: now[0], measure_host=False)
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


def test_thread_count_from_affinity_quota_and_load():
    assert thread_count(8, affinity=8, quota=None, other_cores=0, api_cores=0) == 8
    assert thread_count(64, affinity=64, quota=2.0, other_cores=0, api_cores=0) == 2  # a container's quota
    assert (
        thread_count(64, affinity=64, quota=2.5, other_cores=0, api_cores=0) == 2
    )  # a part core is no thread
    assert thread_count(8, affinity=4, quota=None, other_cores=0, api_cores=0) == 4  # taskset / cpuset
    assert (
        thread_count(2, affinity=2, quota=None, other_cores=1, api_cores=0) == 1
    )  # one busy process beside us
    # On a large host other processes' load matters only once it leaves fewer cores free than the quota allows.
    assert thread_count(64, affinity=64, quota=4.0, other_cores=40, api_cores=0) == 4
    assert thread_count(64, affinity=64, quota=4.0, other_cores=62, api_cores=0) == 2
    assert (
        thread_count(8, affinity=8, quota=4.0, other_cores=0, api_cores=1) == 3
    )  # the API servers share the quota
    assert thread_count(8, affinity=2, quota=0.5, other_cores=3, api_cores=2) == 1  # never none


def test_cgroup_v2_quota_is_the_smallest_on_the_way_up(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("0::/kubepods/pod1/ctr\n")
    (tmp_path / "kubepods/pod1/ctr").mkdir(parents=True)
    assert cgroup_cpu_quota(tmp_path, own) is None  # no files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods/pod1/ctr/cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, own) is None
    (tmp_path / "kubepods/pod1/cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, own) == 1.5
    (tmp_path / "kubepods/pod1/ctr/cpu.max").write_text("400000 100000\n")
    assert cgroup_cpu_quota(tmp_path, own) == 1.5
    own.write_text("0::/\n")  # inside a container's namespace: its own cgroup is the root of the mount
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_quota(tmp_path, own) == 2.0


def test_cgroup_v1_quota(tmp_path):
    own = tmp_path / "self_cgroup"
    own.write_text("4:memory:/x\n2:cpu,cpuacct:/docker/abc\n")
    folder = tmp_path / "cpu,cpuacct/docker/abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path, own) is None
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(tmp_path, own) == 3.0
    assert cgroup_cpu_quota(tmp_path / "missing", tmp_path / "missing_self") is None


def test_busy_seconds_count_processes_work_on_the_given_cpus_only(tmp_path):
    import os

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 1000 20 0 10 0 0 0\ncpu1 7 0 0 0 0 0 0 0 0 0\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert cpu_busy_seconds([0], stat) == 150 / tick  # not idle, iowait or interrupts
    assert cpu_busy_seconds([0, 1], stat) == 157 / tick
    assert cpu_busy_seconds([0], tmp_path / "missing") is None


def test_other_load_is_busy_time_less_our_own_and_the_api_servers():
    readings = iter(
        [(0.0, 0.0, 0.0), (2.0, 3.0, 0.5), (3.0, 3.5, 0.9)]
    )  # (clock, CPUs busy, our own CPU time)
    current = [next(readings)]

    def advance():
        current[0] = next(readings)

    load = OtherLoad(
        [0, 1], busy=lambda: current[0][1], own=lambda: current[0][2], clock=lambda: current[0][0]
    )
    advance()
    assert load.sample(api_cores=0.25) == pytest.approx((3.0 - 0.5) / 2 - 0.25)
    advance()
    assert load.sample(api_cores=0.5) == 0.0  # never below nothing


def test_threads_give_way_to_a_busy_process_and_come_back(threads):
    class Fake:
        value = 0.0

        def sample(self, api_cores: float) -> float:
            return self.value

    other = Fake()
    threads.other_load = other
    threads.full = threads.cores = 2
    threads.report("a", 0.0)
    assert torch.get_num_threads() == 2
    other.value = 1.0  # a busy process starts
    threads.now[0] += 1.0
    threads.report("a", 0.0)
    assert torch.get_num_threads() == 1
    other.value = 0.0  # it stops: the core is taken back once that has lasted a few seconds
    threads.now[0] += 1.0
    threads.report("a", 0.0)
    assert torch.get_num_threads() == 1
    threads.now[0] += 6.0
    threads.report("a", 0.0)
    assert torch.get_num_threads() == 2
    threads.quota = 1.0  # a quota of one core binds whatever the load
    threads.report("a", 0.0)
    assert torch.get_num_threads() == 1


def test_mlaserve_cpu_threads_fixes_the_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MLASERVE_CPU_THREADS", "3")
    try:
        fixed = CoreThreads("cpu")
        assert not fixed.enabled and torch.get_num_threads() == 3
        fixed.report("a", 5.0)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert threads_override({}) is None
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="MLASERVE_CPU_THREADS"):
            threads_override({"MLASERVE_CPU_THREADS": bad})
