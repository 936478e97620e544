"""What this CPU can do for the offline benchmark's workload (SmolLM2-135M, float32, batch 16): the ceilings that
bound any engine, so a target like "2x transformers" can be checked against physics before it is chased.

    python benchmarks/diagnose/cpu_ceilings.py --output benchmarks/results/cpu_ceilings-DATE.json

Measured here: memory read bandwidth (a 1 GiB sum), the peak float32 GEMM rate (2048^3), and each SmolLM2 linear
at 16 rows through the packed oneDNN path the engine uses, with its weights cold (a working set of 24 copies,
far beyond the caches, as in a real decode step where every layer's weights come from DRAM). From those, the least
time a decode step's GEMMs can take, and the offline benchmark's floor for prefill + decode. Last, in situ: one
real decode step of the engine (16 sequences, SmolLM2 GGUF) with the time of each GEMM call summed, which splits the
step into GEMM time and everything else.
"""

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.diagnose.cpu_linear import SHAPES, median_us  # noqa: E402
from benchmarks.offline_throughput import git_state  # noqa: E402
from mlaserve.layers import cpu_gemm  # noqa: E402

LAYERS, PARAMS = (
    30,
    134_515_008,
)  # SmolLM2-135M: decoder layers, parameters (the LM head is the tied embedding)


def median_s(fn, repeats: int) -> float:
    return median_us(fn, repeats) / 1e6


def in_situ(rows: int, prompt_len: int) -> dict:
    """Milliseconds of one engine decode forward (+ LM head) with and without its GEMMs."""
    from benchmarks.offline_throughput import build_prompts
    from mlaserve import LLM, SamplingParams
    from mlaserve.runner import batch as batch_module

    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in build_prompts(engine.tokenizer, rows, prompt_len, "plain")]
    captured, launch = [], engine.runner.launch

    def capture(
        output, previous=None
    ):  # keep the model input of one decode step, some 30 tokens into the outputs
        batch = batch_module.build_model_input(output, engine.runner.block_size, engine.runner.device)
        if not captured and batch.meta.num_decodes == rows and batch.meta.host_seq_lens[0] >= prompt_len + 30:
            captured.append(batch)
        return launch(output, previous)

    engine.runner.launch = capture
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    del engine.runner.launch
    batch, model = captured[0], engine.runner.model

    @torch.inference_mode()
    def forward():
        hidden = model(batch.input_ids, batch.positions, engine.kv_caches, batch.meta)
        return model.compute_logits(hidden[batch.sample_rows])

    real, spent = cpu_gemm.packed_linear, [0.0]

    def timed_gemm(x, packed, bias=None):
        t = time.perf_counter()
        out = real(x, packed, bias)
        spent[0] += time.perf_counter() - t
        return out

    # Timing each GEMM call inside real steps: stubbing the GEMMs out instead would flatter the rest, whose
    # working set then stays in cache (23 ms without GEMMs against ~46 ms beside them, in a trial run).
    forward()
    cpu_gemm.packed_linear = timed_gemm
    walls = []
    try:
        for _ in range(20):
            t = time.perf_counter()
            forward()
            walls.append(time.perf_counter() - t)
    finally:
        cpu_gemm.packed_linear = real
    step_ms = statistics.median(walls) * 1e3
    gemm_ms = spent[0] / len(walls) * 1e3
    return dict(context=batch.meta.host_seq_lens[0], decode_forward_ms=step_ms, gemm_calls_ms=gemm_ms,
                other_ms=step_ms - gemm_ms)  # fmt: skip


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
    situ = in_situ(args.rows, args.prompt_tokens // args.rows)
    print(json.dumps(situ), flush=True)
    floor["benchmark_gemm_floor_in_situ_s"] = (
        floor["prefill_s_at_peak"] + (args.new_tokens - 1) * situ["gemm_calls_ms"] / 1e3
    )
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
        "decode_step_in_situ": situ,
        "floor": floor,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "linears_cold"}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
