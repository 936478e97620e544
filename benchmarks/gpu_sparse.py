"""The GPU suite's `sparse` section: DeepSeek-V3.2's selection and sparse MLA against the torch reference, then
timed against dense decode over the same latent cache.

Shapes are V3.2's attention: 128 heads over a 512 + 64 latent row, an indexer of 64 heads x 128, top-k 2,048, pages
of 64, bf16. Correctness runs at 4,096-token contexts (the reference materialises every score); the timings at
65,536-token contexts, batch 32:
  dense_ms             absorbed MLA decode over every cached row (the dispatcher's kernel)
  index_scores_ms      the index-score kernel alone; topk_ms (topk_unsorted_ms) torch.topk on its scores, sorted (not)
  select_ms            index scores + top-k + slots (TritonMLABackend.select_topk)
  sparse_ms            the same queries over each sequence's 2,048 selected rows only (TritonMLABackend.sparse_latent)
  indexer_sparse_ms    select_ms's selection and then sparse_ms's attention
for a bf16 cache and for each 8-bit cache (latent and indexer keys both), all replayed from CUDA graphs.
The issue's targets: dense / sparse >= 16, dense / (indexer + sparse) >= 4.

    python -m benchmarks.gpu_suite --sections sparse --out benchmarks/results/h200-sparse-DATE.json
"""

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sparse import select_topk, sparse_latent_attention
from mlaserve.attention.triton_mla import TritonMLABackend
from mlaserve.kernels.index_topk import index_scores_paged
from mlaserve.kernels.mla_decode.decode import mla_decode
from mlaserve.kernels.mla_decode.tuning import decode_plan
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

LAT, ROPE, HEADS = 512, 64, 128
INDEX_HEADS, INDEX_DIM, TOPK, PAGE = 64, 128, 2048, 64


def case(batch: int, length: int, seed: int):
    """Latent and indexer-key caches of `batch` sequences of `length` tokens on shuffled pages, decode metadata,
    the absorbed queries and the indexer's queries and weights."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch * length // PAGE
    latent = torch.randn(pages + 1, PAGE, 1, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    keys = torch.randn(pages + 1, PAGE, 1, INDEX_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    order = (torch.randperm(pages, generator=gen, device="cuda") + 1).to(torch.int32)
    table = order.view(batch, length // PAGE)
    meta = build_metadata(PAGE, table, [1] * batch, [length] * batch, batch, torch.zeros(0, dtype=torch.long))
    q = torch.randn(batch, HEADS, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
    index_q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    weights = torch.randn(batch, INDEX_HEADS, generator=gen, device="cuda")
    positions = torch.full((batch,), length - 1, device="cuda")
    return latent, keys, table, meta, q, index_q, weights, positions


def check(backend: TritonMLABackend) -> dict:
    """Kernels against the torch reference on fresh random inputs (bf16 and both 8-bit caches)."""
    latent, keys, _, meta, q, index_q, weights, positions = case(4, 4096, seed=1)
    scale = 0.07
    want = select_topk(index_q.float(), weights, keys, meta, TOPK, INDEX_DIM**-0.5)
    got = backend.select_topk(index_q, weights, keys, meta, positions, TOPK, INDEX_DIM**-0.5)
    # The same sets, up to ties within bf16 rounding at the cut: compare the reference scores of what each picked.
    overlap = min(len(set(a.tolist()) & set(b.tolist())) / TOPK for a, b in zip(got, want))
    out = {"selection_min_overlap": overlap}
    assert overlap > 0.99, out
    ref = sparse_latent_attention(q[..., :LAT].float(), q[..., LAT:].float(), latent, want, scale, LAT)
    mine = backend.sparse_latent(q[..., :LAT], q[..., LAT:], latent, want, scale, LAT)
    out["sparse_bf16_max_abs_err"] = (mine.float() - ref).abs().max().item()
    for name, dtype in QUANTIZED.items():
        rows = quantize_rows(latent, dtype)
        ref8 = sparse_latent_attention(q[..., :LAT].float(), q[..., LAT:].float(), rows, want, scale, LAT)
        mine8 = backend.sparse_latent(q[..., :LAT], q[..., LAT:], rows, want, scale, LAT)
        out[f"sparse_{name}_max_abs_err"] = (mine8.float() - ref8).abs().max().item()
        keys8 = quantize_rows(keys, dtype)
        want8 = select_topk(index_q.float(), weights, keys8, meta, TOPK, INDEX_DIM**-0.5)
        got8 = backend.select_topk(index_q, weights, keys8, meta, positions, TOPK, INDEX_DIM**-0.5)
        out[f"selection_{name}_min_overlap"] = min(
            len(set(a.tolist()) & set(b.tolist())) / TOPK for a, b in zip(got8, want8)
        )
    assert out["sparse_bf16_max_abs_err"] < 2e-2, out
    assert all(out[f"sparse_{n}_max_abs_err"] < 5e-2 for n in QUANTIZED), out
    assert all(out[f"selection_{n}_min_overlap"] > 0.99 for n in QUANTIZED), out
    return out


def timings(
    backend: TritonMLABackend, bench_graph, cache_dtype: torch.dtype | None, tune: bool = False
) -> dict:
    """Dense decode, the selection's parts, sparse attention and indexer + sparse at 65,536-token contexts, batch 32,
    every one replayed from a CUDA graph as the engine's decode steps run; latent and indexer keys in the cache's
    dtype (16-bit: bf16; 8-bit: values plus the row scale). The bf16 run (every run with `tune`) also sweeps the
    index-score kernel's launch."""
    batch, length = 32, 65536
    latent, keys, table, meta, q, index_q, weights, positions = case(batch, length, seed=2)
    if cache_dtype is not None:
        latent, keys = quantize_rows(latent, cache_dtype), quantize_rows(keys, cache_dtype)
    scale, k_scale = 0.07, INDEX_DIM**-0.5
    q_lat, q_pe = q[..., :LAT], q[..., LAT:]
    visible = (positions + 1).to(torch.int32)
    rows = torch.arange(batch, device="cuda")
    select = lambda: backend.select_topk(index_q, weights, keys, meta, positions, TOPK, k_scale)  # noqa: E731
    slots = select()
    scores = index_scores_paged(index_q, weights, keys, table, rows, visible, length, k_scale)
    out = dict(
        dense_ms=bench_graph(lambda: mla_decode(q_lat, latent, table, meta.seq_lens, length, LAT, scale, q_pe=q_pe)),
        index_scores_ms=bench_graph(
            lambda: index_scores_paged(index_q, weights, keys, table, rows, visible, length, k_scale)
        ),
        topk_ms=bench_graph(lambda: scores.topk(TOPK, dim=-1)),
        topk_unsorted_ms=bench_graph(lambda: scores.topk(TOPK, dim=-1, sorted=False)),
        select_ms=bench_graph(select),
        sparse_ms=bench_graph(lambda: backend.sparse_latent(q_lat, q_pe, latent, slots, scale, LAT)),
        indexer_sparse_ms=bench_graph(lambda: backend.sparse_latent(q_lat, q_pe, latent, select(), scale, LAT)),
        dense_kernel=mla_decode_plan(q_lat, latent, length),
        sparse_kernel=mla_decode_plan(q_lat, latent.view(-1, 1, 1, latent.shape[-1]), TOPK),
    )  # fmt: skip
    if (
        cache_dtype is None or tune
    ):  # the index-score kernel's launch: (block_n, tiles, num_warps, stages) -> ms
        out["index_scores_sweep"] = {
            f"{n},{t},{w},{st}": bench_graph(
                lambda n=n, t=t, w=w, st=st: index_scores_paged(
                    index_q, weights, keys, table, rows, visible, length, k_scale, n, t, w, st
                )
            )
            for n in (64, 128)
            for t in (8, 16, 32)
            for w in (4, 8)
            for st in (1, 2, 3)
        }
    out["sparse_speedup"] = out["dense_ms"] / out["sparse_ms"]
    out["indexer_sparse_speedup"] = out["dense_ms"] / out["indexer_sparse_ms"]
    return out


def mla_decode_plan(q: torch.Tensor, cache: torch.Tensor, max_len: int) -> str:
    plan = decode_plan(q, cache, max_len, LAT, ROPE)
    return f"{plan.kernel}, {plan.num_splits} splits"


def sparse(bench, bench_graph) -> dict:
    backend = TritonMLABackend()
    result = {"check": check(backend)}
    result["shape"] = dict(batch=32, context=65536, topk=TOPK, heads=HEADS, latent=LAT, rope=ROPE,
                           index_heads=INDEX_HEADS, index_dim=INDEX_DIM, page=PAGE)  # fmt: skip
    for name, dtype in {"bf16": None, **QUANTIZED}.items():
        result[name] = timings(backend, bench_graph, dtype)
    result["targets"] = {"sparse_speedup": 16, "indexer_sparse_speedup": 4}
    result["timing"] = (
        "every figure a median of CUDA-graph replays with L2 emptied before each (gpu_timing.bench)"
    )
    return result
