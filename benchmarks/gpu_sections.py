"""The GPU suite's sections: each one's name, what it measures, and how it runs. A new section is one entry here
and a module of its own (benchmarks/gpu_*.py); gpu_suite.py runs the ones asked for, in this order."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import (
    gpu_conversion,
    gpu_flashinfer,
    gpu_fp8,
    gpu_fp8_paths,
    gpu_fp8_tiles,
    gpu_kernels,
    gpu_lite,
    gpu_mixed,
    gpu_prefill128,
    gpu_sparse,
    gpu_spec,
    gpu_tp,
    gpu_v4,
)
from benchmarks.gpu_lite import V2_LITE, lite_llm, lite_workload, random_prompts, timed_burst, timed_walls
from benchmarks.gpu_timing import bench, bench_graph
from benchmarks.step_timer import DecodeStepTimer
from mlaserve.testing.paged_case import paged_case


@dataclass(frozen=True)
class SuiteRun:
    """What a section may use: a scratch folder, the ceilings (empty unless that section ran first) and the
    command line's options."""

    tmp: Path
    ceil: dict
    hf_peer: bool = False
    tune: bool = False
    eager: bool = False
    profile: bool = False


@dataclass(frozen=True)
class Section:
    name: str
    help: str
    run: Callable[[SuiteRun], dict]


def _mixed(run: SuiteRun, runs: int | None = None) -> dict:
    options = {} if runs is None else {"runs": runs}
    return gpu_mixed.mixed(run.tmp, run.ceil, lite_llm, V2_LITE, DecodeStepTimer, **options)


def _fp8_engine(run: SuiteRun) -> dict:
    mixed = lambda folder, ceil, runs: _mixed(SuiteRun(folder, ceil), runs)  # noqa: E731
    return gpu_fp8.fp8_engine(run.tmp, run.ceil, lite_llm, lite_workload, timed_walls, mixed)


SECTIONS = [
    Section("kernels", "Triton MLA decode vs the torch reference on fresh random paged caches (bf16, ragged lengths, "
            "8-bit rows)", lambda r: gpu_kernels.kernels()),
    Section("decode", "decode attention timings, bf16 latent cache, pages of 64: our kernels and plain torch side by "
            "side (--tune sweeps the Triton kernel's tiles)", lambda r: gpu_kernels.decode(r.ceil, r.tune)),
    Section("moe", "fused MoE (sorted tokens, grouped Triton GEMMs) vs the per-expert loop, V2-Lite expert shapes",
            lambda r: gpu_kernels.moe()),
    Section("tiny", "greedy tokens on a tiny random DeepSeek-V2 model: triton_mla backend (eager, graphs) vs torch",
            lambda r: gpu_lite.tiny(r.tmp)),
    Section("lite", "DeepSeek-V2-Lite shape, random bf16 weights: prompt 512, 64 new tokens, batch 1 and 32, output "
            "tok/s over the median of 5 wall times; transformers generate as the peer (--hf-peer)",
            lambda r: gpu_lite.lite(r.tmp, r.hf_peer, r.eager, r.profile)),
    Section("mla_vs_mha", "decode tok/s at batch 32 and the most sequences that fit in the same KV memory, contexts "
            "512 / 2,048 / 8,192: latent bf16, latent fp8, mla_disable", lambda r: gpu_lite.mla_vs_mha(r.tmp)),
    Section("throughput", "256 requests of 1,000 prompt + 100 output tokens: requests per second",
            lambda r: gpu_lite.throughput(r.tmp)),
    Section("sparse", "DeepSeek-V3.2: index scores + top-k and sparse MLA vs the torch reference, then dense vs sparse "
            "vs indexer + sparse at 65,536 tokens, top-k 2,048, batch 32 (gpu_sparse.py)",
            lambda r: gpu_sparse.sparse(bench, bench_graph)),
    Section("v4", "DeepSeek-V4 decode attention (window, 128:1, indexer + top-512 of 4:1, sinks) composed from our "
            "kernels and as the engine runs it, vs dense MLA at 65,536 tokens, batch 32 (gpu_v4.py)",
            lambda r: gpu_v4.v4(bench, bench_graph)),
    Section("flashinfer", "FlashInfer's paged MLA decode (fa3, fa2) beside ours on the same caches: issue 46's shapes, "
            "batch sweeps, uneven batches, fp8 rows, plan host time; needs FlashInfer (gpu_flashinfer.py)",
            lambda r: gpu_flashinfer.flashinfer_peer(paged_case, bench_graph)),
    Section("mixed", "a mixed-length workload (256 requests, skewed lengths) on the V2-Lite shape, bf16 and fp8 "
            "caches, plenty of KV memory and a limiting budget, against a roofline from the ceilings (gpu_mixed.py)",
            _mixed),
    Section("conversion", "a Llama-3-8B shape with per-head K/V against it converted to MLA at each KV cut: decode "
            "tok/s at batch 32 and 8,000-token contexts (gpu_conversion.py)",
            lambda r: gpu_conversion.conversion(r.tmp, DecodeStepTimer, gpu_lite.byte_tokenizer)),
    Section("tp", "the V2-Lite shape per tensor-parallel layout the machine allows: tokens against the first layout, "
            "decode tok/s, requests/s, the collectives' share of a step (gpu_tp.py)",
            lambda r: gpu_tp.tp(r.tmp, lite_llm, random_prompts, DecodeStepTimer, timed_burst)),
    Section("fp8_kernels", "DeepSeek's block-FP8 weights against bf16: the GEMMs and fused MoE (gpu_fp8.py)",
            lambda r: gpu_fp8.fp8_kernels(r.ceil, bench, bench_graph)),
    Section("fp8_engine", "block-FP8 against bf16 weights, the V2-Lite engine: lite and mixed workloads (gpu_fp8.py)",
            _fp8_engine),
    Section("fp8_v3", "DeepSeek-V3's widths at 4 layers with FP8 dummy weights: graphs, a float32 spot check, decode "
            "tok/s at batch 1 / 32 / 128 and each layer kind's share (gpu_fp8.py)",
            lambda r: gpu_fp8.fp8_v3(r.tmp, DecodeStepTimer)),
    Section("spec", "the speculative verify step (k = 1, 2, 3) against a plain decode step at batch 1, 8, 32 from "
            "graphs, V2-Lite shape and V3 widths with an MTP layer; speedup at published acceptance (gpu_spec.py)",
            lambda r: gpu_spec.spec(r.tmp, bench, V2_LITE)),
    Section("fp8_paths", "every block-FP8 path forced at rows 1 to 4,096 beside bf16, checked then timed; the table "
            "thresholds they suggest (gpu_fp8_paths.py; needs ceilings)",
            lambda r: gpu_fp8_paths.fp8_paths(r.ceil, bench_graph)),
    Section("fp8_tiles", "the W8A8 GEMMs (dense and fused MoE) at prefill sizes over a grid of tiles (gpu_fp8_tiles.py)",
            lambda r: gpu_fp8_tiles.fp8_tiles(bench_graph)),
    Section("prefill128", "MLA prefill attention at 128 heads (192/128 widths, bf16), 2k-16k tokens and 4 x 2k over a "
            "2k prefix: our Triton kernel over its tile candidates, torch flash varlen with V padded, FlashInfer's fa3 "
            "ragged prefill when it imports (gpu_prefill128.py)", lambda r: gpu_prefill128.prefill128(bench)),
]  # fmt: skip

DEFAULT = "ceilings,kernels,decode,moe,tiny,lite,mla_vs_mha,throughput,sparse,v4,tp,conversion"


def sections_help() -> str:
    rows = ["  ceilings    device-to-device copy bandwidth and the dense bf16 GEMM rate (the denominators)"]
    rows += [f"  {s.name:<11} {s.help}" for s in SECTIONS]
    return "sections (run in this order):\n" + "\n".join(rows)
