"""How the GPU suite measures: CUDA-event medians with L2 emptied by reads, graph replays, the ceilings every
section's figures are a share of, and the header every GPU results JSON starts with."""

import datetime as dt
import os
import subprocess
import sys

import torch


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn, CUDA events around each run, L2 emptied before each run by reading a 256 MiB
    buffer. (triton.testing.do_bench empties it by zeroing a buffer, which leaves L2 full of dirty lines that the
    timed kernels then write back: on an H200 that added 3-10 us to decode calls of 0.09-0.3 ms; docs/performance.md,
    Method.)"""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda").fill_(1)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.amax()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(max(5, int(rep_ms / estimate)))]  # fmt: skip
    for start, end in events:
        flush.amax()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2]


def bench_graph(fn, **bench_options: float) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (as the engine runs decode): the timed span holds the
    kernels only. Eager timing of a 0.1 ms kernel also times the host's launch work whenever the host falls
    behind: three rounds of one run timed the (64, 16, 4,096) decode at 0.106-0.141 ms eagerly and 0.105 ms from a
    graph (docs/performance.md, Method)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, **bench_options)


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB per buffer: far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_ms = bench(lambda: a @ b)
    return {"copy_GBps": 2 * n / ms / 1e6, "bf16_gemm_TFLOPs": 2 * 8192**3 / gemm_ms / 1e9}


def run_header() -> dict:
    """What every GPU results JSON starts with: date, GPU, commit and the command that wrote it. A device's copy of
    the tree may carry a stale .git, so an explicit MLASERVE_COMMIT wins over git's HEAD."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "commit": os.environ.get("MLASERVE_COMMIT") or commit or "unknown",
        "command": " ".join(["python -m benchmarks.gpu_suite", *sys.argv[1:]]),
    }
