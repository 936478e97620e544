"""Engine behaviour on tiny random models: preemption under a small KV budget, stats, sampling controls."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import config_dict

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def random_prompts(n: int, seed: int = 0, low: int = 8, high: int = 48) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(3, 250, (k,), generator=gen).tolist()} for k in lengths]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_small_kv_budget_preempts_and_finishes_everything(deepseek):
    prompts = random_prompts(32)
    big = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=512, max_model_len=128)
    want = tokens(big.generate(prompts, GREEDY, use_tqdm=False))
    # 12 blocks of 16 tokens: room for about three requests at a time.
    small = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=128)
    got = tokens(small.generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    assert all(len(t) == 32 for t in got)


def test_prefill_first_gives_the_same_tokens(llama):
    prompts = random_prompts(12, seed=3)
    options = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=40)
    want = tokens(LLM(str(llama), **options).generate(prompts, GREEDY, use_tqdm=False))
    engine = LLM(str(llama), prefill_first=True, num_kv_blocks=16, **options)  # short of blocks: preempts too
    assert tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_kv_bytes_per_token_is_the_latent_row(deepseek, llama):
    cfg = config_dict(deepseek)
    stats = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=64).stats()
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert stats["kv_bytes_per_token"] == cfg["num_hidden_layers"] * latent * 4
    per_head = cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    )
    assert stats["mha_kv_bytes_per_token"] == cfg["num_hidden_layers"] * per_head * 4
    for key in ("kv_blocks_total", "kv_blocks_used", "block_size", "attention_backend"):
        assert key in stats
    gqa = config_dict(llama)
    head_dim = gqa["hidden_size"] // gqa["num_attention_heads"]
    expected = gqa["num_hidden_layers"] * 2 * gqa["num_key_value_heads"] * head_dim * 4
    assert (
        LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=64).stats()["kv_bytes_per_token"]
        == expected
    )


def test_kv_budget_sets_block_count(llama):
    per_token = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=64).stats()["kv_bytes_per_token"]
    stats = LLM(str(llama), dtype="float32", device="cpu", kv_cache_memory_bytes=per_token * 16 * 40).stats()
    assert stats["kv_blocks_total"] == 40


def test_seed_reproducible_and_sampling_differs(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    prompt = random_prompts(1, seed=5)
    others = random_prompts(5, seed=6)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=123, ignore_eos=True)
    alone = tokens(llm.generate(prompt, seeded, use_tqdm=False))[0]
    mixed = llm.generate(
        others[:2] + prompt + others[2:],
        [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 2 + [seeded] + [GREEDY] * 3,
        use_tqdm=False,
    )
    assert tokens(mixed)[2] == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=124, ignore_eos=True)
    assert tokens(llm.generate(prompt, other_seed, use_tqdm=False))[0] != alone


def test_stop_token_ids_max_tokens_and_logprobs(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    prompt = random_prompts(1, seed=7)
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 32
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_at], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == len(out.outputs[0].token_ids) <= 4
    for lp, tok in zip(lps, out.outputs[0].token_ids):
        assert tok in lp and len(lp) >= 3
        assert max(v.logprob for v in lp.values()) == lp[tok].logprob  # greedy picks the most likely token
        assert lp[tok].rank == 1 and [v.rank for t, v in lp.items() if t != tok] == [2, 3]


def test_stop_strings_cut_the_text(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    prompt = random_prompts(1, seed=8)
    free = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    stop = words[3]
    first = free.text.index(stop)
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=32, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:first]
    assert llm.stats()["kv_blocks_used"] == 0


def test_text_prompts_and_eos(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    out = llm.generate(["w5 w6 w7"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt == "w5 w6 w7"
    assert out.prompt_token_ids[-3:] == [5, 6, 7]
    completion = out.outputs[0]
    if 1 in completion.token_ids:  # eos (w1) ends the request unless ignore_eos
        assert completion.token_ids[-1] == 1 and completion.finish_reason == "stop"


def test_dummy_load_format_builds_from_config_alone(deepseek):
    llm = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=32, load_format="dummy")
    out = llm.generate(
        random_prompts(2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert all(len(t) == 4 for t in tokens(out))


def test_step_streams_cumulative_outputs_and_holds_back_stop_prefixes(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    prompt = random_prompts(1, seed=9)[0]
    want = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    rid = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=["zzzz"])
    )
    texts, final = [], None
    while final is None:
        for out in engine.step():
            assert out.request_id == rid
            texts.append(out.outputs[0].text)
            if out.finished:
                final = out.outputs[0]
            else:
                assert len(out.outputs[0].text) <= len(want.text) - 0
                assert want.text.startswith(out.outputs[0].text)
                assert out.outputs[0].finish_reason is None
    assert final.text == want.text and final.token_ids == want.token_ids
    assert len(texts) == 32
    assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:]))


def test_step_without_stream_returns_finished_requests_only(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    prompts = random_prompts(2, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished_at = {}
    for step in range(1, 20):
        for out in engine.step(stream=False):
            assert out.finished
            finished_at[out.request_id] = (step, out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    assert finished_at[ids[0]] == (3, want[0]) and finished_at[ids[1]] == (9, want[1])
    assert llm.stats()["kv_blocks_used"] == 0


def test_abort_frees_blocks_and_reports(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", num_kv_blocks=128)
    engine = llm.engine
    rid = engine.add_request(random_prompts(1, seed=10)[0], GREEDY)
    engine.step()
    assert llm.stats()["kv_blocks_used"] > 0
    out = engine.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert llm.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request(rid) is None


def test_skip_tokenizer_init_takes_token_ids_only(deepseek):
    llm = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=32, skip_tokenizer_init=True)
    out = llm.generate(
        random_prompts(1), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["w3 w4"], use_tqdm=False)


@pytest.mark.slow
def test_mla_disable_caches_per_head_kv_with_the_same_tokens(deepseek, llama):
    cfg = config_dict(deepseek)
    prompts = random_prompts(4, seed=11)
    latent = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=64)
    expanded = LLM(str(deepseek), dtype="float32", device="cpu", num_kv_blocks=64, mla_disable=True)
    assert tokens(expanded.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
        latent.generate(prompts, GREEDY, use_tqdm=False)
    )
    per_head = cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    )
    assert expanded.stats()["kv_bytes_per_token"] == cfg["num_hidden_layers"] * per_head * 4
    assert expanded.stats()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="mla_disable applies to MLA models only"):
        LLM(str(llama), device="cpu", num_kv_blocks=16, mla_disable=True)
