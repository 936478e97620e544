"""Tensor and expert parallelism on CPU (gloo, two processes): the same greedy tokens as one process and logprobs
within 1e-4 in float32, through LLM, under torchrun and through the server; a dead rank ends the engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.executor.workers import WorkerDied

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=48)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)


def prompts() -> list[dict]:
    # lengths past the 48-token budget (chunked prefill), and two sharing a prefix (prefix-cache hits)
    base = [(7 * i) % 250 + 3 for i in range(70)]
    return [{"prompt_token_ids": p} for p in (base[:9], base[:60], base[:60] + [5, 6], base[10:33], base[:2])]


def run(model: Path, **options: object) -> list:
    llm = LLM(str(model), **OPTIONS, **options)
    try:
        return llm.generate(prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.engine.close()


def assert_same(want: list, got: list) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want, got, strict=True):
        for token, x, y in zip(
            a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True
        ):
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("deepseek_v2", {}),
        ("deepseek_v3", {}),
        ("deepseek_v3", {"enable_expert_parallel": True}),
        ("llama", {}),
        ("deepseek_v3", {"tensor_parallel_size": 1, "distributed_executor_backend": "mp"}),  # a group of one
        ("deepseek_v2", {"kv_cache_dtype": "int8"}),  # the 8-bit latent cache, on every rank
    ],
    ids=["v2-tp2", "v3-tp2", "v3-ep2", "llama-tp2", "v3-mp1", "v2-tp2-int8"],
)
def test_same_tokens_and_logprobs_as_one_process(tiny, name, options):
    model = tiny(name)
    options = {"tensor_parallel_size": 2, **options}
    llm = LLM(str(model), **OPTIONS, **options)
    try:
        stats = llm.stats()
        assert stats["tensor_parallel_size"] == options["tensor_parallel_size"]
        got = llm.generate(prompts(), PARAMS, use_tqdm=False)
        assert llm.stats()["prefix_cache_hits"] > 0
        workers = llm.engine.executor.workers
        pids = [] if workers is None else workers.pids
    finally:
        llm.engine.close()
    assert_same(run(model, **{k: v for k, v in options.items() if k == "kv_cache_dtype"}), got)
    for pid in pids:  # close() stopped the ranks it started
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_lookahead_steps_read_the_ids_rank_0_broadcast(tiny):
    """Asynchronous scheduling: each lookahead step's input ids are the previous step's samples, which rank 1 has
    only from rank 0's broadcast (without logprobs, so the steps really run ahead)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    model = tiny("deepseek_v3")
    single = LLM(str(model), **OPTIONS).generate(prompts(), greedy, use_tqdm=False)
    llm = LLM(str(model), **OPTIONS, tensor_parallel_size=2, async_scheduling=True)
    ahead = []
    launch = llm.engine.runner.launch

    def counting(output, previous=None):
        ahead.append(previous is not None)
        return launch(output, previous)

    llm.engine.runner.launch = counting
    try:
        got = llm.generate(prompts(), greedy, use_tqdm=False)
    finally:
        llm.engine.close()
    assert sum(ahead) > 5
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in single]


def test_layout_errors_before_any_rank_starts(tiny):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*sizes that do: 1, 2, 4"):
        LLM(str(tiny("deepseek_v3")), **OPTIONS, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="no routed experts"):
        LLM(str(tiny("llama")), **OPTIONS, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel .* needs them"):
        LLM(str(tiny("deepseek_v3")), **OPTIONS, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(tiny("llama")), **OPTIONS, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        LLM(str(tiny("llama")), **OPTIONS, tensor_parallel_size=2, enable_mla=True)


def test_killing_a_rank_ends_the_engine_with_a_clear_error(tiny):
    llm = LLM(str(tiny("deepseek_v3")), **OPTIONS, tensor_parallel_size=2)
    core = llm.engine
    try:
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        llm.engine.add_request({"prompt_token_ids": [5, 6, 7]}, long)
        llm.engine.step()
        os.kill(core.executor.workers.pids[0], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerDied, match="tensor-parallel rank 1 .* exited with code -9"):
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        assert time.monotonic() - killed < 30
        with pytest.raises(WorkerDied):  # and it stays dead
            llm.engine.step()
    finally:
        core.close()


TORCHRUN_SCRIPT = """
import json, os, sys
from mlaserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher")
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]))
llm.engine.close()  # the process group goes before the interpreter exits: a rank left to atexit once aborted
"""


def test_torchrun_starts_the_ranks(tiny, tmp_path):
    import json

    model = tiny("deepseek_v2")
    ids = [p["prompt_token_ids"] for p in prompts()]
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own, not the default 29500
        "--nproc-per-node",
        "2",
        str(script),
        str(model),
    ]
    done = subprocess.run([*command, json.dumps(ids)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[:6000]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, done.stdout  # rank 1 served inside LLM(...) and ended there
    want = run(model)
    assert json.loads(lines[0][len("TOKENS ") :]) == [o.outputs[0].token_ids for o in want]


SERVE = textwrap.dedent(
    """
    import sys
    from mlaserve.server.run import serve
    from mlaserve.config.server_settings import ServerSettings
    options = dict(model=sys.argv[1], dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2,
                   enable_expert_parallel=sys.argv[2] == "ep")
    sys.exit(serve(options, ServerSettings(port=0, metrics_port=0, shutdown_grace_s=2.0)))
    """
)


@pytest.mark.parametrize(("name", "split"), [("deepseek_v3", "tp"), ("deepseek_v3", "ep"), ("llama", "tp")])
def test_server_at_tp2_answers_as_one_process_and_dies_with_a_rank(tiny, name, split):
    import re

    model = tiny(name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(model), split],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        url = pids = None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if found := re.search(r"ranks 1\+ pid (\d+(?:, \d+)*)", line):
                pids = [int(p) for p in found.group(1).split(", ")]
            if found := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                url = found.group(1)
        assert url and pids, "".join(lines)
        want = run(model)
        name = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": name, "prompt": prompts()[1]["prompt_token_ids"], "max_tokens": 10, "temperature": 0}
        body |= {"ignore_eos": True, "logprobs": 1}
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["text"] == want[1].outputs[0].text and len(choice["logprobs"]["token_logprobs"]) == 10
        expected = want[1].outputs[0].logprobs
        for got, step, token in zip(
            choice["logprobs"]["token_logprobs"], expected, want[1].outputs[0].token_ids
        ):
            assert abs(got - step[token].logprob) < 1e-4
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # a step notices the dead rank
        assert proc.wait(timeout=30) != 0
        assert time.monotonic() - killed < 30
        lines.extend(proc.stdout.read().splitlines(keepends=True))
        assert "tensor-parallel rank 1" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
