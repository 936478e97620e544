"""The GPU suite's fp8_tiles section: the W8A8 GEMMs at prefill sizes over a grid of tiles, to find the ones the
defaults should be (kernels/fp8_prefill.py's tile_for and block_m_for, kernels/moe/grouped_gemm.py's
fp8_tile_config, and whether the experts' gate and up GEMMs stay fused in one program with two accumulators).

Dense: three of gpu_fp8.DENSE_SHAPES' V3 projections at PREFILL_ROWS, each tile of DENSE_TILES at each of 64- and 128-row
blocks and each GROUP_M, beside bf16 cuBLAS and the dequantize + cuBLAS path. Fused MoE: gpu_fp8.MOE_SHAPES at
MOE_TOKENS, fp8_w8a8 sorted tiles at 64 and 128 rows, each tile of MOE_TILES, gate and up fused or not, beside
the bf16 experts. Every configuration is checked against the default configuration's output first (relative
error), then timed from a CUDA graph; a configuration that does not build is kept with its error.

    python -m benchmarks.gpu_suite --sections fp8_tiles --out benchmarks/results/h100-fp8-tiles-DATE.json
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.gpu_fp8 import DENSE_SHAPES, MOE_SHAPES, _bf16_linear
from benchmarks.gpu_fp8_paths import TIMING, _release, measure

PREFILL_ROWS = (1024, 4096)
MOE_TOKENS = (1024, 4096)
# (block_n, block_k, warps, stages) of the dense W8A8 GEMM; block_k stays one 128-wide scale group
DENSE_TILES = ((128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (256, 128, 8, 3), (64, 128, 4, 4))
GROUP_MS = (8,)
DENSE_NAMES = ("v3 q_b_proj", "v3 o_proj", "v3 dense gate_up")
MOE_TILES = ((128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4))


def fp8_tiles(
    bench_graph: Callable,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    dense_shapes: list[tuple[str, int, int]] | None = None,
    rows: tuple[int, ...] = PREFILL_ROWS,
    moe_shapes: list[tuple[str, int, int, int, int]] = MOE_SHAPES,
    moe_tokens: tuple[int, ...] = MOE_TOKENS,
) -> dict:
    """The section; device, dtype and the sizes are the suite's unless a CPU test shrinks them."""
    time_it = partial(bench_graph, **TIMING)
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = dense_shapes if dense_shapes is not None else [s for s in DENSE_SHAPES if s[0] in DENSE_NAMES]
    dense = [row for shape in shapes for row in _dense(shape, rows, gen, time_it, device, dtype)]
    _release(device)
    moe = [row for shape in moe_shapes for row in _moe(shape, moe_tokens, gen, time_it, device, dtype)]
    return {"dense": dense, "moe": moe, "best": _best(dense, moe)}


def _dense(shape, rows, gen, time_it, device, dtype) -> list[dict]:
    from mlaserve.kernels.block_fp8 import block_fp8_linear
    from mlaserve.kernels.fit import GemmTile
    from mlaserve.kernels.fp8_prefill import w8a8_linear
    from mlaserve.layers.block_fp8 import dequantize, quantize

    name, n, k = shape
    w, s = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5)
    bf16 = dequantize(w, s, 128).to(dtype)
    out_rows = []
    for m in rows:
        x = torch.randn(m, k, device=device, generator=gen, dtype=dtype)
        default = partial(block_fp8_linear, x, w, s, 128, path="w8a8")
        want = default()
        configs = {"bf16": measure(partial(_bf16_linear, x, bf16), want, time_it),
                   "dequant_cublas": measure(partial(block_fp8_linear, x, w, s, 128, path="dequant_cublas"), want, time_it),
                   "default": measure(default, want, time_it)}  # fmt: skip
        for block_m in (64, 128):
            for group_m in GROUP_MS:
                for tile in DENSE_TILES:
                    out = torch.empty(m, n, dtype=dtype, device=device)
                    call = partial(w8a8_linear, x, w, s, 128, None, out, tiles=(GemmTile(*tile),),
                                   block_m=block_m, group_m=group_m)  # fmt: skip
                    configs[f"m{block_m} g{group_m} {tile}"] = measure(call, want, time_it)
        row = {
            "shape": name,
            "N": n,
            "K": k,
            "rows": m,
            "configs": configs,
            **_fastest(configs, 2 * m * n * k),
        }
        print("fp8_tiles", json.dumps(row), flush=True)
        out_rows.append(row)
    return out_rows


def _moe(shape, tokens_list, gen, time_it, device, dtype) -> list[dict]:
    from mlaserve.kernels.fit import GemmTile
    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.kernels.moe.tiled import Fp8Scales, w8a8_tile_experts
    from mlaserve.layers.block_fp8 import dequantize, quantize

    name, experts, hidden, inter, top_k = shape

    def drawn(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(experts, -(-n // 128), -(-k // 128), device=device)
        for e in range(experts):
            w[e], s[e] = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        return w, s

    (w13, s13), (w2, s2) = drawn(2 * inter, hidden), drawn(hidden, inter)
    fp8 = Fp8Scales(s13, s2, 128)
    out_rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=dtype)
        ids = torch.stack(
            [torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)]
        )
        weights = torch.rand(tokens, top_k, device=device, generator=gen)
        route = (x, w13, w2, weights, ids, F.silu)
        default = partial(
            fused_experts, *route, w13_scale=s13, w2_scale=s2, group_n=128, kernel="fp8_w8a8_tiles"
        )
        want = default()
        configs = {"default": measure(default, want, time_it)}
        if (
            2 * (w13.numel() + w2.numel()) <= 8 << 30
        ):  # the bf16 yardstick where its copy fits beside the fp8 one
            b13, b2 = (
                dequantize(w13.flatten(0, 1), s13.flatten(0, 1), 128),
                dequantize(w2.flatten(0, 1), s2.flatten(0, 1), 128),
            )
            b13, b2 = b13.to(dtype).view_as(w13), b2.to(dtype).view_as(w2)
            configs["bf16"] = measure(partial(fused_experts, x, b13, b2, weights, ids, F.silu), want, time_it)
            b13 = b2 = None
        for block_m in (64, 128):
            for fuse_gate in (True, False):
                for tile in MOE_TILES:
                    call = partial(w8a8_tile_experts, *route, None, fp8, block_m, fuse_gate=fuse_gate,
                                   tiles=(GemmTile(*tile),))  # fmt: skip
                    configs[f"m{block_m} {'fused' if fuse_gate else 'split'} {tile}"] = measure(
                        call, want, time_it
                    )
        flops = 2 * tokens * top_k * 3 * hidden * inter
        row = {"shape": name, "tokens": tokens, "configs": configs, **_fastest(configs, flops)}
        print("fp8_tiles", json.dumps(row), flush=True)
        out_rows.append(row)
    w13 = w2 = s13 = s2 = fp8 = None
    _release(device)
    return out_rows


def _fastest(configs: dict[str, dict], flops: int) -> dict:
    """The quickest fp8 configuration within 5% relative error of the default's output, and its TFLOP/s."""
    timed = [
        (r["ms"], c) for c, r in configs.items() if "ms" in r and c != "bf16" and r["relative_error"] < 0.05
    ]
    if not timed:
        return {"fastest": None}
    ms, config = min(timed)
    found = {"fastest": config, "fastest_ms": ms, "fastest_TFLOPs": flops / ms / 1e9}
    if "ms" in configs.get("bf16", {}):
        found["bf16_over_fastest"] = configs["bf16"]["ms"] / ms
    return found


def _best(dense: list[dict], moe: list[dict]) -> dict:
    """Per configuration, its time summed over the rows it ran in, for dense and MoE apart: the defaults to take."""

    def totals(rows: list[dict]) -> list[tuple[str, float]]:
        sums: dict[str, float] = {}
        for row in rows:
            for config, r in row["configs"].items():
                if "ms" in r and config != "bf16":
                    sums[config] = sums.get(config, 0.0) + r["ms"]
        complete = {c: t for c, t in sums.items() if all("ms" in row["configs"].get(c, {}) for row in rows)}
        return sorted(complete.items(), key=lambda item: item[1])[:5]

    return {"dense": totals(dense), "moe": totals(moe)}
