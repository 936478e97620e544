"""vLLM's /tokenize, /detokenize, /tokenizer_info and /version, and vLLM's metric names, on a live server."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlaserve import __version__
from tests.server.conftest import live_server, make_engine, vllm_samples

KEY = "sk-tok"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = make_engine(tiny_model)
    for live, _ in live_server(engine, api_keys=(KEY,), served_model_name="tiny"):
        with httpx.Client(base_url=live.url, timeout=30) as client:
            yield client, engine
    engine.shutdown()


def test_tokenize_and_detokenize_round_trip(server):
    client, engine = server
    tokenizer = engine.engine.tokenizer
    r = client.post("/tokenize", json={"model": "tiny", "prompt": "w5 w6 w7"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer.encode("w5 w6 w7") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] is None
    bare = client.post(
        "/tokenize",
        json={"prompt": "w5", "add_special_tokens": False, "return_token_strs": True},
        headers=AUTH,
    )
    assert bare.json()["tokens"] == [5] and bare.json()["token_strs"] == ["w5"]
    back = client.post("/detokenize", json={"model": "tiny", "tokens": [5, 6, 7]}, headers=AUTH)
    assert back.status_code == 200 and back.json() == {"prompt": "w5 w6 w7"}


def test_tokenize_chat_messages_uses_the_template(server):
    client, engine = server
    messages = [{"role": "user", "content": "w30 w31"}]
    r = client.post("/tokenize", json={"messages": messages}, headers=AUTH).json()
    assert r["tokens"] == engine.engine.tokenizer.encode("w10 w30 w31 w11 w12", add_special_tokens=False)
    no_prompt = client.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}, headers=AUTH
    )
    tokenizer = engine.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert no_prompt.json()["count"] < r["count"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "w1", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "w1", "extra": 1}, "extra"),
        ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
        ("/detokenize", {"tokens": "w1"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_are_4xx(server, path, body, param):
    client, _ = server
    r = client.post(path, json=body, headers=AUTH)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_endpoints_take_the_api_key_and_version_does_not(server):
    client, _ = server
    assert client.post("/tokenize", json={"prompt": "w1"}).status_code == 401
    assert client.get("/tokenizer_info").status_code == 401
    assert client.get("/version").json() == {"version": __version__}


def test_tokenizer_info_is_what_lm_eval_reads(server):
    client, engine = server
    info = client.get("/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "w1" and info["bos_token"] == "w2"
    assert info["chat_template"] == engine.engine.tokenizer.chat_template
    assert info["model_max_length"] == 256


def test_vllm_named_metrics_count_a_request(server):
    client, engine = server
    before = vllm_samples(client.get("/metrics").text, "tiny")
    body = {"prompt": "w3 w4 w5", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    text = client.get("/metrics").text
    after = vllm_samples(text, "tiny")

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:request_success_total{finished_reason=length}") == 1
    assert grew("vllm:prompt_tokens_total") == 3 and grew("vllm:generation_tokens_total") == 5
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
        "vllm:request_params_n",
    ):
        assert grew(f"{histogram}_count") == 1, histogram
    assert grew("vllm:request_generation_tokens_sum") == 5
    assert grew("vllm:inter_token_latency_seconds_count") >= 1
    # the older names vLLM dashboards read: the same gaps, the same usage
    assert grew("vllm:time_per_output_token_seconds_count") == grew("vllm:inter_token_latency_seconds_count")
    assert grew("vllm:time_per_output_token_seconds_sum") == grew("vllm:inter_token_latency_seconds_sum")
    assert after["vllm:gpu_cache_usage_perc"] == after["vllm:kv_cache_usage_perc"]
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert "vllm:prefix_cache_queries_total" in after and "vllm:num_preemptions_total" in after
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:prompt_tokens"] == "counter" and types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:time_per_output_token_seconds"] == "histogram"
    assert types["vllm:gpu_cache_usage_perc"] == "gauge"
    info = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    assert info.samples[0].labels["block_size"] == str(engine.engine.config.cache.block_size)


def test_speculative_decoding_counts_under_vllms_names():
    """The draft counters appear when the engine speculates, from its stats, under vLLM's spec_decode names."""
    from prometheus_client import CollectorRegistry, generate_latest

    from mlaserve.server.metrics import _EngineCollector

    stats = {
        "speculative_decoding": True,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 9,
        "num_accepted_tokens_per_pos": [6, 3],
    }
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: stats, lambda: True, {"model_name": "tiny", "engine": "0"}))
    samples = vllm_samples(generate_latest(registry).decode(), "tiny")
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == 9
    text = generate_latest(registry).decode()
    family = next(
        f
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
    )
    per_pos = {s.labels["position"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert per_pos == {"0": 6.0, "1": 3.0} and family.type == "counter"
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: {}, lambda: True, {"model_name": "tiny", "engine": "0"}))
    assert "vllm:spec_decode_num_draft_tokens_total" not in generate_latest(registry).decode()
