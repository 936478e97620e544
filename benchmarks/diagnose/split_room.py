"""The paged MLA decode (the dispatcher's plan, as the engine calls it) on uniform and on uneven batches: CUDA-graph
replays with L2 emptied (bench_graph), medians, each call first checked against the torch reference.

Uniform: the six bf16 shapes of the FlashInfer table (max_seq_len = the length, as that section calls it). Uneven:
batches like the mixed workload's decode steps (benchmarks/gpu_mixed.py: prompts log-normal around 500, 16 to
4,000, plus 100 decoded rows), sized for max_model_len 10,240 as the engine's decode graphs are, at 16 heads (V2-Lite) and 128; each
also with each split count given forced (grid and target both: no spare splits). Then the 16-head cases again over
an fp8 cache.
Run it on two trees to compare split rules (the tree's own mlaserve is imported):

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
from mlaserve.attention.triton.mla_decode import decode_plan, mla_decode, mla_decode_tuned  # noqa: E402
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows  # noqa: E402

UNIFORM = [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192), (32, 16, 2048), (1, 16, 16384)]
UNEVEN = [(229, 16), (106, 16), (45, 16), (64, 128)]


def uneven_lengths(batch: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(batch, generator=gen) * 0.9 + math.log(500)).clamp(16, 4000) + 100
    return lens.round().int().tolist()


def case(
    batch: int,
    heads: int,
    lengths: list[int],
    max_len: int,
    splits: tuple[int, ...] = (),
    cache_dtype: str = "bf16",
) -> dict:
    """The dispatcher's plan, then (uneven batches) each forced split count in `splits`: grid = target = n."""
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
        kernel=plan.kernel, grid_splits=plan.num_splits, split_target=getattr(plan, "split_target", 0),
        max_err=(got.float() - want).abs().max().item(), lse_err=(lse - want_lse).abs().max().item(),
        us=bench_graph(call) * 1e3,
    )  # fmt: skip
    row["GBps"] = sum(lengths) * cache.shape[-1] * cache.element_size() / row["us"] / 1e3
    for n in splits:
        row[f"splits{n}_us"] = (
            bench_graph(
                lambda n=n: mla_decode_tuned(q, cache, table, meta.seq_lens, max_len, LAT, 0.07, num_splits=n)
            )
            * 1e3
        )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    forced = tuple(int(n) for n in sys.argv[2].split(",")) if len(sys.argv) > 2 else ()
    out = run_header()
    rows = [case(b, h, [n] * b, n) for b, h, n in UNIFORM]
    rows += [case(b, h, uneven_lengths(b, b), 10240, forced) for b, h in UNEVEN]
    # the 8-bit cache at the 16-head shapes (the fp8-dot kernel where it pays)
    rows += [case(b, h, [n] * b, n, cache_dtype="fp8_e4m3") for b, h, n in UNIFORM if h == 16]
    rows += [case(b, h, uneven_lengths(b, b), 10240, cache_dtype="fp8_e4m3") for b, h in UNEVEN if h == 16]
    out["rows"] = rows
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
