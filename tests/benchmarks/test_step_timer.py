"""benchmarks/step_timer.py counts exactly the decode-only steps of a run and leaves the engine as it found it."""

import importlib.util
from pathlib import Path

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

REPO = Path(__file__).resolve().parents[2]


def _load_step_timer():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_step_timer", REPO / "benchmarks" / "step_timer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_counts_decode_only_steps(tmp_path, async_scheduling):
    timer_cls = _load_step_timer().DecodeStepTimer
    path = str(build_tiny("llama", tmp_path / "m"))
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 9, 17, 30)]
    with timer_cls(llm.engine) as timer:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    # all four prompts fit one prefill step, which also samples each request's first token: 7 decode steps remain
    assert (timer.steps, timer.tokens) == (7, 4 * 7)
    assert timer.seconds > 0 and timer.tokens_per_s > 0
    # the engine's own methods are back: a plain run still works and is not counted
    llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert timer.tokens == 28 and "step" not in vars(llm.engine) and "_update" not in vars(llm.engine.core)
    assert timer.engine is None  # no reference that would keep the engine (and its KV cache) alive
