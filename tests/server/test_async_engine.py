"""AsyncEngine on its own: streaming, abort on close, step failures, idle behaviour, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.async_engine import EngineDeadError, EngineStepError
from tests.server.conftest import ENGINE_OPTIONS, fresh_stats, make_engine, wait_for

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def engine(tiny_model, request):
    """Both step loops: asynchronous scheduling keeps a queued step between engine steps, which aborts, closed
    streams and failing steps must see through."""
    engine = make_engine(tiny_model, async_scheduling=request.param)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_generate_streams_cumulative_outputs_equal_to_offline(engine, tiny_model):
    outputs = asyncio.run(collect(engine, "w5 w6 w7", GREEDY, "r1"))
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    counts = [len(o.outputs[0].token_ids) for o in outputs]  # a slow reader may skip states, never reorder
    assert counts == sorted(set(counts)) and counts[-1] == 8
    want = LLM(str(tiny_model), **ENGINE_OPTIONS).generate("w5 w6 w7", GREEDY, use_tqdm=False)[0]
    assert outputs[-1].outputs[0].text == want.outputs[0].text
    assert engine.num_in_flight == 0


def test_bad_prompt_raises_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(collect(engine, "", GREEDY, "r1"))
    assert engine.num_in_flight == 0
    assert engine.is_alive


def test_closing_the_consumer_aborts_at_once_and_frees_blocks(engine):
    async def leave_early() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("w5 w6 w7", params, "r1")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()

    asyncio.run(leave_early())
    assert wait_for(lambda: engine.num_in_flight == 0, timeout=2)
    assert fresh_stats(engine)["kv_blocks_used"] == 0


def test_many_streams_with_n_requests_each(engine):
    async def run_all() -> list[list[str]]:
        async def one(i: int) -> list[str]:
            prepared = await engine.prepare(f"w{i + 3} w9", GREEDY)
            stream = engine.submit([prepared, prepared], [f"s{i}-0", f"s{i}-1"])
            last = {}
            async for out in stream:
                last[out.request_id] = last.get(out.request_id, []) + out.new_token_ids
            return [last[f"s{i}-0"], last[f"s{i}-1"]]

        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(run_all())
    assert all(a == b and a for a, b in results)
    assert engine.num_in_flight == 0


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(engine):
    real_step = engine.engine.core.step
    failures = {"left": 0}

    def flaky_step() -> list:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected")
        return real_step()

    engine.engine.core.step = flaky_step
    asyncio.run(collect(engine, "w4 w5 w6 w7 " * 8, GREEDY, "r0"))  # prefix-cache entries from before
    assert engine.engine.kv_manager.block_pool.num_cached_blocks > 0
    failures["left"] = 1
    with pytest.raises(EngineStepError, match="injected"):
        asyncio.run(collect(engine, "w5", GREEDY, "r1"))
    assert engine.is_alive
    assert isinstance(engine.last_error, RuntimeError)
    assert fresh_stats(engine)["kv_blocks_used"] == 0
    # A failed step may have offered blocks its forward never wrote: the cache forgets every entry.
    assert engine.engine.kv_manager.block_pool.num_cached_blocks == 0
    outputs = asyncio.run(collect(engine, "w5", GREEDY, "r2"))
    assert outputs[-1].finished


def test_a_step_that_always_fails_marks_the_engine_dead(engine):
    def broken_step() -> list:
        raise RuntimeError("broken")

    engine.engine.core.step = broken_step
    for i in range(3):
        with pytest.raises((EngineStepError, EngineDeadError)):
            asyncio.run(collect(engine, "w5", GREEDY, f"r{i}"))
    assert wait_for(lambda: not engine.is_alive, timeout=2)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "w5", GREEDY, "late"))


def test_idle_loop_blocks_instead_of_spinning(tiny_model):
    engine = make_engine(tiny_model)
    calls = {"n": 0}
    real = engine.engine.has_unfinished_requests

    def counting() -> bool:
        calls["n"] += 1
        return real()

    engine.engine.has_unfinished_requests = counting
    time.sleep(1.0)
    engine.shutdown()
    assert calls["n"] <= 10  # about two checks per idle_wait_s (0.5 s), not thousands


def test_shutdown_fails_requests_in_flight(tiny_model):
    engine = make_engine(tiny_model, step_delay_s=0.01)

    async def scenario() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("w5", params, "r1")
        await gen.__anext__()
        threading.Thread(target=engine.shutdown).start()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    asyncio.run(scenario())
    assert not engine.is_alive
    assert engine.stats()["kv_blocks_used"] == 0


def test_stats_snapshot_is_served_without_the_loop(engine):
    snapshot = engine.stats()
    assert snapshot["kv_blocks_used"] == 0 and snapshot["kv_blocks_total"] > 0
    snapshot["kv_blocks_used"] = 99  # a copy: the caller cannot corrupt it
    assert engine.stats()["kv_blocks_used"] == 0
