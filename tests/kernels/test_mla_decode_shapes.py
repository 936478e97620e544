"""The general Triton decode kernel at shapes other than DeepSeek's (heads, latent rank and rotary width that are
not powers of two or are under 16, pages of 16 and 64) against the torch reference on fresh random inputs, under
TRITON_INTERPRET=1 on CPU at tiny sizes. The interpreter gets bf16 dots wrong, so 16-bit caches run in fp16 here
(tests/gpu covers bf16); 8-bit caches take bf16 and fp32 queries."""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.attention.metadata import build_metadata  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.kernels.mla_decode.decode import mla_decode  # noqa: E402
from mlaserve.kernels.mla_decode.reference import paged_latent_decode  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned  # noqa: E402
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows  # noqa: E402


def odd_case(seq_lens, heads, rank, rope, page, seed):
    """A float32 paged cache in shuffled pages, queries and a block table (one spare column of 0s)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 2
    cache = torch.randn(num_blocks, page, 1, rank + rope, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    for i in range(len(seq_lens)):
        table[i, : pages[i]] = torch.tensor([free.pop() for _ in range(pages[i])])
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen)
    meta = build_metadata(
        page, table, [1] * len(seq_lens), list(seq_lens), len(seq_lens), torch.zeros(0).long()
    )
    return q, cache, table, meta


def reference(q, cache, meta, rank, scale=0.3):
    out, lse = TorchBackend().decode(q.float(), cache, None, meta, scale, rank, need_lse=True)
    return out, lse


# (heads, kv_lora_rank, qk_rope_head_dim, page, sequence lengths)
SHAPES = [
    (1, 24, 8, 16, [1, 17, 40]),
    (5, 24, 8, 16, [33, 2]),
    (6, 32, 8, 64, [70, 5, 64]),
    (5, 96, 32, 64, [9, 130]),
    (40, 256, 32, 16, [20, 3]),  # MiniCPM3's widths: 40 heads (two groups of 32), rank 256, rope 32
]


@pytest.mark.parametrize("heads, rank, rope, page, seq_lens", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_general_kernel_matches_reference(heads, rank, rope, page, seq_lens, dtype):
    q, cache, table, meta = odd_case(seq_lens, heads, rank, rope, page, seed=heads + rank + page)
    q, cache = q.to(dtype), cache.to(dtype)
    assert decode_plan(q, cache, max(seq_lens), rank, rope).kernel == "triton"
    want, want_lse = reference(q, cache, meta, rank)
    got, lse = mla_decode(q, cache, table, meta.seq_lens, max(seq_lens), rank, 0.3)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "heads, rank, rope, page, seq_lens, tuning",
    [
        # tiles across pages (32 rows over pages of 16: the row-by-row lookup), several splits
        (5, 24, 8, 16, [40, 7, 1], {"block_n": 32, "num_splits": 3}),
        # the page looked up one tile ahead, the next tile prefetched
        (6, 32, 8, 64, [100, 3], {"block_n": 16, "page_ahead": True, "num_splits": 2}),
        (6, 32, 8, 64, [100, 3], {"block_n": 16, "prefetch": True, "num_splits": 2}),
        # more heads per program than there are, partials in bf16
        (3, 20, 0, 16, [18, 5], {"block_h": 32, "partial_dtype": torch.bfloat16}),
    ],
)
def test_general_kernel_loop_forms(heads, rank, rope, page, seq_lens, tuning):
    q, cache, table, meta = odd_case(seq_lens, heads, rank, rope, page, seed=rank + len(tuning))
    want, want_lse = reference(q, cache, meta, rank)
    got, lse = mla_decode_tuned(q, cache, table, meta.seq_lens, max(seq_lens), rank, 0.3, **tuning)
    tol = 2e-5 if "partial_dtype" not in tuning else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize(
    "heads, rank, rope, page, seq_lens, query",
    [
        (5, 24, 8, 16, [33, 2, 17], torch.float32),  # fp32 dots over the dequantized rows
        (6, 32, 8, 64, [70, 5], torch.bfloat16),  # fp16 dots, tiles widened by integer operations
        (5, 96, 32, 16, [40], torch.bfloat16),
    ],
)
def test_general_kernel_reads_8bit_rows(kv_dtype, heads, rank, rope, page, seq_lens, query):
    q, cache, table, meta = odd_case(seq_lens, heads, rank, rope, page, seed=rank + page)
    rows = quantize_rows(cache, QUANTIZED[kv_dtype])
    q = q.to(query)
    plan = decode_plan(q, rows, max(seq_lens), rank, rope)
    assert plan.kernel == "triton" and plan.q_f16 == (query != torch.float32)
    want, want_lse = reference(q, rows, meta, rank)
    got, lse = mla_decode(q, rows, table, meta.seq_lens, max(seq_lens), rank, 0.3)
    tol = 1e-4 if query == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_rows_past_the_ends_never_reach_the_result(kv_dtype):
    """Every row the sequences do not own holds NaN bytes (8-bit rows: values and scales), as a freed page's stale
    rows could: masked rows load as zeros, and p = 0 would not cancel a NaN value."""
    seq_lens, heads, rank, rope, page = [1, 15, 17, 33], 5, 24, 8, 16
    q, cache, table, meta = odd_case(seq_lens, heads, rank, rope, page, seed=5)
    if kv_dtype != "float32":
        cache = quantize_rows(cache, QUANTIZED[kv_dtype])
    want, want_lse = reference(q, cache, meta, rank)
    owned = torch.zeros(cache.shape[0] * page, dtype=torch.bool)
    owned[meta.decode_slot_index[meta.decode_mask]] = True
    cache.view(-1, cache.shape[-1]).view(torch.uint8)[~owned] = 0xFF
    got, lse = mla_decode_tuned(q, cache, table, meta.seq_lens, 64, rank, 0.3, num_splits=3)
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_torch_fallback_reads_block_tables_like_the_reference(kv_dtype):
    """The dispatcher's last resort (no Triton, or a shape no kernel takes) agrees with the reference backend."""
    seq_lens, heads, rank, rope, page = (
        [3, 40, 16],
        4,
        1100,
        8,
        16,
    )  # a latent wider than the Triton kernel takes
    q, cache, table, meta = odd_case(seq_lens, heads, rank, rope, page, seed=9)
    if kv_dtype != "float32":
        cache = quantize_rows(cache, QUANTIZED[kv_dtype])
    assert decode_plan(q, cache, 64, rank, rope).kernel == "torch reference"
    want, want_lse = reference(q, cache, meta, rank)
    got, lse = mla_decode(q, cache, table, meta.seq_lens, 64, rank, 0.3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    again, _ = paged_latent_decode(q[..., :rank], q[..., rank:], cache, table, meta.seq_lens, rank, 0.3)
    torch.testing.assert_close(again, got)


def test_a_tiny_odd_deepseek_runs_like_the_reference(tmp_path):
    """5 heads, rank 24, rope 8: once a Triton compile error on the GPU (tl.arange widths, dot sizes); on CPU the
    interpreter runs the same padded kernel. Tokens and logprobs match the torch backend; stats() names the kernel."""
    from mlaserve import LLM, SamplingParams
    from mlaserve.testing.tiny_models import build_tiny

    path = build_tiny("deepseek_v2", tmp_path, num_attention_heads=5, kv_lora_rank=24, qk_rope_head_dim=8,
                      hidden_size=80)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 9, 11, 40, 7]}, {"prompt_token_ids": [3] * 19}]
    outs, kernels = {}, {}
    for backend in ("torch", "triton_mla"):
        llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32, attention_backend=backend)
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        kernels[backend] = llm.stats()["attention_kernel"]
    assert kernels == {"torch": "torch reference", "triton_mla": "triton"}
    for ref, got in zip(outs["torch"], outs["triton_mla"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, have, tok in zip(
            ref.outputs[0].logprobs, got.outputs[0].logprobs, ref.outputs[0].token_ids
        ):
            assert abs(want[tok].logprob - have[tok].logprob) < 1e-4
