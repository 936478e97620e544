"""On two GPUs (skipped with fewer): DeepSeek-V3.2 at tensor parallelism 2 over NCCL, each rank selecting with the
Triton index-score kernel and attending over its selection with the paged decode kernel, its decode steps replayed
from CUDA graphs: one GPU's greedy tokens in float32, tensor or expert parallel, on an 8-bit cache and from DeepSeek's
block-FP8 layout; and under torchrun every rank caches the same indexer keys and selects the same slots (NCCL's
all-reduce must hand every rank the same hidden state for that).

The GPU image's transformers has no DeepseekV32 classes: the checkpoint is a tiny V3 with a random indexer added
(mlaserve/testing/v32_checkpoint.py), and one GPU is the reference; the CPU suite checks that against transformers.
"""

from pathlib import Path

import pytest
import torch

from mlaserve import LLM
from mlaserve.testing.fp8_checkpoint import save_block_fp8
from mlaserve.testing.tiny_models import build_tiny
from mlaserve.testing.v32_checkpoint import add_indexer
from tests.parallel.test_block_fp8_tp import TP_FRIENDLY
from tests.parallel.test_deepseek_v32_tp import TOPK, ranks_agree
from tests.parallel.test_tensor_parallel import PARAMS, prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

OPTIONS = dict(dtype="float32", device="cuda", attention_backend="triton_mla", max_model_len=128,
               max_num_batched_tokens=48, num_kv_blocks=64)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("v32_tp_gpu")
    v32 = add_indexer(build_tiny("deepseek_v3", tmp / "v3"), tmp / "v32", topk=TOPK)
    wide = add_indexer(build_tiny("deepseek_v3", tmp / "v3_wide", **TP_FRIENDLY), tmp / "v32_wide", topk=TOPK)
    return {"float": v32, "fp8": save_block_fp8(wide, tmp / "v32_fp8")}


def run(path: Path, **options: object) -> tuple[list, dict]:
    llm = LLM(str(path), **OPTIONS, **options)
    try:
        outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
        return outs, {**llm.stats(), "graphs": llm.engine.runner.graphs is not None}
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    ("model", "options", "tolerance"),
    [
        ("float", {}, 1e-4),
        ("float", {"enable_expert_parallel": True}, 1e-4),
        (
            "float",
            {"kv_cache_dtype": "fp8_e4m3"},
            2e-2,
        ),  # a rounding apart before the cast can be a step apart
        ("fp8", {}, 1e-3),
    ],
    ids=["tp2", "ep2", "tp2-fp8-cache", "fp8-checkpoint-tp2"],
)
def test_v32_on_two_gpus_gives_one_gpu_tokens(models, model, options, tolerance):
    got, stats = run(models[model], tensor_parallel_size=2, **options)
    assert stats["tensor_parallel_size"] == 2 and stats["graphs"] and stats["prefix_cache_hits"] > 0
    assert stats["attention_kernel"].startswith(f"sparse top-{TOPK}: triton index scores")
    want, _ = run(models[model], **{k: v for k, v in options.items() if k == "kv_cache_dtype"})
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want, got, strict=True):
        for token, x, y in zip(
            a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True
        ):
            assert abs(x[token].logprob - y[token].logprob) < tolerance


def test_every_gpu_rank_caches_the_same_keys_and_selects_the_same_slots(models, tmp_path):
    options = {k: v for k, v in OPTIONS.items() if k in ("dtype", "device", "attention_backend")}
    got = ranks_agree(models["float"], tmp_path, enforce_eager=True, **options)
    want, _ = run(models["float"])
    assert got == [o.outputs[0].token_ids for o in want]
