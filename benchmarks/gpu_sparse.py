"""The GPU suite's `sparse` section: DeepSeek-V3.2's selection and sparse MLA against the torch reference, then
timed against dense decode over the same latent cache.

Shapes are V3.2's attention: 128 heads over a 512 + 64 latent row, an indexer of 64 heads x 128, top-k 2,048, pages
of 64, bf16. Correctness runs at 4,096-token contexts (the reference materialises every score); the timings at
65,536-token contexts, batch 32:
  dense_ms             absorbed MLA decode over every cached row (the dispatcher's kernel), CUDA-graph replays
  sparse_ms            the same queries over each sequence's 2,048 selected rows only (TritonMLABackend.sparse_latent)
  indexer_sparse_ms    index scores + top-k (TritonMLABackend.select_topk) and then sparse_ms's attention
The issue's targets: dense / sparse >= 16, dense / (indexer + sparse) >= 4.

    python benchmarks/gpu_suite.py --sections sparse --out benchmarks/results/h200-sparse-DATE.json
"""

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.attention.sparse import select_topk, sparse_latent_attention
from mlaserve.attention.triton.mla_decode import mla_decode
from mlaserve.attention.triton_mla import TritonMLABackend
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


def sparse(bench, bench_graph) -> dict:
    backend = TritonMLABackend()
    result = {"check": check(backend)}
    batch, length = 32, 65536
    latent, keys, table, meta, q, index_q, weights, positions = case(batch, length, seed=2)
    scale = 0.07
    q_lat, q_pe = q[..., :LAT], q[..., LAT:]
    dense_ms = bench_graph(
        lambda: mla_decode(q_lat, latent, table, meta.seq_lens, length, LAT, scale, q_pe=q_pe)
    )
    slots = backend.select_topk(index_q, weights, keys, meta, positions, TOPK, INDEX_DIM**-0.5)
    sparse_ms = bench_graph(lambda: backend.sparse_latent(q_lat, q_pe, latent, slots, scale, LAT))
    select_ms = bench(
        lambda: backend.select_topk(index_q, weights, keys, meta, positions, TOPK, INDEX_DIM**-0.5)
    )
    both_ms = bench(
        lambda: backend.sparse_latent(
            q_lat, q_pe, latent,
            backend.select_topk(index_q, weights, keys, meta, positions, TOPK, INDEX_DIM**-0.5), scale, LAT,
        )
    )  # fmt: skip
    result.update(
        shape=dict(batch=batch, context=length, topk=TOPK, heads=HEADS, latent=LAT, rope=ROPE,
                   index_heads=INDEX_HEADS, index_dim=INDEX_DIM, page=PAGE, dtype="bfloat16"),  # fmt: skip
        dense_ms=dense_ms, sparse_ms=sparse_ms, select_ms=select_ms, indexer_sparse_ms=both_ms,
        sparse_speedup=dense_ms / sparse_ms, indexer_sparse_speedup=dense_ms / both_ms,
        targets={"sparse_speedup": 16, "indexer_sparse_speedup": 4},
        timing="dense_ms and sparse_ms: CUDA-graph replays; select_ms and indexer_sparse_ms: eager calls",
    )  # fmt: skip
    return result
