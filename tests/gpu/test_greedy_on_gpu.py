"""On a GPU (skipped in CI): the triton_mla backend, eager and with CUDA graphs, against the torch reference backend
on tiny DeepSeek models. Run with `python -m pytest tests/gpu` on the GPU machine.

float32: tokens identical and logprobs within 1e-3 (the kernels run IEEE fp32 dots), bf16 and 8-bit caches alike.
bfloat16 tolerance: where the greedy runs first differ, the two tokens must be within 0.1 nats under the
reference's own logprobs at that step (a near-tie that bf16 rounding breaks either way); 0.3 with an 8-bit cache,
where a rounding difference can move a cached value by a whole e4m3 step (EIGHT_BIT_TIE_NATS). Only the DeepSeek-V2
config is held to that: in the tiny DeepSeek-V3 config, group-limited sigmoid routing sits on near-tied expert
scores, so a bf16 rounding difference in attention can flip an expert and move a later token by a whole nat
(seen: 1.05 nats at token 16), while the same model in float32 matches to 2e-6.
"""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TIE_NATS = 0.1
# With an 8-bit cache a rounding difference upstream can move a cached value across an e4m3 step (6-12%), so the
# runs part at larger gaps: on CPU, the tiny DeepSeek-V2 of test_mla_shapes_on_gpu.py (5 heads, rank 24, rope 8)
# in bf16 with the fp8 cache first leaves its float32 run (same cache) at token 8 of the 120-token prompt by 0.248
# nats, at two commits alike (a diagnosis script, in git history); on the H200 its bf16 Triton run left the bf16
# torch run there by 0.18.
EIGHT_BIT_TIE_NATS = 0.3


def tie_nats(kv_cache_dtype: str) -> float:
    """How far apart, under the reference's logprobs, two bf16 runs' first differing tokens may be."""
    return TIE_NATS if kv_cache_dtype == "auto" else EIGHT_BIT_TIE_NATS


VARIANTS = (("ref", "torch", True), ("eager", "triton_mla", True), ("graphs", "triton_mla", False))


def run_variants(path, dtype: str, kv_cache_dtype: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (1, 7, 40, 120)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20)
    runs = {}
    for label, backend, eager in VARIANTS:
        llm = LLM(str(path), dtype=dtype, device="cuda", attention_backend=backend, enforce_eager=eager,
                  kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, block_size=64, max_model_len=256)  # fmt: skip
        runs[label] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["kv_blocks_used"] == 0
        del llm
    return runs


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8"])
def test_float32_identical(tmp_path, name, kv_cache_dtype):
    runs = run_variants(build_tiny(name, tmp_path), "float32", kv_cache_dtype)
    for label in ("eager", "graphs"):
        for ref, got in zip(runs["ref"], runs[label]):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids, label
            for want, have, tok in zip(
                ref.outputs[0].logprobs, got.outputs[0].logprobs, ref.outputs[0].token_ids
            ):
                assert abs(want[tok].logprob - have[tok].logprob) < 1e-3, label


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_bfloat16_differs_only_at_near_ties(tmp_path, kv_cache_dtype):
    runs = run_variants(build_tiny("deepseek_v2", tmp_path), "bfloat16", kv_cache_dtype)
    for label in ("eager", "graphs"):
        for ref, got in zip(runs["ref"], runs[label]):
            want, have = ref.outputs[0].token_ids, got.outputs[0].token_ids
            first = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
            if first is None:
                continue
            step = ref.outputs[0].logprobs[first]
            assert have[first] in step, (
                f"{label}: token {have[first]} not in the reference's top 20 at {first}"
            )
            gap = step[want[first]].logprob - step[have[first]].logprob
            assert gap < tie_nats(kv_cache_dtype), (
                f"{label}: not a near-tie at token {first} (gap {gap:.3f} nats)"
            )
