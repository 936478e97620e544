"""The same requests through the offline API and through `mlaserve serve`: how much of the engine the server keeps.

N requests of exactly --prompt-len token ids and --new-tokens output tokens (ignore_eos, greedy) are sent at once:
to `LLM.generate` in a process of its own, and as N concurrent streaming clients to a server launched with the same
engine options (benchmarks/serving.py's client, spread over --client-processes: TTFT, inter-token latency, output
tokens/s). Both stay up and their runs alternate, the same prompts on both sides: a warm-up pair, then --repeats
measured pairs. The figure is the ratio server / offline of output tokens/s, the median over the pairs (the median
run of each side is reported too); beside the server's ITL stands the offline decode step time (the offline run's decode phase divided by its
steps), and beside each server run how busy each process was (CPU seconds over wall seconds: API server, engine
core, client), which says which one bounds it.

    python -m benchmarks.serve_vs_offline --streams 32                          # CPU, a tiny random Llama
    python -m benchmarks.serve_vs_offline --v2-lite-layers 4 --dtype bfloat16 --device cuda \\
        --streams 32,256 --prompt-len 512 --new-tokens 128 --rates 16,32,64

Run it as a module from the repository root: it imports benchmarks/serving.py, gpu_lite.py and step_trace.py as
the `benchmarks` package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import serving  # the HTTP client and server launcher

REPO = Path(__file__).resolve().parents[1]


def token_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 30000)) for _ in range(length)] for _ in range(count)]


class OfflineSide:
    """`LLM.generate` in a process of its own, alive beside the server so that the two sides' runs interleave
    (offline, server, offline, ...): a shared or noisy machine's drift then lands on both alike. On a GPU it takes
    half the memory fraction, which leaves the server's engine the other half."""

    def __init__(self, options: dict) -> None:
        import multiprocessing

        self.options = options
        self.pool = multiprocessing.get_context("spawn").Pool(1)
        # Built before the server starts: on a GPU, whichever engine sizes its KV cache first takes its fraction.
        self.pool.apply(_offline_llm, (options,))

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        return self.pool.apply(_offline_run, (self.options, prompts, new_tokens))

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


_LLM: object = None  # the offline side's engine (an error building it reaches the caller)


def _offline_llm(options: dict) -> None:
    global _LLM
    if _LLM is None:
        from mlaserve import LLM

        _LLM = LLM(**options)


def _offline_run(options: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    _offline_llm(options)
    return offline(_LLM, prompts, new_tokens)


def offline(llm: object, prompts: list[list[int]], new_tokens: int) -> dict:
    from mlaserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = [o.metrics["first_token_time"] for o in outs]
    done = [o.metrics["finished_time"] for o in outs]
    decode_s = max(done) - max(first)  # every request past its prefill: the decode steps
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "decode_step_ms": 1000 * decode_s / max(new_tokens - 1, 1),
    }


def median_run(runs: list[dict], key: Callable[[dict], float]) -> dict:
    """The run with the median figure (the lower middle one for an even count), with every run's figure beside."""
    ordered = sorted(runs, key=key)
    return {**ordered[(len(ordered) - 1) // 2], "runs": [key(r) for r in runs]}


def served(
    args: argparse.Namespace, prompts: list[list[int]], concurrency: int, rate: float, processes: dict
) -> dict:
    """The client's summary, plus how busy each process was: CPU seconds over the run's wall time for the API
    server, the engine core and the client processes together (a process near 1.0 is the one that bounds)."""
    client_args = argparse.Namespace(
        max_tokens=args.new_tokens,
        temperature=0.0,
        ignore_eos=True,
        endpoint="completions",
        base_url=args.base_url,
        concurrency=concurrency,
        request_rate=rate,
        seed=0,
        max_duration_s=args.max_duration_s,
        api_key_env="MLASERVE_API_KEY",
    )
    before = server_cpu_s(processes)
    run = serving.run_load_processes(client_args, "bench", prompts, args.client_processes)
    after = server_cpu_s(processes)
    summary = serving.summarize(run.records, run.duration_s)
    summary["cpu_busy"] = {name: (after[name] - before[name]) / run.duration_s for name in after}
    summary["cpu_busy"]["client"] = run.cpu_s / run.duration_s
    summary["client_full_collections_ms"] = run.full_collections_ms
    summary["client_processes"] = args.client_processes
    return summary


def server_cpu_s(processes: dict) -> dict[str, float]:
    """CPU seconds (user + system) of the API-server processes together and of the engine core, from the pids
    the server's start-up report gives (/v1/models)."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    return {
        "api_server": sum(cpu(p) for p in processes["api_servers"]),
        "engine_core": cpu(processes["engine_core"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama)")
    parser.add_argument(
        "--v2-lite-layers",
        type=int,
        default=None,
        help="DeepSeek-V2-Lite's shape with this many layers (dummy weights)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", default="32", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=256,
        help="output tokens per request (long enough for a steady state)",
    )
    parser.add_argument("--rates", default="", help="Poisson arrival rates (req/s) to try, comma-separated")
    parser.add_argument("--rate-requests", type=int, default=128, help="requests per Poisson rate")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="engine token budget per step"
    )
    parser.add_argument("--api-server-count", type=int, default=1, help="the server's HTTP processes")
    parser.add_argument(
        "--prefill-first", action="store_true", help="the engine's prefill-first policy, on both sides"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured runs per side (the median is reported)"
    )
    parser.add_argument("--max-duration-s", type=float, default=300.0)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="client processes the streams are spread over (default: a quarter of the cores, at most 4)",
    )
    parser.add_argument(
        "--step-trace",
        action="store_true",
        help="trace every process's steps (MLASERVE_STEP_TRACE) and report where the last run's final step went",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    trace_dir = None
    # Set before any process starts: the server's, the clients' and the offline side's read it.
    if args.step_trace:
        trace_dir = Path(tempfile.mkdtemp(prefix="mlaserve-step-trace-"))
        os.environ["MLASERVE_STEP_TRACE"] = str(trace_dir)

    model = args.model
    if args.v2_lite_layers is not None:
        if model is not None:
            parser.error("--model and --v2-lite-layers name two models; give one")
        model, args.load_format = v2_lite_folder(args.v2_lite_layers), "dummy"
    if model is None:
        from mlaserve.testing.tiny_models import build_tiny

        model = str(
            build_tiny("llama", Path(tempfile.mkdtemp(prefix="mlaserve-svo-")), max_position_embeddings=4096)
        )
    streams = [int(s) for s in args.streams.split(",") if s]
    rates = [float(r) for r in args.rates.split(",") if r]
    most = max(streams + [args.rate_requests if rates else 0])
    options = dict(
        model=model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=max(256, most),
    )
    if args.device != "cpu":
        options["gpu_memory_utilization"] = args.gpu_memory_utilization / 2
    if args.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.prefill_first:
        options["prefill_first"] = True
    from mlaserve.loader.model_files import resolve_model

    vocab = resolve_model(model, need_weights=False).config_dict["vocab_size"]
    report: dict = {"rows": [], "rates": []}
    # Per stream count: a warm-up batch, then the measured repeats; the same prompts on both sides, each batch its
    # own (a repeat of a batch would be prefix-cache hits).
    batches = [
        [token_prompts(n, args.prompt_len, vocab, seed=1000 * n + r) for r in range(args.repeats + 1)]
        for n in streams
    ]
    flags = f"--load-format {args.load_format} --dtype {args.dtype} --device {args.device} "
    flags += (
        f"--max-model-len {args.max_model_len} --max-num-seqs {max(256, most)} --served-model-name bench "
    )
    flags += f"--max-concurrent-requests {max(1024, 2 * most)} --api-server-count {args.api_server_count}"
    if args.device != "cpu":
        flags += f" --gpu-memory-utilization {args.gpu_memory_utilization}"
    if args.max_num_batched_tokens is not None:
        flags += f" --max-num-batched-tokens {args.max_num_batched_tokens}"
    if args.prefill_first:
        flags += " --prefill-first"
    launch = argparse.Namespace(config=None, model=model, server_args=flags, launch_timeout_s=1800)
    offline_side = OfflineSide(options)
    try:
        server, args.base_url, log = serving.launch_server(launch)
    except BaseException:
        offline_side.close()
        raise
    try:
        models = serving.fetch_models(
            argparse.Namespace(base_url=args.base_url, api_key_env="MLASERVE_API_KEY")
        )
        processes = models["data"][0]["mlaserve"]["processes"]
        for n, runs in zip(streams, batches, strict=True):
            pairs = []
            for prompts in runs:  # the first pair warms both sides up
                pairs.append(
                    (
                        offline_side.run(prompts, args.new_tokens),
                        served(args, prompts, n, float("inf"), processes),
                    )
                )
            pairs = pairs[1:]
            row = {
                "streams": n,
                "offline": median_run([o for o, _ in pairs], lambda r: r["output_tok_s"]),
                "server": median_run([s for _, s in pairs], lambda r: r["output_token_throughput_tps"]),
            }
            ratios = sorted(s["output_token_throughput_tps"] / o["output_tok_s"] for o, s in pairs)
            row["pair_ratios"] = ratios
            row["server_over_offline"] = ratios[(len(ratios) - 1) // 2]
            itl_p99 = row["server"]["itl_s"]["p99"]
            step = row["offline"]["decode_step_ms"] / 1000
            row["itl_p99_over_offline_step"] = None if itl_p99 is None else itl_p99 / step
            after_first = row["server"]["itl_after_first_s"]["p99"]
            row["itl_p99_after_first_over_offline_step"] = None if after_first is None else after_first / step
            report["rows"].append(row)
            server_tok_s = row["server"]["output_token_throughput_tps"]
            print(
                f"{n} streams: offline {row['offline']['output_tok_s']:.0f} tok/s, server {server_tok_s:.0f} tok/s "
                f"(server/offline per pair, median {row['server_over_offline']:.2f}x of {ratios}); "
                f"TTFT p50 {row['server']['ttft_s']['p50']}, "
                f"ITL p50/p99 {row['server']['itl_s']['p50']}/{itl_p99} s (p99 without first gaps {after_first} s), "
                f"offline step {step * 1000:.2f} ms; "
                f"CPU busy {row['server']['cpu_busy']}"
            )
        for rate in rates:
            prompts = token_prompts(args.rate_requests, args.prompt_len, vocab, seed=int(rate * 1000))
            summary = served(args, prompts, 0, rate, processes)
            report["rates"].append({"rate_req_s": rate, "server": summary})
            print(
                f"rate {rate}: ITL p99 {summary['itl_s']['p99']} s, {summary['output_token_throughput_tps']:.0f} tok/s"
            )
    finally:
        serving.stop_server(server)
        offline_side.close()
    within = [r["rate_req_s"] for r in report["rates"] if (r["server"]["itl_s"]["p99"] or 1e9) < 0.050]
    report.update(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()}, {os.cpu_count()} cores"
        + (f", {_gpu()}" if args.device != "cpu" else ""),
        commit=os.environ.get("MLASERVE_COMMIT") or serving.git_commit(),
        command="python -m benchmarks.serve_vs_offline " + " ".join(sys.argv[1:]),
        model=(
            f"DeepSeek-V2-Lite shape, {args.v2_lite_layers} layers, random weights"
            if args.v2_lite_layers is not None
            else args.model or "tiny random Llama (mlaserve/testing/tiny_models.py)"
        ),
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        api_server_count=args.api_server_count,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_first=args.prefill_first,
        highest_rate_with_itl_p99_under_50ms=max(within) if within else None,
        server_log_head=log.read_text(errors="replace")[:3000],
    )
    if trace_dir is not None:
        from benchmarks.step_trace import report as trace_report

        try:
            report["step_trace"] = trace_report(trace_dir)
        except SystemExit as problem:  # a run that finished no request, say: the record still gets written
            report["step_trace"] = [str(problem)]
        print("\n".join(report["step_trace"]))
    output = Path(args.output or REPO / "benchmarks" / "results" / f"serve-vs-offline-{report['date']}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


def v2_lite_folder(layers: int) -> str:
    """DeepSeek-V2-Lite's config.json (gpu_lite.V2_LITE) with `layers` layers, and a word-level tokenizer over its
    vocabulary, so that the server streams text; the weights are random (load_format dummy)."""
    from benchmarks.gpu_lite import V2_LITE
    from mlaserve.testing.tiny_models import save_word_tokenizer

    folder = Path(tempfile.mkdtemp(prefix=f"mlaserve-v2lite{layers}-"))
    (folder / "config.json").write_text(json.dumps({**V2_LITE, "num_hidden_layers": layers}))
    save_word_tokenizer(folder, V2_LITE["vocab_size"])
    return str(folder)


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    sys.exit(main())
