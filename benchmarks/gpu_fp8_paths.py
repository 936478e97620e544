"""The GPU suite's fp8_paths section: every block-FP8 path forced at every batch size, so the tables that choose
between them (kernels/block_fp8.py's row thresholds, kernels/moe/dispatch.py's W8A8_PAIRS_PER_EXPERT) can be set
from one run.

Dense, each of gpu_fp8.DENSE_SHAPES at rows 1 to 4,096: w8a16 (the decode kernels, to 128 rows), w8a8 (the Triton
GEMM; and w8a8_fused_quant, quantizing inside it), torch_blockwise (torch._scaled_mm's blockwise scaling, where this
torch and GPU pass its check), dequant_cublas (the weight dequantized per call, then cuBLAS), and bf16 weights as
the yardstick. Beside ours, the peers of benchmarks/fp8_peers.py (FlashInfer's sm_90 block-scaled GEMM through the
table's own flashinfer_blockscale path, DeepGEMM's fp8_gemm_nt), each where it imports and runs; else each of its
rows holds the reason as its error. Fused MoE at gpu_fp8.MOE_SHAPES, 1 to 4,096 tokens: bf16 experts, fp8 W8A16
tiles, fp8 W8A8 tiles, and (where the bf16 copy is small enough to sit in a captured graph's memory) the experts
dequantized per call then run as bf16 experts.
Every path is first checked against its torch reference (layers/block_fp8.linear_reference, moe.experts_reference;
with quantized activations for the W8A8 paths) and its relative error kept; a path that raises is kept with its
error and not timed. Then each is timed from a CUDA graph (gpu_timing.bench_graph, shorter runs than the default to
keep the section to a few minutes). Per row: the fastest fp8 path whose error is within MAX_ERROR, the fastest of
ours, each peer's speed over that (peer_over_ours, above 1 where the peer wins), and the table's own choice; at
the end the row thresholds those winners suggest.

    python -m benchmarks.gpu_suite --sections ceilings,fp8_paths --out benchmarks/results/h100-fp8-paths-DATE.json

With the peers, their wheels in .whl-peer (benchmarks/fp8_peers.py says how to make them) installed first; the first
run on a fresh machine also builds FlashInfer's module with nvcc, which its GPU test does on its own:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peer \
        .whl-peer/*.whl
    export PYTHONPATH=/tmp/peer:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST=9.0
    python -m pytest -q tests/kernels/test_fp8_flashinfer.py
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.fp8_peers import PEER_PATHS, peer_call, peer_checks
from benchmarks.gpu_fp8 import DENSE_SHAPES, MOE_SHAPES, _bf16_linear, _relative_error

PATH_ROWS = (1, 4, 8, 16, 32, 64, 128, 512, 4096)
MOE_TOKENS = (1, 8, 32, 128, 512, 4096)
OUR_DENSE_PATHS = ("w8a16", "w8a8", "w8a8_fused_quant", "torch_blockwise", "dequant_cublas")
DENSE_FP8_PATHS = OUR_DENSE_PATHS + PEER_PATHS
MOE_PATHS = ("bf16", "fp8_w8a16", "fp8_w8a8", "fp8_dequant_bf16")
MOE_FP8_PATHS = MOE_PATHS[1:]
# Dequantizing experts per call allocates their bf16 copy inside the captured graph's memory pool; past this many
# bytes (V3's 22 GB would sit beside the bf16 experts already held) the candidate is skipped.
MOE_DEQUANT_MAX_BYTES = 4 << 30
W8A8_KINDS = frozenset({"w8a8", "w8a8_fused_quant", "torch_blockwise", "fp8_w8a8", *PEER_PATHS})
# A path further than this from its reference (max abs error over max abs output) is never the fastest: W8A8's
# activation rounding is a few 1e-2 at most on these random inputs.
MAX_ERROR = 0.1
# The per-expert reference loop is slow, not wrong, past this many tokens; larger batches are checked against the
# bf16 experts only.
MOE_REFERENCE_MAX_TOKENS = 128
TIMING = {"warmup_ms": 10, "rep_ms": 40}
# W8A16's taller row tiles are a candidate for small batches; past this many rows the weight is no longer the cost.
W8A16_BENCH_MAX_ROWS = 128


def _dense_call(path: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> Callable[[], torch.Tensor]:
    from mlaserve.kernels.block_fp8 import block_fp8_linear

    if path == "w8a8_fused_quant":
        return partial(block_fp8_linear, x, w, s, 128, path="w8a8", fuse_quant=True)
    if path in PEER_PATHS:
        return peer_call(path, x, w, s)
    return partial(block_fp8_linear, x, w, s, 128, path=path)


def measure(call: Callable[[], torch.Tensor], want: torch.Tensor, time_it: Callable) -> dict:
    """{"relative_error", "ms"} of a call checked against `want` then timed; {"error": ...} where it raised."""
    try:
        error = _relative_error(call(), want)
        return {"relative_error": error, "ms": time_it(call)}
    except Exception as e:  # noqa: BLE001 - a path that cannot run is a finding, not a reason to stop
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def fastest(paths: dict[str, dict], candidates: tuple[str, ...]) -> str | None:
    """The quickest of `candidates` that ran within MAX_ERROR of its reference."""
    timed = [(r["ms"], p) for p, r in paths.items() if p in candidates and "ms" in r]
    timed = [(ms, p) for ms, p in timed if paths[p]["relative_error"] <= MAX_ERROR]
    return min(timed)[1] if timed else None


def winners_by_rows(rows: list[dict], key: str) -> dict[int, dict[str, int]]:
    """For each row count (or token count, by `key`), how many shapes each path won."""
    counts: dict[int, Counter] = {}
    for row in rows:
        if row["fastest"] is not None:
            counts.setdefault(row[key], Counter())[row["fastest"]] += 1
    return {n: dict(c) for n, c in sorted(counts.items())}


def smallest_from_which(winners: dict[int, dict[str, int]], path: str) -> int | None:
    """The smallest row count from which `path` won most shapes at every larger count measured; None if it never
    held the largest."""
    found = None
    for n in sorted(winners, reverse=True):
        counts = winners[n]
        if counts.get(path, 0) * 2 <= sum(counts.values()):
            break
        found = n
    return found


def largest_up_to_which(winners: dict[int, dict[str, int]], path: str) -> int | None:
    """The largest row count up to which `path` won most shapes at every smaller count measured."""
    found = None
    for n in sorted(winners):
        counts = winners[n]
        if counts.get(path, 0) * 2 <= sum(counts.values()):
            break
        found = n
    return found


def suggestions(dense_winners: dict, moe_rows: list[dict]) -> dict:
    """The table constants the winners point to (None: the path never won from some size on)."""
    moe_winners = winners_by_rows([r | {"fastest": r["fastest_fp8"]} for r in moe_rows], "pairs_per_expert")
    return {
        "W8A16_MAX_ROWS": largest_up_to_which(dense_winners, "w8a16"),
        "TORCH_BLOCKWISE_MIN_ROWS": smallest_from_which(dense_winners, "torch_blockwise"),
        "DEQUANT_MIN_ROWS": smallest_from_which(dense_winners, "dequant_cublas"),
        "FLASHINFER_MIN_ROWS": smallest_from_which(dense_winners, "flashinfer_blockscale"),
        # where it won most shapes, to set FLASHINFER_MIN_ROWS and FLASHINFER_MAX_ROWS by hand if that is a middle band
        "flashinfer_won_most_at_rows": [
            n for n, c in dense_winners.items() if c.get("flashinfer_blockscale", 0) * 2 > sum(c.values())
        ],
        "W8A8_FUSED_QUANT_MIN_ROWS": smallest_from_which(dense_winners, "w8a8_fused_quant"),
        "W8A8_PAIRS_PER_EXPERT": smallest_from_which(moe_winners, "fp8_w8a8"),
        "MOE_DEQUANT_PAIRS_PER_EXPERT": smallest_from_which(moe_winners, "fp8_dequant_bf16"),
    }


def fp8_paths(
    ceilings: dict,
    bench_graph: Callable,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    dense_shapes: list[tuple[str, int, int]] = DENSE_SHAPES,
    path_rows: tuple[int, ...] = PATH_ROWS,
    moe_shapes: list[tuple[str, int, int, int, int]] = MOE_SHAPES,
    moe_tokens: tuple[int, ...] = MOE_TOKENS,
) -> dict:
    """The section; device, dtype and the sizes are the suite's unless a CPU test shrinks them."""
    from mlaserve.kernels.block_fp8 import dense_path
    from mlaserve.kernels.fp8_torch import blockwise_check
    from mlaserve.layers.block_fp8 import dequantize, linear_reference, quantize

    if not ceilings:
        raise ValueError("the fp8_paths section needs the ceilings section in the same run")
    time_it = partial(bench_graph, **TIMING)
    checks = {"skipped": "not CUDA"}
    peers = {p: "skipped: not CUDA" for p in PEER_PATHS}
    if device == "cuda":
        here = torch.device("cuda", torch.cuda.current_device())
        checks = {f"group_n {g}": blockwise_check(here, g) for g in (1, 128)}
        peers = peer_checks(here)
    print("fp8_paths torch blockwise check", json.dumps(checks), flush=True)
    print("fp8_paths peers", json.dumps(peers), flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    dense = []
    for name, n, k in dense_shapes:
        w, s = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        bf16 = dequantize(w, s, 128).to(dtype)
        for rows in path_rows:
            x = torch.randn(rows, k, device=device, generator=gen, dtype=dtype)
            plain = linear_reference(x, w, s, 128)
            quantized = linear_reference(x, w, s, 128, quantize_activations=True)
            paths = {"bf16": measure(partial(_bf16_linear, x, bf16), plain, time_it)}
            for path in DENSE_FP8_PATHS:
                if path == "w8a16" and rows > W8A16_BENCH_MAX_ROWS:
                    continue
                want = quantized if path in W8A8_KINDS else plain
                paths[path] = measure(_dense_call(path, x, w, s), want, time_it)
            row = {"shape": name, "N": n, "K": k, "rows": rows, "table": dense_path(x, w, 128), "paths": paths,
                   "fastest": fastest(paths, DENSE_FP8_PATHS), "fastest_ours": fastest(paths, OUR_DENSE_PATHS),
                   "peer_over_ours": peer_over_ours(paths)}  # fmt: skip
            if row["fastest"] is not None:
                ms = paths[row["fastest"]]["ms"]
                # the weight's bytes over the copy ceiling (what bounds decode), FLOPs (what bounds prefill)
                row["fastest_pct_of_copy"] = (
                    100 * (w.numel() + 4 * s.numel()) / ms / 1e6 / ceilings["copy_GBps"]
                )
                row["fastest_TFLOPs"] = 2 * rows * n * k / ms / 1e9
                if "ms" in paths["bf16"]:
                    row["bf16_over_fastest"] = paths["bf16"]["ms"] / ms
            if "ms" in paths.get(row["table"], {}) and "ms" in paths["bf16"]:
                row["bf16_over_table"] = paths["bf16"]["ms"] / paths[row["table"]]["ms"]
            print(json.dumps(row), flush=True)
            dense.append(row)
        w = s = bf16 = None
        _release(device)
    dense_winners = winners_by_rows(dense, "rows")
    print("fp8_paths dense winners by rows", json.dumps(dense_winners), flush=True)
    moe = _moe_paths(gen, time_it, device, dtype, moe_shapes, moe_tokens)
    suggested = suggestions(dense_winners, moe)
    print("fp8_paths suggested", json.dumps(suggested), flush=True)
    peer_wins = {p: winners_by_rows([r | {"fastest": p} for r in dense if r["peer_over_ours"].get(p, 0) > 1], "rows")
                 for p in PEER_PATHS}  # fmt: skip
    print("fp8_paths peer wins by rows", json.dumps(peer_wins), flush=True)
    return {
        "torch_blockwise_check": checks,
        "peers": peers,
        "dense": dense,
        "peer_wins_by_rows": peer_wins,
        "dense_winners_by_rows": dense_winners,
        "moe": moe,
        "suggested": suggested,
    }


def peer_over_ours(paths: dict[str, dict]) -> dict[str, float]:
    """For each peer that ran within MAX_ERROR: the fastest of our paths' time over the peer's (above 1: it wins)."""
    ours = fastest(paths, OUR_DENSE_PATHS)
    if ours is None:
        return {}
    return {p: paths[ours]["ms"] / paths[p]["ms"] for p in PEER_PATHS if fastest(paths, (p,)) == p}


def _release(device: str) -> None:
    """Memory of the shape just measured back to the device before the next is drawn."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _moe_paths(
    gen: torch.Generator,
    time_it: Callable,
    device: str,
    dtype: torch.dtype,
    moe_shapes: list[tuple[str, int, int, int, int]],
    moe_tokens: tuple[int, ...],
) -> list[dict]:
    from mlaserve.kernels.kernel import first
    from mlaserve.kernels.moe.dispatch import MOE_KERNELS, fused_experts, pair_tiles_pay
    from mlaserve.kernels.moe.tiled import Fp8Scales
    from mlaserve.layers.block_fp8 import dequantize, quantize
    from mlaserve.layers.moe import experts_reference

    def experts_fp8(count: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = torch.empty(count, n, k, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(count, -(-n // 128), -(-k // 128), device=device)
        b = torch.empty(count, n, k, dtype=dtype, device=device)
        for e in range(count):  # one expert at a time: float32 draws of all of V3's would not fit beside them
            w[e], s[e] = quantize(torch.randn(n, k, device=device, generator=gen) / k**0.5)
            b[e] = dequantize(w[e], s[e], 128)
        return w, s, b

    rows = []
    for name, experts, hidden, inter, top_k in moe_shapes:
        w13, s13, b13 = experts_fp8(experts, 2 * inter, hidden)
        w2, s2, b2 = experts_fp8(experts, hidden, inter)
        scales = {"w13_scale": s13, "w2_scale": s2, "group_n": 128}
        for tokens in moe_tokens:
            x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=dtype)
            ids = torch.stack(
                [torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)]
            )
            weights = torch.rand(tokens, top_k, device=device, generator=gen)
            route = (x, w13, w2, weights, ids, F.silu)
            w8a16 = "pair_tiles" if pair_tiles_pay(ids.numel(), experts) else "sorted_tiles"
            calls = {
                "bf16": partial(fused_experts, x, b13, b2, weights, ids, F.silu),
                "fp8_w8a16": partial(fused_experts, *route, kernel=w8a16, **scales),
                "fp8_w8a8": partial(fused_experts, *route, kernel="fp8_w8a8_tiles", **scales),
            }
            bf16_out = calls["bf16"]()
            refs = {False: bf16_out, True: bf16_out}
            if tokens <= MOE_REFERENCE_MAX_TOKENS:
                refs = {q: experts_reference(x, b13, b2, weights, ids, F.silu, quantize_activations=q)
                        for q in (False, True)}  # fmt: skip
            dequant_bytes = 2 * (w13.numel() + w2.numel())
            whole_blocks = w13.shape[1] % 128 == 0 and w2.shape[1] % 128 == 0
            if dequant_bytes <= MOE_DEQUANT_MAX_BYTES and whole_blocks:
                calls["fp8_dequant_bf16"] = partial(_dequant_experts, x, w13, s13, w2, s2, weights, ids)
            paths = {p: measure(calls[p], refs[p in W8A8_KINDS], time_it) for p in calls}
            if "fp8_dequant_bf16" not in paths:
                why = f"{dequant_bytes / 2**30:.1f} GiB of bf16 experts per call, or widths in part blocks"
                paths["fp8_dequant_bf16"] = {"skipped": why}
            table = first(MOE_KERNELS, *route, None, Fp8Scales(s13, s2, 128)).name
            row = {"shape": name, "tokens": tokens, "pairs_per_expert": tokens * top_k / experts,
                   "checked_against": "reference" if tokens <= MOE_REFERENCE_MAX_TOKENS else "bf16 experts",
                   "fp8_table": table, "paths": paths, "fastest_fp8": fastest(paths, MOE_FP8_PATHS)}  # fmt: skip
            if row["fastest_fp8"] is not None and "ms" in paths["bf16"]:
                row["bf16_over_fastest_fp8"] = paths["bf16"]["ms"] / paths[row["fastest_fp8"]]["ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
        w13 = w2 = b13 = b2 = s13 = s2 = scales = None  # before the next shape's experts are drawn
        _release(device)
    return rows


def _dequant_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The fp8 experts dequantized to x's dtype (all experts as one weight: their widths are whole 128-row blocks),
    then the table's bf16 path."""
    from mlaserve.kernels.fp8_dequant import dequantize_weight
    from mlaserve.kernels.moe.dispatch import fused_experts

    b13 = dequantize_weight(w13.flatten(0, 1), s13.flatten(0, 1), 128, x.dtype).view(w13.shape)
    b2 = dequantize_weight(w2.flatten(0, 1), s2.flatten(0, 1), 128, x.dtype).view(w2.shape)
    return fused_experts(x, b13, b2, weights, ids, F.silu)
