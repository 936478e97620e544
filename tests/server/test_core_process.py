"""The server on an engine core in its own process: the same answers as the offline API, stop strings found by the
server's own detokenizer, disconnects and aborts freeing blocks, and a dead core failing requests with a 503."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.core_client import CoreProcessClient
from tests.server.conftest import ENGINE_OPTIONS, serving, wait_for


@pytest.fixture(scope="module")
def client_and_offline(tiny_model):
    client = CoreProcessClient({"model": str(tiny_model), **ENGINE_OPTIONS})
    yield client, LLM(str(tiny_model), **ENGINE_OPTIONS)
    client.shutdown()


def test_the_process_core_answers_like_the_offline_api(client_and_offline):
    client, offline = client_and_offline
    prompts = ["w5 w6 w7", "w100 w3 w42"]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, logprobs=2), use_tqdm=False)
    with serving(client, served_model_name="tiny") as (live, _):
        api = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        got = api.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0, logprobs=2)
        assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
        streamed = ""
        for chunk in api.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stream=True
        ):
            streamed += chunk.choices[0].text if chunk.choices else ""
        assert streamed == want[0].outputs[0].text
        # A stop string is the server's to find: the text ends before it and the core stops the request.
        words = want[0].outputs[0].text.split(" ")
        first = next(
            i for i in range(1, len(words)) if words[i] not in words[:i]
        )  # a word's first appearance
        stop = " " + words[first]
        cut = api.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == " ".join(words[:first]) and cut.choices[0].finish_reason == "stop"
    assert wait_for(lambda: client.num_in_flight == 0 and client.stats()["kv_blocks_used"] == 0, timeout=5)


def test_a_client_that_leaves_frees_its_blocks(client_and_offline):
    client, _ = client_and_offline

    async def leave() -> None:
        body = {"prompt": "w5", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # leave after the first token

    with serving(client) as (live, _):
        asyncio.run(leave())
        assert wait_for(lambda: client.num_in_flight == 0, timeout=5)
        assert wait_for(lambda: client.stats()["kv_blocks_used"] == 0 and client.stats()["num_running"] == 0)


def test_a_dead_core_fails_requests_with_a_503(tiny_model):
    client = CoreProcessClient({"model": str(tiny_model), **ENGINE_OPTIONS})
    died = []
    client.on_death = lambda: died.append(True)
    try:
        with serving(client) as (live, _):
            os.kill(client.process.pid, signal.SIGKILL)
            assert wait_for(lambda: bool(died), timeout=5)
            assert httpx.get(f"{live.url}/health").status_code == 503
            r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "w5", "max_tokens": 2})
            assert r.status_code == 503
    finally:
        client.shutdown()


def test_a_core_that_cannot_start_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not start"):
        CoreProcessClient({"model": str(tiny_model_without_weights(tmp_path)), "device": "cpu"})


def tiny_model_without_weights(tmp_path):
    from mlaserve.testing.tiny_models import build_tiny

    path = build_tiny("llama", tmp_path / "broken")
    for f in path.glob("*.safetensors"):
        f.unlink()
    return path


def test_load_format_dummy_serves_a_model_from_its_config_alone(tmp_path):
    from mlaserve.config.deploy import load_deploy_config
    from mlaserve.config.deploy_overrides import overrides_from_flags
    from mlaserve.server.cli_args import add_serve_args

    path = tiny_model_without_weights(tmp_path)
    parser = __import__("argparse").ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        ["--model", str(path), "--load-format", "dummy", "--device", "cpu", "--port", "0"]
    )
    deploy = load_deploy_config(None, overrides_from_flags(vars(args)))
    options = deploy.engine_options()
    assert options["load_format"] == "dummy"
    client = CoreProcessClient({**options, "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128})
    try:
        with serving(client) as (live, _):
            r = httpx.post(
                f"{live.url}/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3}, timeout=30
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        client.shutdown()
    with pytest.raises(Exception, match="safetensors"):  # without dummy, the missing weights are an error
        load_deploy_config(None, {"model.path": str(path)})
