"""8-bit caches at 128 heads: the dispatcher gives them the Triton kernel (64 heads per program, rows widened in
registers), which the sparse section timed 7-11x slower than the bf16 Gluon kernel. This times, on the same rows,
the Triton kernel, the 16-head widening Gluon kernel (gluon_wgmma8.py) run over 8 head groups, and the bf16
Gluon kernel over the bf16 rows; graph replays, each checked against the bf16 result first.

    python benchmarks/diagnose/many_heads_8bit.py
"""

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_suite import bench_graph  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402
from mlaserve.kvcache.quant import quantize_rows  # noqa: E402

LAT, ROPE, PAGE = 512, 64, 64


def decode(q: torch.Tensor, cache: torch.Tensor, table, lens, length: int, kernel: str) -> torch.Tensor:
    return mla_decode_tuned(
        q[..., :LAT], cache, table, lens, length, LAT, 0.07, q_pe=q[..., LAT:], kernel=kernel
    )[0]


def main() -> None:
    for batch, length in [(64, 4096), (32, 16384)]:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        blocks = batch * length // PAGE
        rows = torch.randn(blocks + 1, PAGE, 1, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
        table = (torch.randperm(blocks, generator=gen, device="cuda") + 1).to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 128, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
        fp8 = quantize_rows(rows, torch.float8_e4m3fn)
        want = decode(q, rows, table, lens, length, "gluon_wgmma").float()
        row = dict(batch=batch, context=length, heads=128)
        for name, cache, kernel in [("bf16_gluon_wgmma", rows, "gluon_wgmma"), ("fp8_triton", fp8, "triton"),
                                    ("fp8_gluon_wgmma8", fp8, "gluon_wgmma8")]:  # fmt: skip
            fn = functools.partial(decode, q, cache, table, lens, length, kernel)
            row[f"{name}_max_abs_diff"] = (fn().float() - want).abs().max().item()
            row[f"{name}_ms"] = bench_graph(fn)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
