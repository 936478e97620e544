"""On a GPU (skipped in CI): asynchronous scheduling with CUDA graphs and eager against the plain step loop on a
tiny DeepSeek model. The graph path is where a lookahead step takes its input tokens from the previous step's
device output through the staged source rows, which no CPU test reaches."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from tests.engine.test_async_scheduling import count_lookahead_launches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_matches_the_step_loop(tmp_path, monkeypatch, enforce_eager):
    path = build_tiny("deepseek_v2", tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()}
        for n in (1, 5, 17, 40, 64, 65, 100, 130)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 9, 33, 64, 70, 5, 40)
    ]
    params[3] = SamplingParams(temperature=0.8, top_k=20, max_tokens=33, seed=3, ignore_eos=True)
    launches = count_lookahead_launches(monkeypatch)
    runs = {}
    for flag in (False, True):
        # max_num_seqs 4: requests wait for room, so lookahead both runs and gives way to admissions.
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton_mla",
                  enforce_eager=enforce_eager, async_scheduling=flag, num_kv_blocks=64, block_size=64,
                  max_model_len=256, max_num_seqs=4)  # fmt: skip
        runs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["kv_blocks_used"] == 0
        del llm
    assert runs[True] == runs[False]
    assert launches[0] > 50


def test_async_bf16_with_prefill_graphs_matches_the_synchronous_graphs(tmp_path):
    """bf16, where prefill graphs are on: the same engine with and without lookahead runs the same graphs and
    kernels, so greedy tokens are identical; and the logprobs, computed at launch beside the sampling, are those
    of the synchronous run, though a graph replay queued ahead rewrites the logits buffer they come from."""
    path = build_tiny("deepseek_v2", tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (9, 64, 300)
    ]
    llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton_mla", num_kv_blocks=64,
              block_size=64, max_model_len=512)  # fmt: skip
    assert llm.engine.runner.prefill_graphs is not None and llm.engine.core.async_scheduling
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    fast = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    llm.engine.core.async_scheduling = False
    sync = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in sync]
    assert [o.outputs[0].logprobs for o in fast] == [o.outputs[0].logprobs for o in sync]
    assert llm.stats()["kv_blocks_used"] == 0
