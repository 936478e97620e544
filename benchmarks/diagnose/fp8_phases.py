"""Where each CTA of the fp8-dot decode split kernel spends its time: per-CTA phase timestamps (%globaltimer).

  python benchmarks/diagnose/fp8_phases.py OUT.json

Builds an instrumented copy of mlaserve/kernels/mla_decode/gluon_fp8.py at run time (its source with timestamp
stores added at phase boundaries; nothing else changes, so the kernel is today's), runs it in place of the real one
for three default-shaped fp8 decode calls per case (back to back: L2 is not emptied between them, as the suite's
timings do), and reports each phase's minimum, median and maximum over the
CTAs of the last call, in microseconds:
  prologue       kernel start to the warp-specialized part (the barriers' set-up; until 16f3563 also the
                 queries' copy, and at 4e922b1 the ring's first copies, which the producer issues since 9e46b37)
  first_tile_cN  from there to consumer N's first scores (since 16f3563 including the queries' copy by consumer 0,
                 which on PDL waits for the query split to finish)
  loop_cN        consumer N's tile loop
  store_cN       consumer N writing its partial result (since 5ac47cc: consumer 1 handing its state to consumer 0,
                 consumer 0 waiting for it, combining and writing the CTA's one partial)
  end            each CTA's end, from the earliest CTA start
The timestamps add a few instructions outside the tile loop; the per-tile work is unchanged.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_suite import LAT, ROPE, paged_case, run_header  # noqa: E402
from mlaserve.kernels.mla_decode import decode, gluon_fp8, tuning  # noqa: E402
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows  # noqa: E402

NOW = 'gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [b], dtype=gl.int64, is_pure=False, pack=1)'
CTA = (
    "cta = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + gl.program_id(2)"
)
SLOTS_PER_CTA = (
    10  # start, prologue end, (first scores, loop end, store end) x 2 consumers, kernel end, SM id
)


def patch(source: str, old: str, new: str, count: int = 1) -> str:
    if source.count(old) != count:
        raise SystemExit(f"fp8_phases: the kernel's source changed; no unique anchor {old.strip()[:60]!r}")
    return source.replace(old, new)


def instrumented_module():
    """gluon_fp8 with timestamp stores; stage1_fp8 takes one more argument, Times [CTAs, SLOTS_PER_CTA]."""
    source = Path(gluon_fp8.__file__).read_text()
    source = patch(
        source,
        "p_his, p_los, m_l, state_ready,\n    PAGE:",
        "p_his, p_los, m_l, state_ready, Times,\n    PAGE:",
    )
    source = patch(source, "    s2 = warpgroup_mma_wait(0, deps=[s2])\n    for k in range(",
                   f"    s2 = warpgroup_mma_wait(0, deps=[s2])\n    {CTA}\n"
                   f"    gl.store(Times + cta * {SLOTS_PER_CTA} + 2 + 3 * c, {NOW})\n    for k in range(")  # fmt: skip
    source = patch(source, "    # This consumer's ring slots are free",
                   f"    gl.store(Times + cta * {SLOTS_PER_CTA} + 3 + 3 * c, {NOW})\n    # This consumer's ring slots are free")  # fmt: skip
    source = patch(source, "stride_mlb, stride_mlh, P_BITS)  # fmt: skip\n",
                   "stride_mlb, stride_mlh, P_BITS)  # fmt: skip\n"
                   f"    gl.store(Times + cta * {SLOTS_PER_CTA} + 4 + 3 * c, {NOW})\n")  # fmt: skip
    source = patch(source, "    num_heads, scale_log2, num_splits, split_target,\n    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: "
                   "gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,\n    PDL: gl.constexpr,\n):  # fmt: skip\n"
                   "    # Launched",
                   "    num_heads, scale_log2, num_splits, split_target, Times,\n    PAGE: gl.constexpr, D_LAT: gl.constexpr, D_ROPE: "
                   "gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,\n    PDL: gl.constexpr,\n):  # fmt: skip\n"
                   f"    b = gl.program_id(0)\n    {CTA}\n    gl.store(Times + cta * {SLOTS_PER_CTA}, {NOW})\n"
                   '    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [b], dtype=gl.int32, '
                   "is_pure=False, pack=1)\n"
                   f"    gl.store(Times + cta * {SLOTS_PER_CTA} + 9, sm.to(gl.int64))\n    # Launched")  # fmt: skip
    source = patch(source, "    barrier()\n    gl.warp_specialize(",
                   f"    barrier()\n    gl.store(Times + cta * {SLOTS_PER_CTA} + 1, {NOW})\n    gl.warp_specialize(")  # fmt: skip
    source = patch(source, "m_l, state_ready, PAGE, D_LAT,", "m_l, state_ready, Times, PAGE, D_LAT,", count=2)
    source = patch(source, "        [232, 232],\n    )  # fmt: skip\n",
                   f"        [232, 232],\n    )  # fmt: skip\n    gl.store(Times + cta * {SLOTS_PER_CTA} + 8, {NOW})\n")  # fmt: skip
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "mlaserve_fp8_phases.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("mlaserve_fp8_phases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spread(values: list[float]) -> dict:
    return {
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def case(timed, batch: int, length: int) -> dict:
    q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
    cache = quantize_rows(cache, QUANTIZED["fp8_e4m3"])
    plan = tuning.decode_plan(q[..., :LAT], cache, length, LAT, ROPE)
    if plan.kernel != "gluon_fp8":
        raise SystemExit(f"fp8_phases: ({batch}, {length}) takes {plan.kernel}, not the fp8-dot kernel")
    ctas = batch * plan.num_splits
    times = torch.zeros(ctas, SLOTS_PER_CTA, dtype=torch.int64, device="cuda")

    class Launch:  # stands in for stage1_fp8[grid](...) inside gluon_fp8.launch
        def __getitem__(self, grid):
            return lambda *args, **kwargs: timed.stage1_fp8[grid](*args, times, **kwargs)

    real = gluon_fp8.stage1_fp8
    gluon_fp8.stage1_fp8 = Launch()
    try:
        for _ in range(3):
            decode.mla_decode(q, cache, table, meta.seq_lens, length, LAT, 0.07)
        torch.cuda.synchronize()
    finally:
        gluon_fp8.stage1_fp8 = real
    t = times.cpu()
    us = ((t - t[:, 0].min()).double() / 1e3).tolist()
    phases = {
        "prologue": [r[1] - r[0] for r in us],
        "first_tile_c0": [r[2] - r[1] for r in us],
        "first_tile_c1": [r[5] - r[1] for r in us],
        "loop_c0": [r[3] - r[2] for r in us],
        "loop_c1": [r[6] - r[5] for r in us],
        "store_c0": [r[4] - r[3] for r in us],
        "store_c1": [r[7] - r[6] for r in us],
        "end": [r[8] for r in us],
    }
    row = dict(B=batch, L=length, ctas=ctas, splits=plan.num_splits, sms_used=len(set(t[:, 9].tolist())),
               tiles_per_cta=-(-length // 64 // plan.num_splits),
               phases_us={name: spread(values) for name, values in phases.items()})  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    args = parser.parse_args()
    timed = instrumented_module()
    out = {
        **run_header(),
        "rows": [case(timed, batch, length) for batch, length in ((64, 4096), (128, 8192), (128, 2048))],
    }
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
