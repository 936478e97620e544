"""Kernel sections: MLA decode against the torch reference on fresh paged caches (kernels), decode attention
timings with an optional tile sweep (decode), fused MoE against the per-expert loop (moe)."""

import json

import torch

from benchmarks.gpu_timing import bench, bench_graph
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows
from mlaserve.testing.paged_case import LAT, ROPE, paged_case


def kernels() -> dict:
    from mlaserve.kernels.mla_decode.decode import mla_decode

    results = []
    for batch, heads, page, seed in [
        (4, 16, 64, 0),
        (7, 128, 64, 1),
        (3, 20, 16, 2),
        (5, 16, 128, 3),
        (2, 96, 128, 4),
    ]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        q, cache, table, meta = paged_case(batch, heads, lengths, page, torch.bfloat16, seed)
        ref, ref_lse = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.1, LAT, need_lse=True)
        out, lse = mla_decode(q, cache, table, meta.seq_lens, max(lengths), LAT, 0.1)
        err = (out.float() - ref).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        results.append(dict(batch=batch, heads=heads, page=page, max_abs_err=err, lse_max_abs_err=lse_err))
        assert err < 2e-2 and lse_err < 1e-2, results[-1]
        for name, dtype in QUANTIZED.items():  # 8-bit rows: kernel vs reference reading the same rows
            rows8 = quantize_rows(cache, dtype)
            ref8, _ = TorchBackend().decode(q.float(), rows8, None, meta, 0.1, LAT, need_lse=True)
            out8, _ = mla_decode(q, rows8, table, meta.seq_lens, max(lengths), LAT, 0.1)
            results[-1][f"{name}_max_abs_err"] = (out8.float() - ref8).abs().max().item()
            # the kernel rounds dequantized values to bf16 before its dots; the reference stays in fp32
            assert results[-1][f"{name}_max_abs_err"] < 5e-2, results[-1]
    return {"cases": results, "tolerance": "bf16 inputs, fp32 reference: |out| err < 2e-2, |lse| err < 1e-2"}


def seesaw_rows(q, cache, table, seq_lens, length: int, scale: float, flops: int) -> dict:
    """The seesaw kernel (gluon_seesaw.py, off by default) at both of its tiles, by cp.async and by TMA, with and
    without prefetched scores (keys seesaw{32,64}[_tma][_prefetch]), beside the default kernel: ms and TFLOP/s from
    CUDA-graph replays, and its largest difference from the default kernel's output. A variant that fails to build
    or run is reported, not raised: the other sections still run."""
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned

    want, want_lse = mla_decode(q, cache, table, seq_lens, length, LAT, scale)
    row = {}
    variants = ((32, False, False), (64, False, False), (32, True, False), (64, True, False), (32, False, True),
                (32, True, True))  # fmt: skip
    for block_n, tma, prefetch in variants:
        key = f"seesaw{block_n}{'_tma' if tma else ''}{'_prefetch' if prefetch else ''}"
        try:
            call = lambda b=block_n, t=tma, p=prefetch: mla_decode_tuned(  # noqa: E731
                q,
                cache,
                table,
                seq_lens,
                length,
                LAT,
                scale,
                kernel="gluon_seesaw",
                block_n=b,
                tma=t,
                prefetch=p,
            )
            out, lse = call()
            row[f"{key}_max_diff"] = (out.float() - want.float()).abs().max().item()
            row[f"{key}_lse_max_diff"] = (lse - want_lse).abs().max().item()
            row[f"{key}_ms"] = bench_graph(call)
            row[f"{key}_TFLOPs"] = flops / row[f"{key}_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 - not yet run on a GPU: any failure is a finding to report
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def decode(ceil: dict, tune: bool) -> dict:
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned

    def time_case(batch: int, heads: int, length: int) -> dict:
        q, cache, table, meta = paged_case(batch, heads, [length] * batch, 64, torch.bfloat16, 0)
        scale = 1 / (192**0.5)
        t_triton = bench_graph(lambda: mla_decode(q, cache, table, meta.seq_lens, length, LAT, scale))
        t_eager = bench(lambda: mla_decode(q, cache, table, meta.seq_lens, length, LAT, scale))
        sweep = []
        if tune:  # the Triton kernel's tile (the Gluon kernels' tiles are fixed)
            args = (q, cache, table, meta.seq_lens, length, LAT, scale)
            for bh in [b for b in (16, 32, 64) if b <= max(16, heads)]:
                for bn in (32, 64):
                    for warps in (4, 8):
                        for stages in (1, 2, 3):
                            kw = dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)
                            try:
                                ms = bench(lambda kw=kw: mla_decode_tuned(*args, kernel="triton", **kw))
                            except Exception as e:  # out of shared memory / registers for this tile
                                ms = float("inf")
                                kw["error"] = type(e).__name__
                            sweep.append({**kw, "ms": ms})
            sweep.sort(key=lambda r: r["ms"])
        t_torch = bench(lambda: TorchBackend().decode(q, cache, None, meta, scale, LAT))
        bytes_read = batch * length * (LAT + ROPE) * 2
        flops = 2 * batch * heads * length * (LAT + ROPE + LAT)
        row = dict(B=batch, H=heads, L=length, triton_ms=t_triton, triton_eager_ms=t_eager, torch_ms=t_torch)
        row["best_configs"] = sweep[:3]
        row["triton_GBps"] = bytes_read / t_triton / 1e6
        row["triton_TFLOPs"] = flops / t_triton / 1e9
        row["torch_GBps"] = bytes_read / t_torch / 1e6
        row["pct_of_copy"] = 100 * row["triton_GBps"] / ceil["copy_GBps"] if ceil else None
        row["pct_of_gemm"] = 100 * row["triton_TFLOPs"] / ceil["bf16_gemm_TFLOPs"] if ceil else None
        # the Gluon split kernel (default on sm_90) against the Triton one it replaces there, and the seesaw one
        if heads > 16:
            row["split_kernel"] = decode_plan(q, cache, length, LAT, ROPE).kernel
            row["triton_kernel_ms"] = bench_graph(
                lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, length, LAT, scale, kernel="triton")
            )
            row["triton_kernel_TFLOPs"] = flops / row["triton_kernel_ms"] / 1e9
            row.update(seesaw_rows(q, cache, table, meta.seq_lens, length, scale, flops))
        if heads <= 16:  # memory-bound shapes: the 8-bit caches should take about half the time
            for name, dtype in QUANTIZED.items():
                rows8 = quantize_rows(cache, dtype)
                ms = bench_graph(lambda r=rows8: mla_decode(q, r, table, meta.seq_lens, length, LAT, scale))
                row[f"{name}_ms"] = ms
                row[f"{name}_vs_bf16"] = ms / t_triton
                if dtype == torch.float8_e4m3fn:  # the Gluon fp8 kernel (default on sm_90) against Triton's
                    row[f"{name}_split_kernel"] = decode_plan(q, rows8, length, LAT, ROPE).kernel
                    row[f"{name}_triton_kernel_ms"] = bench_graph(
                        lambda r=rows8: mla_decode_tuned(
                            q, r, table, meta.seq_lens, length, LAT, scale, kernel="triton"
                        )
                    )
                del rows8
        return row

    rows = []
    for batch, heads, length in [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192)]:
        rows.append(time_case(batch, heads, length))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "counting": "latent bytes read once; FLOPs 2*B*H*L*(576+512)",
        "timing": "triton_ms, triton_kernel_ms, seesaw*_ms (gluon_seesaw at 32- / 64-row tiles, _tma: by TMA) and the "
        "8-bit figures: CUDA-graph replays (bench_graph); triton_eager_ms and torch_ms: eager calls",
    }


def moe() -> dict:
    """Fused MoE vs the per-expert loop at DeepSeek-V2-Lite's expert shapes (64 experts, top-6, bf16)."""
    import torch.nn.functional as F

    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.moe import experts_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(64, 2 * 1408, 2048, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(64, 2048, 1408, generator=gen, device="cuda") * 0.02).bfloat16()
    rows = []
    for tokens in (1, 32, 512, 4096):
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
        logits = torch.randn(tokens, 64, generator=gen, device="cuda")
        weights, ids = logits.softmax(-1).topk(6, dim=-1)
        ref = experts_reference(x, w13, w2, weights, ids, F.silu)
        out = fused_experts(x, w13, w2, weights, ids, F.silu)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        t_fused = bench(lambda x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i, F.silu))
        t_ref = bench(lambda x=x, w=weights, i=ids: experts_reference(x, w13, w2, w, i, F.silu))
        rows.append(dict(tokens=tokens, rel_err=err, fused_ms=t_fused, reference_ms=t_ref))
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}
