"""Online serving benchmark: streaming requests against an OpenAI-compatible server, over HTTP only.

Arrivals are either a fixed number in flight (--concurrency) or Poisson at --request-rate (requests/s), or both
(Poisson, capped). Every request streams, so the client sees each token arrive:
  TTFT  time to first token: request sent -> first chunk with text
  TPOT  time per output token after the first: (e2e - ttft) / (output tokens - 1)
  ITL   inter-token latency: the gaps between successive text chunks (all requests pooled)
Output tokens are the server's final usage count (stream_options.include_usage), else the text-chunk count.
The run is bounded by --num-prompts and --max-duration-s, and only talks to loopback addresses.

    python benchmarks/serving.py --launch --concurrency 8 --num-prompts 32 --max-tokens 32
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --request-rate 2 --num-prompts 50
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import ipaddress
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
WORDS = (
    "river light stone garden winter market engine letter forest signal harbor window paper orbit "
    "violin desert ladder copper meadow planet thunder candle bridge silver anchor lantern puzzle"
).split()


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


_trace_file: list = []


def step_trace(event: str, *fields: object) -> None:
    """The client's line of the server's opt-in step trace (mlaserve/engine/step_trace.py's format; this script
    imports nothing from mlaserve). Read at each call: serve_vs_offline.py sets the variable after importing this."""
    folder = os.environ.get("MLASERVE_STEP_TRACE")
    if not folder:
        return
    if not _trace_file:
        _trace_file.append(open(os.path.join(folder, f"trace-{os.getpid()}.txt"), "a", buffering=1))  # noqa: SIM115
    _trace_file[0].write(" ".join(map(str, (time.perf_counter(), event, *fields))) + "\n")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating between closest ranks like numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def request_timings(
    sent: float, chunk_times: Sequence[float], end: float, output_tokens: int
) -> tuple[float | None, float | None, list[float]]:
    """(ttft, tpot, itls) of one request from the send time, the arrival time of each text chunk and the end."""
    if not chunk_times:
        return None, None, []
    ttft = chunk_times[0] - sent
    tpot = (end - sent - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    itls = [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:])]
    return ttft, tpot, itls


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    mean = sum(values) / len(values) if values else None
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


def _top_gaps_by_position(done: Sequence[RequestRecord]) -> dict[str, list]:
    """The largest 1% of all gaps (what sets the p99) by their place in a request's stream (1: the first gap):
    [count, smallest, largest] seconds for each place. "11+ at": for the late ones, when they ended (seconds
    since the run began, to 10 ms) and how many ended then: one stall of the engine ends many streams' gaps at
    once, a slow stream or process spreads them."""
    gaps = []
    for r in done:
        t = r.start + (r.ttft or 0.0)
        for i, gap in enumerate(r.itls):
            t += gap
            gaps.append((gap, i + 1, t))
    gaps.sort(reverse=True)
    places: dict[str, list] = {}
    ends: dict[float, int] = {}
    for gap, place, end in gaps[: max(1, len(gaps) // 100)] if gaps else []:
        key = str(place) if place <= 3 else "4-10" if place <= 10 else "11+"
        count, low, high = places.get(key, [0, gap, gap])
        places[key] = [count + 1, min(low, gap), max(high, gap)]
        if place > 10:
            ends[round(end, 2)] = ends.get(round(end, 2), 0) + 1
    if ends:
        places["11+ at"] = sorted(([t, n] for t, n in ends.items()), key=lambda e: -e[1])[:8]
    return places


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, object]:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "requests_completed": len(done),
        "requests_failed": sum(1 for r in records if not r.ok),
        "duration_s": duration_s,
        "request_throughput_rps": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput_tps": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "ttft_s": _spread([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": _spread([r.tpot for r in done if r.tpot is not None]),
        "itl_s": _spread([gap for r in done for gap in r.itls]),
        # Without each request's first gap, which under a burst spans the rest of the burst's prefill: says
        # whether a p99 comes from those or from the decode steps themselves.
        "itl_after_first_s": _spread([gap for r in done for gap in r.itls[1:]]),
        # Each request's last gap alone: a step that finishes many streams at once shows here.
        "itl_last_s": _spread([r.itls[-1] for r in done if r.itls]),
        "e2e_s": _spread([r.e2e for r in done if r.e2e is not None]),
        "itl_top_percent": _top_gaps_by_position(done),
        "errors": sorted({r.error for r in records if r.error}),
    }


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_prompts(count: int, words_per_prompt: int, seed: int) -> list[str]:
    """Distinct word salads (about one token per word), so prefix caching cannot turn prefills into hits."""
    rng = random.Random(seed)
    return [
        f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words_per_prompt)) for i in range(count)
    ]


def _carries_token(choice: dict) -> bool:
    """A chunk with text, or an empty one that is not the final/role chunk (a token held back as a partial
    character still arrived). Chunks that only announce the role or the finish reason carry no token."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    if not isinstance(text, str):
        return False
    return bool(text) or (choice.get("finish_reason") is None and not (delta or {}).get("role"))


async def one_request(
    session: aiohttp.ClientSession, args: argparse.Namespace, model: str, prompt: str | list[int], t0: float
):
    body: dict[str, object] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, accepted by mlaserve: every request runs max_tokens
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    record, chunks, usage_tokens = RequestRecord(ok=False), [], None
    sent = time.perf_counter()
    record.start = sent - t0
    try:
        path = "/chat/completions" if args.endpoint == "chat" else "/completions"
        async with session.post(args.base_url + path, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")[:200]
                record.error = f"HTTP {response.status}: {text}"
                return record
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    record.error = f"stream error: {payload['error']}"[:200]
                    return record
                choices = payload.get("choices") or []
                if any(_carries_token(choice) for choice in choices):
                    chunks.append(time.perf_counter())
                if any(choice.get("finish_reason") for choice in choices):
                    step_trace(
                        "client_final", chunks[-1] if chunks else 0, chunks[-2] if len(chunks) > 1 else 0
                    )
                    # Every stream one server step finished is woken at once in this process: without the pause
                    # each would run its end (usage, [DONE], the connection's release) before the next stamped
                    # its last token, and this client's own work would count as the server's last gaps.
                    await asyncio.sleep(0)
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                    record.prompt_tokens = payload["usage"].get("prompt_tokens")
    except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"[:200]
        return record
    end = time.perf_counter()
    record.output_tokens = usage_tokens if usage_tokens is not None else len(chunks)
    record.ttft, record.tpot, record.itls = request_timings(sent, chunks, end, record.output_tokens)
    record.e2e, record.ok = end - sent, True
    return record


@dataclass
class LoadRun:
    records: list[RequestRecord]
    duration_s: float  # from the common start to the last end
    cpu_s: float  # client CPU seconds over all processes
    full_collections_ms: list[float]  # each full collection in a client process while it measured


def run_load_processes(args: argparse.Namespace, model: str, prompts: list, processes: int) -> LoadRun:
    """run_load spread over `processes` client processes, so that one Python interpreter parsing every stream's
    events does not bound what a server can be seen to deliver. Each process takes every k-th prompt, its share
    of --concurrency and of --request-rate (a sum of Poisson processes is one), and all start at one moment."""
    if processes <= 1:
        return _load_share(args, model, prompts, None)
    import multiprocessing

    shares = [prompts[k::processes] for k in range(processes)]
    jobs = []
    for k, share in enumerate(shares):
        part = argparse.Namespace(**vars(args))
        if args.concurrency:
            part.concurrency = max(1, args.concurrency // processes + (k < args.concurrency % processes))
        part.request_rate = args.request_rate / processes
        part.seed = args.seed + k
        jobs.append((part, model, share))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        start_at = time.perf_counter() + 2.0 + 0.5 * processes  # CLOCK_MONOTONIC: one clock for every process
        results = pool.starmap(_load_share, [(*job, start_at) for job in jobs])
    return LoadRun(
        records=[r for run in results for r in run.records],
        duration_s=max(run.duration_s for run in results),
        cpu_s=sum(run.cpu_s for run in results),
        full_collections_ms=[ms for run in results for ms in run.full_collections_ms],
    )


def _load_share(args: argparse.Namespace, model: str, prompts: list, start_at: float | None) -> LoadRun:
    """start_at: the moment every process starts sending (None: once this one is ready)."""
    with client_heap() as collections_ms:  # its collect before the start: not inside the measured run
        start_at = time.perf_counter() if start_at is None else start_at
        time.sleep(max(0.0, start_at - time.perf_counter()))
        cpu = time.process_time()
        records, _ = asyncio.run(run_load(args, model, prompts, t0=start_at))
        cpu = time.process_time() - cpu
    return LoadRun(records, time.perf_counter() - start_at, cpu, collections_ms)


@contextmanager
def client_heap() -> Iterator[list[float]]:
    """The client's own start-up objects frozen while it measures, and its full collections timed (yielded, in
    ms): a collection that walks the client's imports stalls every stream it reads, and the stall would count as
    the server's inter-token latency."""
    gc.collect()
    gc.freeze()
    times: list[float] = []
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                times.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(timed)
    try:
        yield times
    finally:
        gc.callbacks.remove(timed)
        gc.unfreeze()


async def run_load(
    args: argparse.Namespace, model: str, prompts: list[str], t0: float | None = None
) -> tuple[list[RequestRecord], float]:
    limit = asyncio.Semaphore(args.concurrency or len(prompts))
    rng = random.Random(args.seed)
    # aiohttp, not httpx: its C parsers spend much less CPU per streamed event, and a client process that
    # saturates first would be what the benchmark measures. trust_env stays False: no proxy sees loopback traffic.
    connector = aiohttp.TCPConnector(limit=args.concurrency or len(prompts))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=auth(args)) as client:
        t0 = time.perf_counter() if t0 is None else t0
        deadline = t0 + args.max_duration_s

        async def limited(prompt: str) -> RequestRecord:
            async with limit:
                if time.perf_counter() >= deadline:
                    return RequestRecord(ok=False, error="not started: --max-duration-s reached")
                return await one_request(client, args, model, prompt, t0)

        tasks = []
        for prompt in prompts:
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        finished, pending = await asyncio.wait(tasks, timeout=max(deadline - time.perf_counter(), 0))
        for task in pending:
            task.cancel()
        duration = time.perf_counter() - t0
        records = [task.result() for task in tasks if task in finished]
        records += [RequestRecord(ok=False, error="cancelled: --max-duration-s reached") for _ in pending]
        return records, duration


def auth(args: argparse.Namespace) -> dict[str, str]:
    key = os.environ.get(args.api_key_env)
    return {"Authorization": f"Bearer {key}"} if key else {}


def fetch_models(args: argparse.Namespace) -> dict:
    response = httpx.get(args.base_url + "/models", headers=auth(args), timeout=10, trust_env=False)
    if response.status_code != 200:
        raise RuntimeError(
            f"GET {args.base_url}/models answered {response.status_code}: {response.text[:200]}"
        )
    return response.json()


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    port = free_loopback_port()
    command = [sys.executable, "-m", "mlaserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--config", args.config] if args.config else []
    command += ["--model", args.model] if args.model else []
    command += shlex.split(args.server_args)
    log_path = Path(tempfile.mkstemp(prefix="mlaserve-serve-", suffix=".log")[1])
    print(f"launching: {shlex.join(command)}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    base_url = f"http://127.0.0.1:{port}/v1"
    give_up = time.monotonic() + args.launch_timeout_s
    while time.monotonic() < give_up:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"mlaserve serve exited with code {server.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/models", timeout=2, trust_env=False).status_code < 500:
                return server, base_url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"mlaserve serve did not answer within {args.launch_timeout_s}s; see {log_path}")


def stop_server(server: subprocess.Popen, grace_s: float = 30.0) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(grace_s)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def git_commit() -> str | None:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else None


def print_table(summary: dict, label: str) -> None:
    print(f"\n{label}")
    print(f"{'metric':<10}{'mean ms':>12}{'p50 ms':>12}{'p99 ms':>12}")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        cells = [summary[name][k] for k in ("mean", "p50", "p99")]
        row = "".join(f"{c * 1000:>12.1f}" if c is not None else f"{'-':>12}" for c in cells)
        print(f"{name[:-2].upper():<10}{row}")
    print(
        f"requests: {summary['requests_completed']} ok, {summary['requests_failed']} failed in "
        f"{summary['duration_s']:.1f} s | {summary['request_throughput_rps']:.2f} req/s | "
        f"{summary['output_token_throughput_tps']:.1f} output tok/s"
    )
    for error in summary["errors"]:
        print(f"error: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL (loopback only)")
    add("--endpoint", choices=("completions", "chat"), default="completions")
    add("--model-name", default=None, help="`model` sent in requests (default: the first of /v1/models)")
    add("--concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    add("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf)")
    add("--num-prompts", type=int, default=64)
    add("--prompt-len", type=int, default=32, help="words per prompt (about one token each)")
    add("--max-tokens", type=int, default=32)
    add("--temperature", type=float, default=0.0)
    add("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension): fixed-length outputs")
    add("--max-duration-s", type=float, default=600.0, help="stop sending and cancel what runs after this")
    add("--seed", type=int, default=0)
    add("--client-processes", type=int, default=1, help="spread the streams over this many client processes")
    add("--api-key-env", default="MLASERVE_API_KEY", help="env var holding a key to send (if set)")
    add("--output", default=None, help="JSON path (default: benchmarks/results/serving-<date>-c<N>.json)")
    add("--launch", action="store_true", help="start `mlaserve serve` on a free loopback port, stop it after")
    add("--model", default=None, help="with --launch: passed to `serve --model`")
    add("--config", default=None, help="with --launch: passed to `serve --config`")
    add("--server-args", default="", help="with --launch: more `serve` flags, one shell-quoted string")
    add("--launch-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    for name in ("num_prompts", "max_tokens", "prompt_len", "concurrency", "client_processes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.request_rate > 0 or not args.max_duration_s > 0:
        parser.error("--request-rate and --max-duration-s must be > 0")
    if not args.launch and not is_loopback(args.base_url):
        parser.error(
            f"--base-url {args.base_url!r} is not a loopback address; this benchmark only runs locally"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server, log_path = None, None
    try:
        if args.launch:
            server, args.base_url, log_path = launch_server(args)
        args.base_url = args.base_url.rstrip("/")
        models = fetch_models(args)
        model = args.model_name or models["data"][0]["id"]
        prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed)
        run = run_load_processes(args, model, prompts, args.client_processes)
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"serving benchmark: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            stop_server(server)
    summary = summarize(run.records, run.duration_s)
    summary["client_full_collections_ms"] = run.full_collections_ms
    now = dt.datetime.now()
    mode = f"c{args.concurrency}" if args.concurrency else f"r{args.request_rate:g}"
    output = Path(args.output) if args.output else RESULTS / f"serving-{now.date().isoformat()}-{mode}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/serving.py", *(sys.argv[1:] if argv is None else argv)]),
        "git_commit": git_commit(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "settings": {k: v if v != math.inf else "inf" for k, v in vars(args).items()},
        "server_models": models,
        "server_log_head": log_path.read_text(errors="replace").splitlines()[:80] if log_path else None,
        "summary": summary,
        "requests": [asdict(r) for r in run.records],
    }
    output.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print_table(summary, f"{model} via {args.endpoint}, {mode}, {len(run.records)} requests")
    print(f"wrote {output}")
    return 0 if summary["requests_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
