"""A script written for vLLM (n samples with a seed, Logprob objects read through .logprob / .rank /
.decoded_token) runs unchanged on mlaserve.LLM, and gives what the server answers for the same request."""

from __future__ import annotations

import math

import httpx
import pytest

from mlaserve import LLM, SamplingParams
from tests.server.conftest import ENGINE_OPTIONS, live_server, make_engine

PROMPT = "w3 w9 w27 w81 w5 w15 w45 w135 w17 w51"
REQUEST = dict(n=3, seed=1234, temperature=0.9, max_tokens=8, ignore_eos=True)


def vllm_style_script(llm: LLM) -> list[dict]:
    """What a vLLM user writes, kept to vLLM's public names."""
    params = SamplingParams(**REQUEST, logprobs=2, prompt_logprobs=2)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    prompt = []
    for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        own = entry[token_id]
        prompt.append((own.decoded_token, own.logprob, own.rank))
    choices = []
    for completion in out.outputs:
        steps = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            top = {lp.decoded_token: lp.logprob for lp in entry.values()}
            ranks = sorted(lp.rank for t, lp in entry.items() if t != token_id)
            steps.append(
                (entry[token_id].decoded_token, entry[token_id].logprob, entry[token_id].rank, top, ranks)
            )
        choices.append({"index": completion.index, "text": completion.text, "steps": steps, "prompt": prompt})
    return choices


@pytest.fixture(scope="module")
def served(tiny_model):
    engine = make_engine(tiny_model)
    for live, _ in live_server(engine, served_model_name="tiny"):
        yield live, engine
    engine.shutdown()


def test_vllm_script_runs_on_llm_and_matches_the_server(tiny_model, served):
    live, engine = served
    llm = LLM(str(tiny_model), **ENGINE_OPTIONS)
    offline = vllm_style_script(llm)
    assert [c["index"] for c in offline] == [0, 1, 2]
    assert len({c["text"] for c in offline}) == 3  # seed, seed + 1, seed + 2: three different samples
    assert llm.stats()["kv_blocks_used"] == 0

    body = {"model": "tiny", "prompt": PROMPT, **REQUEST, "logprobs": 2, "echo": True}
    answer = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    num_prompt = len(llm.get_tokenizer().encode(PROMPT))
    for want, got in zip(offline, choices, strict=True):
        assert got["text"] == PROMPT + want["text"]
        lp = got["logprobs"]
        # the echoed prompt: the same token texts and logprobs as prompt_logprobs' own tokens
        assert lp["token_logprobs"][0] is None
        for (text, value, rank), token, served_value in zip(
            want["prompt"], lp["tokens"][1:num_prompt], lp["token_logprobs"][1:num_prompt]
        ):
            assert text == token and math.isclose(value, served_value, abs_tol=1e-5) and rank >= 1
        # the generated tokens: decoded_token is the server's token, top_logprobs the same entries
        generated = zip(
            lp["tokens"][num_prompt:], lp["token_logprobs"][num_prompt:], lp["top_logprobs"][num_prompt:]
        )
        for (text, value, rank, top, ranks), (token, served_value, served_top) in zip(
            want["steps"], generated, strict=True
        ):
            assert text == token and math.isclose(value, served_value, abs_tol=1e-5)
            assert served_top.keys() == top.keys()
            assert all(math.isclose(top[k], served_top[k], abs_tol=1e-5) for k in top)
            # ranks: the top tokens are 1 and 2; the sampled one counts the tokens at least as likely
            assert set(ranks) <= {1, 2} and rank >= 1
            if rank <= 2:  # within the top two: its place among them
                assert rank == 1 + sum(v > value for v in top.values())
    assert engine.call(lambda e: e.stats()).result(timeout=10)["kv_blocks_used"] == 0
