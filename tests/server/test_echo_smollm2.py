"""The default model (SmolLM2) served with small prefill chunks and a warm prefix cache: the prompt logprobs that
/v1/completions returns with echo equal transformers' log-softmax over the same tokens within 1e-4 (float32)."""

from __future__ import annotations

import openai
import pytest
import torch

from mlaserve.config.engine_config import EngineConfig
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.engine.llm_engine import LLMEngine
from tests.server.conftest import live_server

pytestmark = pytest.mark.slow

TEXTS = [
    "The Eiffel Tower is in Paris. It was finished in 1889 and is made of wrought iron.",
    "Question: What is the boiling point of water at sea level?\nAnswer: 100 degrees Celsius.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]


@pytest.fixture(scope="module")
def client():
    options = dict(dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=64)
    options.update(enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True)
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(**options)))
    for live, _ in live_server(engine, served_model_name="smollm2"):
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0), engine
    engine.shutdown()


def test_echoed_prompt_logprobs_equal_transformers(client, hf_smollm2):
    reference = hf_smollm2
    client, engine = client
    # Warm the prefix cache with the same prompts: a cached prefix must not cost the logprobs asked for.
    client.completions.create(model="smollm2", prompt=TEXTS, max_tokens=1, temperature=0)
    hits = engine.stats()["prefix_cache_hits"]
    out = client.completions.create(
        model="smollm2", prompt=TEXTS, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    tokenizer = engine.engine.tokenizer
    worst = 0.0
    for text, choice in zip(TEXTS, out.choices):
        assert choice.text == text
        ids = tokenizer.encode(text)
        assert len(ids) > 16  # longer than one chunk
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            worst = max(worst, abs(got[i] - ref[i - 1, ids[i]].item()))
        # logprobs=1: the prompt's token and the model's top token; equal where the prompt was greedy.
        for i in range(1, len(ids)):
            top = max(choice.logprobs.top_logprobs[i].values())
            assert abs(top - ref[i - 1].max().item()) < 1e-4
    assert worst < 1e-4, worst
    assert engine.stats()["prefix_cache_hits"] == hits  # echo requests computed their whole prompt
