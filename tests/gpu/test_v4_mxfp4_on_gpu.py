"""On a GPU (skipped in CI): DeepSeek-V4 in V4-Flash's published layout (block-FP8 projections, MXFP4 routed experts)
gives the CPU's tokens in float32, its routed experts in the weight-only MXFP4 grouped GEMM
(kernels/moe/mxfp4_gemm.py) and its decode steps captured in CUDA graphs and eagerly; in bf16 its logprobs stay
near the float32 run's.

Random float weights drawn on the CPU are rewritten by the test-checkpoint writer (testing/v4_checkpoint.py), so
both devices read the same published bytes; the config is tests/gpu/test_v4_on_gpu.py's, spelled out for a
transformers without DeepseekV4Config.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from mlaserve import LLM, SamplingParams
from mlaserve.testing.v4_checkpoint import save_v4_published
from tests.gpu.test_v4_on_gpu import V4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
OPTIONS = dict(skip_tokenizer_init=True, num_kv_blocks=96, block_size=16, max_model_len=256)


def generate(llm: LLM) -> list:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 40, 120)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.outputs[0] for o in outs]


def test_published_v4_on_cuda_gives_the_cpu_tokens(tmp_path):
    source, published = tmp_path / "float", tmp_path / "published"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(V4))
    cpu = LLM(str(source), device="cpu", load_format="dummy", seed=3, dtype="float32", **OPTIONS)
    weights = {name: t.contiguous() for name, t in cpu.engine.executor.model.state_dict().items()}
    save_file(weights, str(source / "model.safetensors"))
    save_v4_published(source, published)
    want = generate(LLM(str(published), device="cpu", dtype="float32", **OPTIONS))
    graphs = LLM(str(published), device="cuda", dtype="float32", **OPTIONS)
    assert graphs.engine.runner.graphs is not None
    assert graphs.stats()["weight_bytes_by_kind"]["mxfp4"] > 0
    assert [o.token_ids for o in generate(graphs)] == [o.token_ids for o in want]
    del graphs
    eager = LLM(str(published), device="cuda", dtype="float32", enforce_eager=True, **OPTIONS)
    assert [o.token_ids for o in generate(eager)] == [o.token_ids for o in want]
    del eager
    bf16 = generate(LLM(str(published), device="cuda", dtype="bfloat16", **OPTIONS))
    for ours, ref in zip(bf16, want, strict=True):
        for step, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)):
            if a != b:  # bf16 may take the other side of a near-tie; compare up to there
                break
            assert abs(ours.logprobs[step][a].logprob - ref.logprobs[step][b].logprob) < 0.1, step


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_published_v4_with_experts_split_by_width_over_two_gpus_gives_one_gpus_tokens(tmp_path):
    """Each rank's MXFP4 experts are half of every expert's width (w2's packed columns and scales cut on a scale
    group), run in the grouped GEMM; the ranks' partial sums meet in the MoE layer's all-reduce over NCCL. Widths
    whose row-split inputs hold whole 128-column FP8 blocks per rank (wo_b's 2 x 128, the shared expert's 256)."""
    wide = {**V4, "o_lora_rank": 128, "moe_intermediate_size": 256}
    source, published = tmp_path / "float", tmp_path / "published"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(wide))
    cpu = LLM(str(source), device="cpu", load_format="dummy", seed=3, dtype="float32", **OPTIONS)
    weights = {name: t.contiguous() for name, t in cpu.engine.executor.model.state_dict().items()}
    save_file(weights, str(source / "model.safetensors"))
    del cpu
    save_v4_published(source, published)
    one = LLM(str(published), device="cuda", dtype="float32", **OPTIONS)
    want = generate(one)
    del one
    torch.cuda.empty_cache()
    split = LLM(str(published), device="cuda", dtype="float32", tensor_parallel_size=2, **OPTIONS)
    try:
        experts = split.engine.executor.model.model.layers[1].ffn.experts  # rank 0's
        assert experts.inter == 128 and experts.w13.is_cuda
        assert split.stats()["tensor_parallel_size"] == 2
        got = generate(split)
    finally:
        split.engine.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for ours, ref in zip(got, want, strict=True):
        for step, token in enumerate(ref.token_ids):
            assert abs(ours.logprobs[step][token].logprob - ref.logprobs[step][token].logprob) < 1e-4, step
