"""On a GPU (skipped in CI): fresh prefills replayed from CUDA graphs (runner/prefill_graphs.py) against the same
engine run eagerly, bf16, on a tiny DeepSeek-V2 model: the first token's logprobs agree to bf16 rounding (padding
changes GEMM shapes, so kernels may sum in another order) and greedy tokens agree except at near-ties."""

import pytest
import torch

from mlaserve import LLM, Logprob, SamplingParams
from mlaserve.runner.prefill_graphs import PrefillGraphs
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefill_graphs_match_eager(tmp_path, monkeypatch, kv_cache_dtype):
    path = build_tiny("deepseek_v2", tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()}
        for n in (1, 7, 64, 65, 200, 400)
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    replays = [0]
    run = PrefillGraphs.run

    def counted(self, batch):
        replays[0] += 1
        return run(self, batch)

    monkeypatch.setattr(PrefillGraphs, "run", counted)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype="bfloat16", device="cuda", attention_backend="triton_mla", enforce_eager=eager,
                  kv_cache_dtype=kv_cache_dtype, num_kv_blocks=128, block_size=64, max_model_len=512)  # fmt: skip
        # One at a time (one sequence plus padding), then the five longer ones in one step. A 1-token prompt is
        # ordered as a decode (one query token) and runs in the decode graph, and a step holding one is eager.
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        llm.engine.kv_manager.reset_prefix_cache()
        outs[eager] = alone + llm.generate(prompts[1:], params, use_tqdm=False)
        assert llm.stats()["kv_blocks_used"] == 0
        del llm
    assert replays[0] == len(prompts)  # five alone and the batch of five
    for ref, got in zip(outs[True], outs[False]):
        want, have = ref.outputs[0], got.outputs[0]
        first = want.token_ids[0]
        assert (
            abs(want.logprobs[0][first].logprob - have.logprobs[0].get(first, Logprob(-1e9)).logprob) < 0.05
        )
        diff = next((i for i, (a, b) in enumerate(zip(want.token_ids, have.token_ids)) if a != b), None)
        if diff is not None:
            step = want.logprobs[diff]
            assert (
                have.token_ids[diff] in step
                and step[want.token_ids[diff]].logprob - step[have.token_ids[diff]].logprob < 0.1
            )
