"""Decode-kernel variants at the memory-bound shapes (16 heads, block 64) on one GPU, side by side in one run:
bf16 at several split counts, and the 8-bit caches at several tile sizes, warp counts and pipeline depths. Each variant's output is compared with the default kernel's on the same inputs first.

    python benchmarks/diagnose/decode_sweep.py OUT_DIR        # writes OUT_DIR/decode_sweep.json

Informs kernel defaults; the figures of record come from gpu_suite.py.
"""

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import LAT, ROPE, bench, ceilings, paged_case  # noqa: E402
from mlaserve.kernels.mla_decode.decode import mla_decode  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows  # noqa: E402

# mla_decode_tuned's kernel and tuning knobs
BF16_VARIANTS = [dict(), dict(num_splits=2), dict(num_splits=8)]
# 8-bit caches, the Triton kernel: its default (32-row tiles, 4 warps, fp16 dots at 16 heads) against neighbours and
# its old default
Q8_VARIANTS = [dict(), dict(block_n=16), dict(block_n=16, num_warps=2), dict(num_warps=2), dict(num_stages=2),
               dict(num_stages=4), dict(block_n=64, num_warps=8, q_f16=False)]  # fmt: skip
Q8_VARIANTS = [dict(kernel="triton", **kw) for kw in Q8_VARIANTS]


def _plain(kw: dict) -> dict:
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in kw.items()}


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    ceil = ceilings()
    print("ceilings", ceil, flush=True)
    rows = []
    for batch, length in ((64, 4096), (128, 8192)):
        q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
        run = functools.partial(mla_decode_tuned, q, cache, table, meta.seq_lens, length, LAT, 1 / 192**0.5)
        want = run()[0].float()
        nbytes = batch * length * (LAT + ROPE) * 2
        for kw in BF16_VARIANTS:
            err = (run(**kw)[0].float() - want).abs().max().item()
            ms = bench(functools.partial(run, **kw))
            if not kw:
                default_ms = ms
            row = dict(B=batch, L=length, cache="bf16", **_plain(kw), ms=ms, err_vs_default=err)
            row["pct_of_copy"] = 100 * nbytes / ms / 1e6 / ceil["copy_GBps"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        for name, dtype in QUANTIZED.items():
            rows8 = quantize_rows(cache, dtype)
            run8 = functools.partial(
                mla_decode_tuned, q, rows8, table, meta.seq_lens, length, LAT, 1 / 192**0.5
            )
            want8 = mla_decode(q, rows8, table, meta.seq_lens, length, LAT, 1 / 192**0.5)[0].float()
            for kw in Q8_VARIANTS:
                try:
                    err = (run8(**kw)[0].float() - want8).abs().max().item()
                    ms = bench(functools.partial(run8, **kw))
                except Exception as e:  # a tile that does not fit this GPU
                    err, ms = None, f"{type(e).__name__}"
                row = dict(B=batch, L=length, cache=name, **_plain(kw), ms=ms, err_vs_default_8bit=err)
                if isinstance(ms, float):
                    row["vs_default_bf16"] = ms / default_ms
                rows.append(row)
                print(json.dumps(row), flush=True)
            del rows8
        del cache
        torch.cuda.empty_cache()
    (out_dir / "decode_sweep.json").write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
