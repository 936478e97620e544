"""Soak test: 10,000 mixed requests against `mlaserve serve` on the CPU, with the server's memory sampled throughout.

The mix: whole and streamed completions and chats, streams the client abandons after a few chunks, echo with
prompt logprobs, tokenizer calls, and bad requests of many kinds (broken JSON, lone surrogates, unknown fields,
too many sequences, prompts past max_model_len). Pass: no 5xx and no dropped connection, KV blocks back to 0, no
request left running, and the server's resident memory flat after the warm-up (growth below --rss-bound-mib from
the end of the first fifth of the requests to the end).

The default model is a tiny random Llama (mlaserve/testing/tiny_models.py) so that 10,000 requests take minutes, not hours;
--model serves any other folder. --varied-prompts draws each completion's prompt length from 1 word up to most of
--max-model-len (uniform in its logarithm), so the engine core sees many tensor shapes: what the allocator's
fragmentation and any per-shape cache show up under. The engine core's resident memory is sampled beside the
API server's, and both growths are reported and held to --rss-bound-mib.

    python benchmarks/soak.py                      # writes benchmarks/results/soak-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KINDS = (  # (kind, weight)
    ("completion", 30),
    ("completion_stream", 15),
    ("chat", 10),
    ("chat_stream", 10),
    ("abandoned_stream", 10),
    ("echo_logprobs", 5),
    ("tokenize", 5),
    ("bad", 15),
)
CHAT_TEMPLATE = "{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}{% if add_generation_prompt %}w12{% endif %}"
BAD_BODIES = [
    b'{"prompt": "w1", ',
    b'{"prompt": "w1 \\ud800", "max_tokens": 2}',
    b'{"model": "\\udfff", "prompt": "w1"}',
    b'{"prompt": "w1", "tools": [{"type": "function"}]}',
    b'{"prompt": "w1", "frobnicate": 1}',
    b'{"prompt": "w1", "n": 500}',
    b'{"prompt": "w1", "max_tokens": -3}',
    b'{"prompt": "w1", "top_p": 0}',
    b'["not", "an", "object"]',
    b'{"prompt": "' + b"w7 " * 400 + b'"}',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def core_pid(server_pid: int) -> int | None:
    """The engine core: the server's child process named mlaserve-engine-core (multiprocessing sets the name)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"multiprocessing.spawn" in cmdline:  # not its resource tracker
                return int(child)
    return None


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, 250)}" for _ in range(n))


def prompt_words(rng: random.Random, varied_up_to: int | None) -> int:
    if varied_up_to is None:
        return rng.randrange(1, 60)
    return max(1, int(math.exp(rng.uniform(0.0, math.log(varied_up_to)))))


async def one(
    client: httpx.AsyncClient, kind: str, rng: random.Random, varied_up_to: int | None = None
) -> int:
    """Sends one request of `kind`; returns the HTTP status (0 for an abandoned stream)."""
    if kind == "completion":
        body = {"prompt": words(rng, prompt_words(rng, varied_up_to)), "max_tokens": rng.randrange(1, 16)}
        if rng.random() < 0.3:
            body.update(temperature=0.8, seed=rng.randrange(1000), n=rng.randrange(1, 3))
        return (await client.post("/v1/completions", json=body)).status_code
    if kind == "echo_logprobs":
        body = {"prompt": words(rng, 20), "max_tokens": rng.choice([0, 1]), "echo": True, "logprobs": 2}
        return (await client.post("/v1/completions", json=body)).status_code
    if kind in ("chat", "chat_stream", "completion_stream", "abandoned_stream"):
        chat = kind.startswith("chat")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict = {"max_tokens": rng.randrange(4, 24), "presence_penalty": 0.5}
        if chat:
            body["messages"] = [{"role": "user", "content": words(rng, rng.randrange(1, 30))}]
        else:
            body["prompt"] = words(rng, rng.randrange(1, 30))
        if kind == "chat":
            return (await client.post(path, json=body)).status_code
        body["stream"] = True
        async with client.stream("POST", path, json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if kind == "abandoned_stream" and chunks >= 2:
                    return 0  # leave: the server must abort it and free its blocks
            return r.status_code
    if kind == "tokenize":
        r = await client.post("/tokenize", json={"prompt": words(rng, 10)})
        if r.status_code != 200:
            return r.status_code
        return (await client.post("/detokenize", json={"tokens": r.json()["tokens"]})).status_code
    body_bytes = rng.choice(BAD_BODIES)
    json_type = {"content-type": "application/json"}  # so the body reaches the parser
    return (await client.post("/v1/completions", content=body_bytes, headers=json_type)).status_code


async def drive(
    url: str,
    total: int,
    concurrency: int,
    seed: int,
    pid: int,
    samples: list,
    only: set[str] | None = None,
    varied_up_to: int | None = None,
) -> dict:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS for _ in range(w) if only is None or k in only]
    plan = [rng.choice(kinds) for _ in range(total)]
    statuses: dict[str, dict[str, int]] = {}
    errors: list[str] = []
    done = 0
    queue: asyncio.Queue = asyncio.Queue()
    for i, kind in enumerate(plan):
        queue.put_nowait((i, kind))
    started = time.monotonic()

    async def worker(index: int) -> None:
        nonlocal done
        wrng = random.Random(seed * 1000 + index)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            while not queue.empty():
                _, kind = queue.get_nowait()
                try:
                    status = await one(client, kind, wrng, varied_up_to)
                except httpx.HTTPError as e:
                    errors.append(f"{kind}: {type(e).__name__}: {e}")
                    status = -1
                per_kind = statuses.setdefault(kind, {})
                per_kind[str(status)] = per_kind.get(str(status), 0) + 1
                done += 1

    core = core_pid(pid)

    def sample() -> dict:
        core_rss = rss_mib(core) if core is not None else None
        return {
            "t_s": round(time.monotonic() - started, 2),
            "done": done,
            "rss_mib": rss_mib(pid),
            "core_rss_mib": core_rss,
        }

    async def sampler() -> None:
        while done < total:
            samples.append(sample())
            await asyncio.sleep(0.5)

    sampling = asyncio.create_task(sampler())
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    sampling.cancel()
    samples.append(sample())
    return {
        "statuses": statuses,
        "errors": errors[:20],
        "num_errors": len(errors),
        "wall_s": time.monotonic() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    parser.add_argument("--output", default=None)
    parser.add_argument("--kinds", default=None, help="only these request kinds, comma-separated (to bisect)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument(
        "--varied-prompts",
        action="store_true",
        help="completion prompts from 1 word to most of max-model-len",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="requests before growth is measured (a fifth)"
    )
    args = parser.parse_args()

    model = args.model
    if model is None:
        from mlaserve.testing.tiny_models import build_tiny

        path = build_tiny("llama", Path(tempfile.mkdtemp(prefix="mlaserve-soak-")))
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = CHAT_TEMPLATE
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        model = str(path)
    port = free_port()
    cmd = [sys.executable, "-m", "mlaserve.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--max-model-len", str(args.max_model_len)]
    cmd += ["--num-kv-blocks", str(max(512, 2 * args.max_model_len))]
    cmd += ["--max-concurrent-requests", "64", "--served-model-name", "soak"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.3)
        samples: list[dict] = []
        only = set(args.kinds.split(",")) if args.kinds else None
        # Words of this tokenizer-agnostic kind are a few tokens each: a third of the context leaves room to spare.
        varied = args.max_model_len // 3 if args.varied_prompts else None
        result = asyncio.run(
            drive(url, args.requests, args.concurrency, args.seed, server.pid, samples, only, varied)
        )
        time.sleep(1.0)  # aborted streams are freed on the engine's next loop
        page = httpx.get(f"{url}/metrics", timeout=10).text
        kv_used = metric(page, "mlaserve_kv_blocks_used")
        running = metric(page, "vllm:num_requests_running")
        log_bytes = os.path.getsize(log.name)
    finally:
        server.terminate()
        server.wait(30)

    warmup = args.warmup if args.warmup is not None else args.requests // 5
    warm = next(s for s in samples if s["done"] >= warmup)
    after = [s["rss_mib"] for s in samples if s["done"] >= warm["done"]]
    growth = max(after) - warm["rss_mib"]
    core_after = [s["core_rss_mib"] for s in samples if s["done"] >= warm["done"] and s["core_rss_mib"]]
    core_growth = max(core_after) - warm["core_rss_mib"] if core_after and warm["core_rss_mib"] else None
    five_xx = {k: n for kind in result["statuses"].values() for k, n in kind.items() if k.startswith("5")}
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "model": args.model or "tiny random Llama (mlaserve/testing/tiny_models.py), float32",
        "requests": args.requests,
        "concurrency": args.concurrency,
        **result,
        "kv_blocks_used_after": kv_used,
        "requests_running_after": running,
        "server_log_bytes": log_bytes,
        "rss_mib_after_warmup": warm["rss_mib"],
        "rss_mib_max_after_warmup": max(after),
        "rss_growth_after_warmup_mib": round(growth, 1),
        "core_rss_mib_after_warmup": warm["core_rss_mib"],
        "core_rss_growth_after_warmup_mib": None if core_growth is None else round(core_growth, 1),
        "warmup_requests": warmup,
        "rss_bound_mib": args.rss_bound_mib,
        "rss_samples": samples,
    }
    report["passed"] = (
        not five_xx
        and result["num_errors"] == 0
        and kv_used == 0
        and running == 0
        and growth < args.rss_bound_mib
        and (core_growth is None or core_growth < args.rss_bound_mib)
    )
    output = Path(args.output or REPO / "benchmarks" / "results" / f"soak-{report['date']}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_samples"}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
