"""What this CPU can do for the offline benchmark's workload (SmolLM2-135M, float32, batch 16): the ceilings that
bound any engine, so a target like "2x transformers" can be checked against physics before it is chased.

    python benchmarks/cpu_ceilings.py --output benchmarks/results/cpu_ceilings-DATE.json

Measured here: memory read bandwidth (a 1 GiB sum), the peak float32 GEMM rate (2048^3), and each SmolLM2 linear
at 16 rows through the packed oneDNN path the engine uses, with its weights cold (a working set of 24 copies,
far beyond the caches, as in a real decode step where every layer's weights come from DRAM). From those, the least
time a decode step's GEMMs can take, and the offline benchmark's floor for prefill + decode.
"""

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.cpu_linear import SHAPES, median_us  # noqa: E402
from benchmarks.offline_throughput import git_state  # noqa: E402
from mlaserve.layers import cpu_gemm  # noqa: E402

LAYERS, PARAMS = (
    30,
    134_515_008,
)  # SmolLM2-135M: decoder layers, parameters (the LM head is the tied embedding)


def median_s(fn, repeats: int) -> float:
    return median_us(fn, repeats) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16 * 32, help="prefill tokens of the benchmark")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 28, generator=gen)  # 1 GiB of float32
    read_gbps = big.numel() * 4 / median_s(big.sum, 5) / 1e9
    del big
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    gemm_gflops = 2 * 2048**3 / median_s(lambda: a @ b, 5) / 1e9

    rows, step_s = [], 0.0
    for name, n, k in SHAPES:
        copies = 2 if name == "lm_head" else 24
        packed = [cpu_gemm.pack(torch.randn(n, k, generator=gen)) for _ in range(copies)]
        x = torch.randn(args.rows, k, generator=gen)

        def sweep(packed=packed, x=x):
            for p in packed:
                cpu_gemm.packed_linear(x, p)

        per_call = median_s(sweep, 3) / copies
        step_s += per_call * (1 if name == "lm_head" else LAYERS)
        flops = 2 * args.rows * n * k
        rows.append(dict(shape=name, out=n, inp=k, cold_us=per_call * 1e6, gflops=flops / per_call / 1e9,
                         weight_gbps=n * k * 4 / per_call / 1e9))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    decode_flops = 2 * args.rows * PARAMS
    prefill_flops = (
        2 * args.prompt_tokens * (PARAMS - SHAPES[-1][1] * SHAPES[-1][2])
    )  # no LM head per prompt token
    floor = dict(
        decode_step_gemm_s_measured=step_s,
        decode_step_gemm_s_at_peak=decode_flops / (gemm_gflops * 1e9),
        decode_step_weight_read_s_at_bandwidth=PARAMS * 4 / (read_gbps * 1e9),
        prefill_s_at_peak=prefill_flops / (gemm_gflops * 1e9),
    )
    floor["benchmark_gemm_floor_s"] = floor["prefill_s_at_peak"] + (args.new_tokens - 1) * step_s
    report = {
        "benchmark": "cpu_ceilings",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "git_commit": git_state()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "read_GBps": read_gbps,
        "fp32_gemm_GFLOPs": gemm_gflops,
        "linears_cold": rows,
        "floor": floor,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "linears_cold"}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
