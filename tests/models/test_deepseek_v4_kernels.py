"""DeepSeek-V4 with the triton_mla backend: its decode steps attend on the paged Triton kernels (attention/v4_decode.py;
under TRITON_INTERPRET=1 on CPU here) and give transformers' greedy tokens and logprobs, batched and through a
captured step's inputs, with prompts and outputs past the window and past top-k x rate."""

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_sliding_window import check_against_reference, prompts
from tests.models.test_deepseek_v4 import OPTIONS, StaticDecodeOnCPU

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return build_tiny("deepseek_v4", tmp_path_factory.mktemp("v4"))


def generate(llm: LLM, batch: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


@pytest.mark.slow  # the interpreter: minutes on CPU
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured_inputs"])
def test_v4_decode_on_the_kernels_equals_transformers(v4, captured):
    llm = LLM(
        str(v4), **OPTIONS, block_size=4, num_kv_blocks=256, max_model_len=128, attention_backend="triton_mla"
    )
    if captured:
        static = llm.engine.runner.graphs = StaticDecodeOnCPU(llm.engine.runner, 128)
    batch = prompts(3, seed=5, low=10, high=50)
    outs = generate(llm, batch)
    check_against_reference(v4, batch, outs)
    if captured:
        assert static.steps >= 23
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "backend, kernels, named",
    [("triton_mla", True, "triton over the window's rows"), ("torch", False, "torch reference"),
     ("sdpa", False, "torch reference")],
)  # fmt: skip
def test_which_decode_each_backend_runs_and_stats_name_it(v4, backend, kernels, named):
    llm = LLM(str(v4), **OPTIONS, num_kv_blocks=64, attention_backend=backend)
    assert all(layer.attn.on_kernels == kernels for layer in llm.engine.executor.model.model.layers)
    assert llm.stats()["attention_kernel"].startswith(named)
