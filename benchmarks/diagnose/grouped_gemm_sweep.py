"""Tile sweep on one GPU: the fused MoE's grouped GEMM (w13 at DeepSeek-V2-Lite's expert shapes) and the MLA decode
split count at small batches. Prints one JSON row per case and writes sweep.json to the folder given.

    python benchmarks/diagnose/grouped_gemm_sweep.py OUT_DIR

Informs kernel defaults; the timed figures of record come from gpu_suite.py. The decode rows at batch 1 are a few
tens of microseconds, where Triton's host-side launch cost shows in the timing: read them as launch-bound.
"""

import functools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import LAT, bench, paged_case  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402
from mlaserve.kernels.moe.grouped_gemm import _grouped_gemm  # noqa: E402
from mlaserve.kernels.moe.sort import sort_by_expert  # noqa: E402

out = {}
E, HID, INTER, TOPK = 64, 2048, 1408, 6
g = torch.Generator(device="cuda").manual_seed(0)
w13 = torch.randn(E, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
w2 = torch.randn(E, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02


def run(a, w, sorted_ids, tile_expert, num_pairs, row_div, bm, bn, bk, warps, stages):
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n, bn))
    _grouped_gemm[grid](
        a, w, c, sorted_ids, tile_expert, c, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        ROW_DIV=row_div, MUL_ROUTE=False, GATED=False, PAIR_TILES=False, PDL=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32",
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


rows = []
for tokens in (1, 32, 256, 4096):
    x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:TOPK] for _ in range(tokens)])
    pairs = tokens * TOPK
    for bm in (16, 64):
        sorted_ids, tile_expert = sort_by_expert(ids, E, bm)
        ref = None
        for bn, bk, warps, stages in [
            (64, 64, 4, 3),
            (128, 64, 4, 3),
            (64, 128, 4, 3),
            (128, 128, 8, 3),
            (64, 128, 4, 4),
            (32, 128, 4, 4),
            (128, 64, 8, 4),
            (256, 64, 8, 3),
        ]:
            try:
                c = run(x, w13, sorted_ids, tile_expert, pairs, TOPK, bm, bn, bk, warps, stages)
                if ref is None:
                    ref = c
                err = (c.float() - ref.float()).abs().max().item()
                ms = bench(
                    functools.partial(
                        run, x, w13, sorted_ids, tile_expert, pairs, TOPK, bm, bn, bk, warps, stages
                    )
                )
            except Exception as e:
                ms, err = f"{type(e).__name__}", None
            experts_hit = len(set(ids.flatten().tolist()))
            gbps = experts_hit * 2 * INTER * HID * 2 / ms / 1e6 if isinstance(ms, float) else None
            rows.append(
                dict(
                    tokens=tokens,
                    bm=bm,
                    bn=bn,
                    bk=bk,
                    warps=warps,
                    stages=stages,
                    w13_ms=ms,
                    weight_GBps=gbps,
                    err=err,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
out["grouped_gemm_w13"] = rows

drows = []
for batch, length in [(1, 576), (32, 576), (1, 4096)]:
    q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
    for splits in (1, 3, 5, 9, 18):
        ms = bench(
            functools.partial(
                mla_decode_tuned, q, cache, table, meta.seq_lens, length, LAT, 0.07, num_splits=splits
            )
        )
        drows.append(dict(batch=batch, length=length, splits=splits, ms=ms))
        print(json.dumps(drows[-1]), flush=True)
out["decode_splits_small_batch"] = drows
Path(sys.argv[1], "sweep.json").write_text(json.dumps(out, indent=1))
