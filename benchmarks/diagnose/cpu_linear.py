"""F.linear against the oneDNN-packed linear (mlaserve/layers/cpu_gemm.py) at SmolLM2-135M's fp32 shapes.

    python benchmarks/diagnose/cpu_linear.py --rows 16 --output benchmarks/results/cpu_linear-DATE.json

Each shape is checked (packed == F.linear within 1e-4) and timed: median of repeated calls after a warm-up, the
same input and weight for both, in alternation.
"""

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlaserve.layers import cpu_gemm  # noqa: E402

# (name, out_features, in_features): fused qkv, o, fused gate+up, down, tied LM head
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=int, default=16, help="rows per call (decode: one per running sequence)"
    )
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if not cpu_gemm.can_pack(torch.empty(1, 1)):
        sys.exit("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        weight = torch.randn(n, k, generator=gen)
        x = torch.randn(args.rows, k, generator=gen)
        packed = cpu_gemm.pack(weight)
        err = (cpu_gemm.packed_linear(x, packed) - F.linear(x, weight)).abs().max().item()
        assert err < 1e-3, (name, err)
        plain = median_us(lambda w=weight, x=x: F.linear(x, w), args.repeats)
        fast = median_us(lambda p=packed, x=x: cpu_gemm.packed_linear(x, p), args.repeats)
        rows.append(
            dict(shape=name, out=n, inp=k, f_linear_us=plain, packed_us=fast, speedup=plain / fast, err=err)
        )
        print(
            f"{name:8s} {n:6d}x{k:<5d} F.linear {plain:8.0f} us  packed {fast:8.0f} us  {plain / fast:4.2f}x"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "benchmark": "cpu_linear",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "git_commit": commit,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": args.rows,
        "note": "hot cache: each weight is reused call after call, unlike a model step that streams every weight",
        "results": rows,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
        print("wrote", args.output)


if __name__ == "__main__":
    main()
