"""Decode-step kernels at batch 1 on one GPU, timed inside a CUDA graph (as the engine runs them), so the
microseconds are the kernels' and not Python's launch cost: the fused MoE's two grouped GEMMs with one pair per
tile (V2-Lite expert shapes, top-6) at several tile shapes, and the MLA decode kernel at a 576-token context with
the split count a CUDA graph sizes for max_model_len 4,096.

    python benchmarks/diagnose/small_batch_sweep.py OUT.json

Informs kernel defaults; the figures of record come from gpu_suite.py.
"""

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import LAT, bench, paged_case  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402
from mlaserve.kernels.moe.grouped_gemm import _grouped_gemm  # noqa: E402

E, HID, INTER, TOPK, REPEAT = 64, 2048, 1408, 6, 20


def graph_us(fn) -> float:
    """Median microseconds of one call, from a CUDA graph of REPEAT calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    return bench(graph.replay) * 1e3 / REPEAT


def moe_rows(gen: torch.Generator) -> list[dict]:
    w13 = torch.randn(E, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(E, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(1, HID, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randperm(E, generator=gen, device="cuda")[:TOPK].view(1, TOPK)
    hidden = torch.randn(TOPK, INTER, device="cuda", dtype=torch.bfloat16, generator=gen)
    route = torch.rand(TOPK, device="cuda", generator=gen)
    rows = []
    for stage, a, w, n, k, row_div, gated in (("w13", x, w13, INTER, HID, TOPK, True),
                                               ("w2", hidden, w2, HID, INTER, 1, False)):  # fmt: skip
        out = torch.empty(TOPK, n, device="cuda", dtype=torch.bfloat16)
        want = None
        for bn, bk, warps, stages in [(64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 256, 4, 3),
                                      (32, 128, 2, 4), (16, 128, 2, 4), (16, 256, 2, 3), (32, 64, 2, 6)]:  # fmt: skip

            def run(bn=bn, bk=bk, warps=warps, stages=stages, a=a, w=w, n=n, k=k, row_div=row_div, gated=gated,
                    out=out):  # fmt: skip
                _grouped_gemm[(TOPK, triton.cdiv(n, bn))](
                    a, w, out, ids, ids, route, TOPK, n, k,
                    a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                    ROW_DIV=row_div, MUL_ROUTE=not gated, GATED=gated, PAIR_TILES=True,
                    BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32", PDL=False, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip

            try:
                run()
                got = out.float().clone()
                want = got if want is None else want
                us = graph_us(run)
                nbytes = TOPK * w.shape[1] * k * 2
                row = dict(stage=stage, bn=bn, bk=bk, warps=warps, stages=stages, us=us,
                           weight_GBps=nbytes / us / 1e3, max_diff=(got - want).abs().max().item())  # fmt: skip
            except Exception as err:  # a tile that does not fit
                row = dict(stage=stage, bn=bn, bk=bk, warps=warps, stages=stages, error=str(err)[:160])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def decode_rows() -> list[dict]:
    q, cache, table, meta = paged_case(1, 16, [576], 64, torch.bfloat16, 0)
    rows = []
    want = None
    for kw in [dict(), dict(num_warps=4), dict(num_stages=2), dict(block_n=32, num_warps=4),
               dict(num_splits=4), dict(num_splits=9), dict(num_splits=9, num_warps=4)]:  # fmt: skip

        def run(kw=kw):
            return mla_decode_tuned(q, cache, table, meta.seq_lens, 4096, LAT, 1 / 192**0.5, **kw)

        got = run()[0].float()
        want = got if want is None else want
        row = dict(**kw, us=graph_us(run), max_diff=(got - want).abs().max().item())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "repeat_in_graph": REPEAT}
    for name, fn in (("moe_pair_tiles", lambda: moe_rows(gen)), ("mla_decode_batch1", decode_rows)):
        try:
            out[name] = fn()
        except Exception as err:  # keep the other section
            out[name] = {"error": repr(err)[:300]}
            print(name, repr(err), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
