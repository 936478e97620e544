"""On a GPU (skipped in CI): the Triton varlen prefill kernel (kernels/prefill_attn) compiled at DeepSeek's widths
and 128 heads against its torch reference: 2,048 new tokens over a 2,048-token prefix, uneven chunks with and
without a window, bf16 and fp16; then through the SDPA backend beside torch's flash varlen, and through the engine
(MLA's prefill with V at its own width) once TRITON_PREFILL_BY_DEFAULT is turned on."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sdpa import SdpaBackend
from mlaserve.kernels import registry
from mlaserve.kernels.prefill_attn.reference import prefill_attention_reference
from mlaserve.kernels.prefill_attn.tiles import TILE_CANDIDATES, head_split, shared_bytes
from mlaserve.kernels.prefill_attn.triton_prefill import (
    prefill_attention,
    prefill_attention_tiled,
    tile_facts,
)
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, QK, V = 128, 192, 128
SCALE = QK**-0.5


def offsets(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def random_qkv(query_lens, kv_lens, dtype, seed, heads=HEADS):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(query_lens), heads, QK, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(sum(kv_lens), heads, QK, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(sum(kv_lens), heads, V, device="cuda", generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "query_lens, kv_lens, window",
    [
        ([2048], [4096], None),  # 2k new tokens over a 2k prefix
        ([700, 1, 1347], [700, 300, 3000], None),  # uneven: a fresh prompt, one query over a prefix, a chunk
        ([700, 1, 1347], [700, 300, 3000], 1000),
    ],
)
def test_matches_reference_at_128_heads(query_lens, kv_lens, window, dtype):
    q, k, v = random_qkv(query_lens, kv_lens, dtype, sum(kv_lens) + (window or 0))
    cu_q, cu_k = offsets(query_lens), offsets(kv_lens)
    got, lse = prefill_attention(q, k, v, cu_q, cu_k, SCALE, window, return_lse=True)
    heads = [0, 1, 77, 127]  # the reference's float32 scores for 128 heads take too much memory at 4k keys
    want, want_lse = prefill_attention_reference(
        q[:, heads], k[:, heads], v[:, heads], cu_q, cu_k, SCALE, window, return_lse=True
    )
    torch.testing.assert_close(got[:, heads].float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[:, heads], want_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tile", TILE_CANDIDATES)
def test_every_candidate_tile_compiles_and_agrees(tile):
    """The tiles the benchmark sweeps: each builds on this GPU in bf16 and gives the reference's answer."""
    query_lens, kv_lens = [333, 1024], [1000, 1024]
    q, k, v = random_qkv(query_lens, kv_lens, torch.bfloat16, 11, heads=4)
    cu_q, cu_k = offsets(query_lens), offsets(kv_lens)
    got = prefill_attention_tiled(q, k, v, cu_q, cu_k, SCALE, tile=tile)[0]
    want = prefill_attention_reference(q, k, v, cu_q, cu_k, SCALE)[0]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    facts = tile_facts(q, k, v, cu_q, cu_k, tile)  # the benchmark's occupancy columns
    assert facts["registers"] > 0 and facts["shared_bytes"] <= shared_bytes(tile, head_split(QK, V), 2)


def test_float32_falls_down_the_ladder_and_matches():
    """float32 doubles the default tile's shared memory: the launch takes a smaller rung, with exact dots."""
    query_lens, kv_lens = [300, 64], [900, 64]
    q, k, v = random_qkv(query_lens, kv_lens, torch.float32, 3, heads=8)
    cu_q, cu_k = offsets(query_lens), offsets(kv_lens)
    got = prefill_attention(q, k, v, cu_q, cu_k, SCALE)[0]
    want = prefill_attention_reference(q, k, v, cu_q, cu_k, SCALE)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sdpa_backend_takes_it_once_turned_on(monkeypatch):
    query_lens, seq_lens = [2048, 512], [4096, 512]
    table = torch.arange(2 * 64, dtype=torch.int32, device="cuda").view(2, 64)
    meta = build_metadata(64, table, query_lens, seq_lens, 0, torch.zeros(1, dtype=torch.long, device="cuda"))
    q, k, v = random_qkv(query_lens, seq_lens, torch.bfloat16, 5)
    flash = SdpaBackend().prefill(q, k, v, meta, SCALE)
    monkeypatch.setattr(registry, "TRITON_PREFILL_BY_DEFAULT", True)
    assert SdpaBackend().prefill_pads_values(q, HEADS, V, meta) is False
    ours = SdpaBackend().prefill(q, k, v, meta, SCALE)
    assert ours.shape == flash.shape == (sum(query_lens), HEADS, V)
    torch.testing.assert_close(ours.float(), flash.float(), atol=2e-2, rtol=2e-2)


def test_engine_prefill_through_it(monkeypatch, tmp_path):
    """A tiny DeepSeek-V3 in float32 (exact dots: the same greedy tokens as the SDPA loop) and in bf16 with CUDA
    graphs (fresh prefills replay captured graphs, whose tile map is built on the device: runs and names the
    kernel); its prefill builds V at its own width for this kernel."""
    folder = build_tiny("deepseek_v3", tmp_path)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 77)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(device="cuda", num_kv_blocks=64, enforce_eager=True)
    want = [
        o.outputs[0].token_ids for o in LLM(str(folder), dtype="float32", **options).generate(prompts, params)
    ]
    monkeypatch.setattr(registry, "TRITON_PREFILL_BY_DEFAULT", True)
    llm = LLM(str(folder), dtype="float32", **options)
    assert llm.stats()["prefill_kernel"].startswith("triton varlen prefill")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    half = LLM(str(folder), dtype="bfloat16", device="cuda", num_kv_blocks=64)
    assert half.stats()["prefill_kernel"].startswith("triton varlen prefill")
    assert all(len(o.outputs[0].token_ids) == 8 for o in half.generate(prompts, params))
