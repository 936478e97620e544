"""Asynchronous scheduling (the next decode step queued before this step's tokens are read) against the plain
step loop on tiny models: the same tokens, stops and finish reasons, and no block left behind."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.runner.model_runner import ModelRunner


def prompts(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (n,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(3, 250, (k,), generator=gen).tolist()} for k in lengths]


def completions(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]


def count_lookahead_launches(monkeypatch) -> list[int]:
    launches = [0]
    original = ModelRunner.launch

    def launch(self, output, previous=None):
        launches[0] += previous is not None
        return original(self, output, previous)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    return launches


def engines(path, **kwargs) -> dict[bool, LLM]:
    base = dict(dtype="float32", device="cpu", num_kv_blocks=96, max_model_len=96) | kwargs
    return {flag: LLM(str(path), async_scheduling=flag, **base) for flag in (False, True)}


@pytest.mark.slow
def test_same_outputs_with_mixed_sampling_and_stops(llama, monkeypatch):
    llms = engines(llama)
    batch = prompts(10, seed=1)
    # Stop conditions that fire mid-run, so lookahead rows of finished requests get thrown away: a stop token
    # and a stop string taken from a free run, max_tokens of 1 and 2, EOS, seeded sampling.
    free = llms[False].generate(
        batch[:2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), False
    )
    stop_token = free[0].outputs[0].token_ids[6]
    stop_text = free[1].outputs[0].text.split()[4]
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_text], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=20, seed=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=17, seed=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    want = completions(llms[False].generate(batch, params, use_tqdm=False))
    launches = count_lookahead_launches(monkeypatch)
    got = completions(llms[True].generate(batch, params, use_tqdm=False))
    assert got == want
    assert want[0][1] == "stop" and want[1][1] == "stop"
    assert launches[0] > 20  # most decode steps were queued ahead
    assert llms[True].stats()["kv_blocks_used"] == 0 and llms[True].engine.core._in_flight is None


def test_same_outputs_under_preemption_and_with_logprobs(deepseek, monkeypatch):
    # 12 blocks of 16: about three requests at a time, so lookahead meets a short pool and waiting requests.
    llms = engines(deepseek, num_kv_blocks=12)
    batch = prompts(8, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = completions(llms[False].generate(batch, greedy, use_tqdm=False))
    launches = count_lookahead_launches(monkeypatch)
    assert completions(llms[True].generate(batch, greedy, use_tqdm=False)) == want
    assert launches[0] > 0 and llms[True].stats()["kv_blocks_used"] == 0
    # Logprobs are computed on the device with the sampling and copied out with the ids: those steps are queued
    # ahead too, beside rows that ask for none, and every row gets the values of the plain loop.
    launches[0] = 0
    with_lp = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=n) for n in (2, None, 0, 5)
    ]
    sync = llms[False].generate(batch[:4], with_lp, use_tqdm=False)
    got = llms[True].generate(batch[:4], with_lp, use_tqdm=False)
    assert completions(got) == completions(sync) and launches[0] > 0
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in sync]
    assert got[1].outputs[0].logprobs is None and len(got[3].outputs[0].logprobs[0]) >= 5


def test_prefill_first_queues_the_decode_after_the_last_prompt(llama, monkeypatch):
    """Prefill-first with a small budget: each step after a prompt-only step (whose siblings already hold their
    first tokens) is queued ahead with rows of both kinds, and the tokens stay those of the plain loop."""
    llms = engines(llama, prefill_first=True, max_num_batched_tokens=40)
    batch = prompts(8, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = completions(llms[False].generate(batch, params, use_tqdm=False))
    mixed = [0]
    original = ModelRunner.launch

    def launch(self, output, previous=None):
        kinds = {s.lookahead for s in output.scheduled}
        mixed[0] += previous is not None and kinds == {False, True}
        return original(self, output, previous)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    assert completions(llms[True].generate(batch, params, use_tqdm=False)) == want
    assert mixed[0] > 0
    assert llms[True].stats()["kv_blocks_used"] == 0 and llms[True].engine.core._in_flight is None


def test_abort_and_new_requests_while_a_step_is_in_flight(llama):
    llms = engines(llama)
    batch = prompts(3, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = completions(llms[False].generate(batch, params, use_tqdm=False))
    engine = llms[True].engine
    ids = [engine.add_request(p, params) for p in batch[:2]]
    finished = {}
    for _ in range(3):
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    assert engine.core._in_flight is not None
    aborted = engine.abort_request(ids[1])  # its row in the queued step is skipped
    assert aborted.outputs[0].finish_reason == "abort"
    late = engine.add_request(batch[2], params)  # joins once the queued step has been collected
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            finished[out.request_id] = out
    assert set(finished) == {ids[0], late}
    assert completions([finished[ids[0]], finished[late]]) == [want[0], want[2]]
    assert engine.stats()["kv_blocks_used"] == 0 and engine.core._in_flight is None


def test_prompt_chunks_and_admissions_are_queued_ahead(deepseek, monkeypatch):
    """More requests than seats and a small token budget: most steps carry prompt chunks while requests wait. Those
    steps are queued ahead too, with decode rows whose input is on the device beside prompt rows whose tokens are
    known, and the tokens stay those of the plain loop."""
    llms = engines(deepseek, max_num_seqs=3, max_num_batched_tokens=24)
    batch = prompts(7, seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = completions(llms[False].generate(batch, params, use_tqdm=False))
    kinds = {"mixed": 0, "admission": 0, "chunk": 0}
    original = ModelRunner.launch

    def launch(self, output, previous=None):
        if previous is not None:
            rows = output.scheduled
            sampling = {s.request.request_id for s in previous.output.scheduled if s.needs_sample}
            prompt_rows = [s for s in rows if s.num_new_tokens > 1]
            kinds["mixed"] += any(s.lookahead for s in rows) and bool(prompt_rows)
            kinds["admission"] += any(s.num_computed_tokens == 0 for s in prompt_rows)
            kinds["chunk"] += any(
                s.num_computed_tokens > 0 and s.request.request_id not in sampling for s in prompt_rows
            )
        return original(self, output, previous)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    assert completions(llms[True].generate(batch, params, use_tqdm=False)) == want
    assert all(kinds.values()), kinds
    assert llms[True].stats()["kv_blocks_used"] == 0 and llms[True].engine.core._in_flight is None


def test_min_tokens_and_penalty_rows_are_queued_ahead(llama, monkeypatch):
    """min_tokens reads how many tokens a request holds and the penalties which ones: a step queued ahead counts
    the token still being sampled (on the device). EOS, pushed up by logit_bias, stays banned exactly as long as
    in the plain loop; penalised rows pick the plain loop's tokens; and those steps are queued ahead."""
    llms = engines(llama)
    batch = prompts(6, seed=6)
    eos = llms[False].get_tokenizer().eos_token_id
    params = [
        SamplingParams(temperature=0, min_tokens=n, max_tokens=12, logit_bias={eos: 50.0})
        for n in (1, 3, 6, 9)
    ] + [
        # logit_bias makes token 50 the first choice until the penalties for having used it outweigh it: a row
        # queued ahead that missed the token still being sampled would pick it twice in a row
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            presence_penalty=2,
            frequency_penalty=2,
            logit_bias={50: 3.0},
        ),
        SamplingParams(temperature=0.9, seed=4, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
    ]
    want = completions(llms[False].generate(batch, params, use_tqdm=False))
    assert [len(ids) for ids, _, _ in want[:4]] == [2, 4, 7, 10] and {f for _, f, _ in want[:4]} == {"stop"}
    assert want[4][0][0] == 50 and want[4][0][1] != 50
    launches = count_lookahead_launches(monkeypatch)
    assert completions(llms[True].generate(batch, params, use_tqdm=False)) == want
    assert launches[0] >= 10  # none while these fields kept steps from being queued ahead
