"""Why a decode split kernel takes the time it takes: Nsight Compute's warp-state sampling over one call, summarized.

  python benchmarks/diagnose/ncu_stalls.py OUT.json [--batch 128] [--length 8192] [--cache fp8_e4m3] [--top 25]

Runs `ncu` (on PATH or in /usr/local/cuda/bin) twice over this script's `--decode` mode, which makes three decode
calls at (batch, 16 heads, length) with the default kernel choice; the third call's split kernel is profiled:
once for its duration, SM clock and issue rate (ncu locks the clocks, so durations compare between kernels but not
with the suite's), once for the per-instruction stall samples (`--page source --print-source sass --csv`). OUT.json
gets the stall reasons' shares, the instructions with the most samples, and the raw figures' command lines.
"""

import argparse
import collections
import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def decode(batch: int, length: int, cache_dtype: str) -> None:
    """The profiled process: three default decode calls (compile, warm, profiled)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_suite import LAT, paged_case
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
    if cache_dtype != "bfloat16":
        cache = quantize_rows(cache, QUANTIZED[cache_dtype])
    for _ in range(3):
        mla_decode(q, cache, table, meta.seq_lens, length, LAT, 0.07)
    torch.cuda.synchronize()


def ncu_binary() -> str:
    found = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(found).exists():
        raise SystemExit("ncu not found: Nsight Compute is needed (on PATH or in /usr/local/cuda/bin)")
    return found


def run_ncu(args: argparse.Namespace, extra: list[str]) -> tuple[list[str], str]:
    command = [ncu_binary(), "-k", "regex:stage1", "--launch-skip", "2", "--launch-count", "1", *extra,
               sys.executable, str(Path(__file__).resolve()), "--decode",
               "--batch", str(args.batch), "--length", str(args.length), "--cache", args.cache]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return command, done.stdout


def metric(text: str, name: str) -> float | None:
    """A value from ncu's section tables ('Duration  us  231.62')."""
    found = re.search(rf"^\s*{re.escape(name)}\s+\S+\s+([\d,.]+)\s*$", text, re.M)
    found = found or re.search(rf"^\s*{re.escape(name)}\s+([\d,.]+)\s*$", text, re.M)
    return float(found.group(1).replace(",", "")) if found else None


def summarize(source_csv: str, top: int) -> dict:
    """Stall reasons' shares of all warp samples, and the instructions with the most samples."""
    lines = [line for line in source_csv.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    kernel, head = rows[0][1], rows[1]
    data = [dict(zip(head, row)) for row in rows[2:] if len(row) == len(head)]
    reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(int(d[samples] or 0) for d in data)
    shares = collections.Counter({r[6:]: sum(int(d[r] or 0) for d in data) / total for r in reasons})
    hot = sorted(range(len(data)), key=lambda i: -int(data[i][samples] or 0))[:top]
    return {
        "kernel": kernel,
        "samples": total,
        "instructions_executed": sum(int(d["Instructions Executed"] or 0) for d in data),
        "stall_shares": {reason: round(share, 4) for reason, share in shares.most_common()},
        "top_instructions": [
            {
                "index": i,
                "sass": data[i]["Source"].strip(),
                "share": round(int(data[i][samples]) / total, 4),
                "executed": int(data[i]["Instructions Executed"] or 0),
                "reasons": {r[6:]: int(data[i][r]) for r in reasons if int(data[i][r] or 0) > 0},
            }
            for i in hot
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--cache", default="fp8_e4m3", choices=["bfloat16", "fp8_e4m3", "int8"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode:
        decode(args.batch, args.length, args.cache)
        return
    if not args.out:
        parser.error("OUT.json is needed")
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_suite import run_header

    speed_cmd, speed = run_ncu(args, ["--section", "SpeedOfLight", "--section", "SchedulerStats"])
    source_cmd, source = run_ncu(args, ["--section", "SourceCounters", "--page", "source", "--print-source",
                                        "sass", "--csv"])  # fmt: skip
    out = {
        **run_header(),
        "ncu_commands": [" ".join(speed_cmd), " ".join(source_cmd)],
        "case": {"batch": args.batch, "heads": 16, "length": args.length, "cache": args.cache},
        "duration_us": metric(speed, "Duration"),
        "sm_frequency_ghz": metric(speed, "SM Frequency"),
        "dram_throughput_pct": metric(speed, "DRAM Throughput"),
        "issued_warps_per_scheduler": metric(speed, "Issued Warp Per Scheduler"),
        "active_warps_per_scheduler": metric(speed, "Active Warps Per Scheduler"),
        "eligible_warps_per_scheduler": metric(speed, "Eligible Warps Per Scheduler"),
        **summarize(source, args.top),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "top_instructions"}, indent=1))


if __name__ == "__main__":
    main()
