"""The paged MLA decode (the dispatcher's plan, as the engine calls it) on uniform and on uneven batches: CUDA-graph
replays with L2 emptied (bench_graph), medians, each call first checked against the torch reference.

Uniform: the six bf16 shapes of the FlashInfer table (max_seq_len = the length, as that section calls it). Uneven:
batches like the mixed workload's decode steps (benchmarks/gpu_mixed.py: prompts log-normal around 500, 16 to
4,000, plus 100 decoded rows), sized for max_model_len 10,240 as the engine's decode graphs are, at 16 heads (V2-Lite) and 128.
At 16 heads the Triton kernel also runs in the other of its two layouts, side by side with the plan's: "shares"
(one sequence per program, each sequence its share of the splits by length) and "spans" (every program an equal
run of the batch's tiles, DecodePlan.balanced), the latter also at other program counts and least spans; each
with each split count given forced (shares, grid and target both: no spare splits). Then the 16-head cases again
over an fp8 cache (the fp8-dot kernel where it pays) and over an int8 cache (the Triton kernel).
Every variant is first checked against the torch reference. Run it on two trees to compare their rules (the
tree's own mlaserve is imported):

    python benchmarks/diagnose/split_room.py OUT.json [FORCED_SPLITS, e.g. 1,2,4,8,16]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import LAT, ROPE, bench_graph, paged_case, run_header  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.kernels.mla_decode.decode import mla_decode  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned  # noqa: E402
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows  # noqa: E402

UNIFORM = [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192), (32, 16, 2048), (1, 16, 16384)]
UNEVEN = [(229, 16), (106, 16), (45, 16), (64, 128)]


def uneven_lengths(batch: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(batch, generator=gen) * 0.9 + math.log(500)).clamp(16, 4000) + 100
    return lens.round().int().tolist()


# mla_decode_tuned's knobs for the 16-head Triton kernel's two layouts (DecodePlan.balanced)
LAYOUTS = {
    "shares": dict(kernel="triton", balanced=False),
    "spans": dict(kernel="triton", balanced=True),
    "spans_132": dict(kernel="triton", balanced=True, num_splits=132),
    "spans_396": dict(kernel="triton", balanced=True, num_splits=396),
    "spans_528": dict(kernel="triton", balanced=True, num_splits=528),
    "spans_rows128": dict(kernel="triton", balanced=True, min_span_rows=128),
    "spans_rows512": dict(kernel="triton", balanced=True, min_span_rows=512),
}


def case(
    batch: int,
    heads: int,
    lengths: list[int],
    max_len: int,
    splits: tuple[int, ...] = (),
    cache_dtype: str = "bf16",
    variants: dict[str, dict] | None = None,
) -> dict:
    """The dispatcher's plan, then each of `variants` (mla_decode_tuned's kernel and knobs), then (uneven batches)
    each forced split count in `splits`: grid = target = n, one sequence per program."""
    q, cache, table, meta = paged_case(batch, heads, lengths, 64, torch.bfloat16, seed=batch + heads)
    if cache_dtype != "bf16":
        cache = quantize_rows(cache, QUANTIZED[cache_dtype])
    want, want_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)

    def call():
        return mla_decode(q, cache, table, meta.seq_lens, max_len, LAT, 0.07)

    got, lse = call()
    plan = decode_plan(q, cache, max_len, LAT, ROPE)
    row = dict(
        batch=batch, heads=heads, cache=cache_dtype, max_len=max_len, mean_len=sum(lengths) / batch, longest=max(lengths),
        kernel=plan.kernel, balanced=plan.balanced, grid_splits=plan.num_splits,
        split_target=getattr(plan, "split_target", 0),
        max_err=(got.float() - want).abs().max().item(), lse_err=(lse - want_lse).abs().max().item(),
        us=bench_graph(call) * 1e3,
    )  # fmt: skip
    row["GBps"] = sum(lengths) * cache.shape[-1] * cache.element_size() / row["us"] / 1e3
    forced = {f"splits{n}": dict(num_splits=n, balanced=False) for n in splits}
    for name, knobs in ((variants or {}) | forced).items():

        def variant(knobs=knobs):
            return mla_decode_tuned(q, cache, table, meta.seq_lens, max_len, LAT, 0.07, **knobs)

        got, lse = variant()
        err = max((got.float() - want).abs().max().item(), (lse - want_lse).abs().max().item())
        row[f"{name}_err"] = err
        row[f"{name}_us"] = bench_graph(variant) * 1e3
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    forced = tuple(int(n) for n in sys.argv[2].split(",")) if len(sys.argv) > 2 else ()
    out = run_header()

    def layouts(heads: int) -> dict[str, dict]:
        return LAYOUTS if heads == 16 else {}

    rows = [case(b, h, [n] * b, n, variants=layouts(h)) for b, h, n in UNIFORM]
    rows += [case(b, h, uneven_lengths(b, b), 10240, forced, variants=layouts(h)) for b, h in UNEVEN]
    # the 8-bit caches at the 16-head shapes: fp8 (the fp8-dot kernel where it pays), int8 (Triton's)
    rows += [case(b, h, [n] * b, n, cache_dtype="fp8_e4m3") for b, h, n in UNIFORM if h == 16]
    rows += [case(b, h, uneven_lengths(b, b), 10240, cache_dtype="fp8_e4m3") for b, h in UNEVEN if h == 16]
    int8 = {name: LAYOUTS[name] for name in ("shares", "spans")}
    rows += [case(b, h, [n] * b, n, cache_dtype="int8", variants=int8) for b, h, n in UNIFORM if h == 16]
    rows += [
        case(b, h, uneven_lengths(b, b), 10240, cache_dtype="int8", variants=int8)
        for b, h in UNEVEN
        if h == 16
    ]
    out["rows"] = rows
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
