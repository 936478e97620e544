"""One run on one GPU: ceilings, kernel correctness against the torch reference, kernel and engine timings.

    python -m benchmarks.gpu_suite --sections ceilings,kernels,decode,tiny,lite --out benchmarks/results/h200-DATE.json

Run it as a module from the repository root (it imports its sections as the `benchmarks` package).

Sections:
  ceilings  device-to-device copy bandwidth and dense bf16 GEMM rate (the denominators below)
  kernels   Triton MLA decode vs the torch reference on fresh random paged caches (bf16, ragged lengths)
  decode    decode attention timings, bf16 latent cache, block 64: Triton kernel and plain torch side by side
  moe       fused MoE (sorted tokens, grouped Triton GEMMs) vs the per-expert loop, V2-Lite expert shapes
  tiny      greedy tokens on a tiny random DeepSeek-V2 model: triton_mla backend vs torch backend, bf16
  lite      DeepSeek-V2-Lite shape with random bf16 weights (load_format="dummy"): prompt 512, 64 new tokens,
            batch 1 and 32, output tokens over the median of 5 wall times (all kept); transformers generate as the
            peer (--hf-peer)
  mla_vs_mha decode tok/s at batch 32 (decode-only engine steps, each timed: benchmarks/step_timer.py) and the most
            sequences that fit in the same KV memory, contexts 512 / 2,048 / 8,192: latent bf16, latent fp8,
            mla_disable (per-head K/V)
  throughput 256 requests of 1,000 prompt + 100 output tokens (random ids, ignore_eos): requests per second
  sparse    DeepSeek-V3.2: index scores + top-k and sparse MLA vs the torch reference, then dense decode vs sparse
            attention vs indexer + sparse at 65,536-token contexts, top-k 2,048, batch 32 (benchmarks/gpu_sparse.py)
  v4        DeepSeek-V4-shaped decode attention (window, 128:1 entries, indexer + top-512 of 4:1 entries, sinks)
            composed from our kernels vs dense MLA decode at 65,536 tokens, batch 32, and KV bytes per token
            (benchmarks/gpu_v4.py)
  flashinfer FlashInfer's paged MLA decode (fa3, fa2) beside ours on the same caches and queries: issue 46's shapes, a
            batch sweep at 16 and 128 heads, uneven batches, fp8 rows (ours and FlashInfer's own fp8) and each
            plan's host time; needs FlashInfer importable (--flashinfer-peer, benchmarks/gpu_flashinfer.py)
  mixed     a mixed-length workload (256 requests, prompts and outputs from skewed distributions, all at once) on the
            V2-Lite shape, bf16 and fp8 caches, with plenty of KV memory and with a KV budget that limits the batch,
            against a roofline from the ceilings (benchmarks/gpu_mixed.py)
  conversion a Llama-3-8B shape with its per-head K/V cache against the same model converted to MLA at each KV cut
            of the quality table: decode tok/s at batch 32 and 8,000-token contexts (benchmarks/gpu_conversion.py)
  fp8_kernels, fp8_engine, fp8_v3  DeepSeek's block-FP8 weights against bf16: the GEMMs and fused MoE, the V2-Lite
            engine (lite and mixed workloads), DeepSeek-V3's widths at 4 layers (benchmarks/gpu_fp8.py)
  fp8_paths every block-FP8 path forced (dense: W8A16, W8A8, torch's blockwise scaled_mm, dequantize + cuBLAS; MoE:
            W8A16 and W8A8 tiles) beside bf16 weights at rows 1 to 4,096, checked then timed; the fastest per row and
            the table thresholds they suggest (benchmarks/gpu_fp8_paths.py; needs ceilings)
  fp8_tiles the W8A8 GEMMs (dense and fused MoE) at prefill sizes over a grid of tiles, row blocks and fused or
            split gate/up, beside bf16: the tiles the defaults should be (benchmarks/gpu_fp8_tiles.py)
  spec      the speculative verify step (k = 1, 2, 3 drafts) against a plain decode step at batch 1, 8 and 32, both
            from CUDA graphs, on the V2-Lite shape and DeepSeek-V3's widths at 4 layers with an MTP layer, and the
            speedup at the acceptance rates vLLM and DeepSeek report (benchmarks/gpu_spec.py)
  prefill128 MLA prefill attention at 128 heads (192/128 widths, bf16), 2k-16k tokens and 4 x 2k over a 2k prefix:
            our Triton kernel over its tile candidates, torch flash varlen with V padded, FlashInfer's fa3 ragged
            prefill when it imports (benchmarks/gpu_prefill128.py)
  tp        the V2-Lite shape per tensor-parallel layout the machine allows (one process; the process group of one;
            N GPUs tensor and expert parallel): greedy tokens against the first layout, decode tok/s at batch 1 and
            32, 256 x (1,000 + 100) requests/s, the collectives' share of a decode step (benchmarks/gpu_tp.py)
Timings are medians of CUDA-event runs with L2 emptied before each (bench below), or of repeated wall-clock runs
after a warm-up.
"""

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import (
    gpu_conversion,
    gpu_flashinfer,
    gpu_fp8,
    gpu_fp8_paths,
    gpu_fp8_tiles,
    gpu_mixed,
    gpu_prefill128,
    gpu_sparse,
    gpu_spec,
    gpu_tp,
    gpu_v4,
)
from benchmarks.step_timer import DecodeStepTimer
from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.kvcache.quant import QUANTIZED, quantize_rows
from mlaserve.testing.paged_case import LAT, ROPE, paged_case

KV_BYTES = 60 << 30  # the same KV memory for every mode of the MLA-vs-MHA table
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1, vocab_size=102400,
    max_position_embeddings=163840, rms_norm_eps=1e-6, topk_method="greedy", n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=False, bos_token_id=100000, eos_token_id=100001,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                  "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}, rope_theta=10000, torch_dtype="bfloat16",
)  # fmt: skip


def random_prompts(gen: torch.Generator, count: int, length: int) -> list[dict]:
    """count prompts of `length` random token ids (V2-Lite's vocabulary), as LLM.generate takes them."""
    return [
        {"prompt_token_ids": torch.randint(0, 100000, (length,), generator=gen).tolist()}
        for _ in range(count)
    ]


def lite_workload(llm, gen: torch.Generator, batch: int) -> tuple[list[dict], object]:
    """The lite section's prompts (512 random ids each) and greedy 64-token params, after one short warm-up call."""
    from mlaserve import SamplingParams

    prompts = random_prompts(gen, batch, 512)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # The warm-up's prompt is the first timed prompt: without this, the first repeat at batch 1 found 448 of its
    # 512 prompt tokens cached and skipped most of the prefill that transformers is timed with.
    llm.engine.kv_manager.reset_prefix_cache()
    return prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def timed_walls(llm, prompts: list, params, repeats: int) -> tuple[list[float], list]:
    """Wall seconds of `repeats` generate calls (the device synchronized around each) and the last call's outputs.
    The prefix cache is emptied after each call, so every repeat prefills its prompts again."""
    walls, outs = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        llm.engine.kv_manager.reset_prefix_cache()
    return walls, outs


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of fn, CUDA events around each run, L2 emptied before each run by reading a 256 MiB
    buffer. (triton.testing.do_bench empties it by zeroing a buffer, which leaves L2 full of dirty lines that the
    timed kernels then write back: on an H200 that added 3-10 us to decode calls of 0.09-0.3 ms; docs/performance.md,
    Method.)"""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda").fill_(1)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.amax()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(max(5, int(rep_ms / estimate)))]  # fmt: skip
    for start, end in events:
        flush.amax()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[len(events) // 2]


def bench_dirty(fn) -> float:
    """triton.testing.do_bench's median: L2 emptied by zeroing a buffer (dirty lines) before each run."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn, **bench_options: float) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (as the engine runs decode): the timed span holds the
    kernels only. Eager timing of a 0.1 ms kernel also times the host's launch work whenever the host falls
    behind: three rounds of one run timed the (64, 16, 4,096) decode at 0.106-0.141 ms eagerly and 0.105 ms from a
    graph (docs/performance.md, Method)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, **bench_options)


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB per buffer: far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_ms = bench(lambda: a @ b)
    return {"copy_GBps": 2 * n / ms / 1e6, "bf16_gemm_TFLOPs": 2 * 8192**3 / gemm_ms / 1e9}


def run_header() -> dict:
    """What every GPU results JSON starts with: date, GPU, commit and the command that wrote it. A device's copy of
    the tree may carry a stale .git, so an explicit MLASERVE_COMMIT wins over git's HEAD."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "commit": os.environ.get("MLASERVE_COMMIT") or commit or "unknown",
        "command": " ".join(["python -m benchmarks.gpu_suite", *sys.argv[1:]]),
    }


def kernels() -> dict:
    from mlaserve.kernels.mla_decode.decode import mla_decode

    results = []
    for batch, heads, page, seed in [
        (4, 16, 64, 0),
        (7, 128, 64, 1),
        (3, 20, 16, 2),
        (5, 16, 128, 3),
        (2, 96, 128, 4),
    ]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        q, cache, table, meta = paged_case(batch, heads, lengths, page, torch.bfloat16, seed)
        ref, ref_lse = TorchBackend().decode(q.float(), cache.float(), None, meta, 0.1, LAT, need_lse=True)
        out, lse = mla_decode(q, cache, table, meta.seq_lens, max(lengths), LAT, 0.1)
        err = (out.float() - ref).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        results.append(dict(batch=batch, heads=heads, page=page, max_abs_err=err, lse_max_abs_err=lse_err))
        assert err < 2e-2 and lse_err < 1e-2, results[-1]
        for name, dtype in QUANTIZED.items():  # 8-bit rows: kernel vs reference reading the same rows
            rows8 = quantize_rows(cache, dtype)
            ref8, _ = TorchBackend().decode(q.float(), rows8, None, meta, 0.1, LAT, need_lse=True)
            out8, _ = mla_decode(q, rows8, table, meta.seq_lens, max(lengths), LAT, 0.1)
            results[-1][f"{name}_max_abs_err"] = (out8.float() - ref8).abs().max().item()
            # the kernel rounds dequantized values to bf16 before its dots; the reference stays in fp32
            assert results[-1][f"{name}_max_abs_err"] < 5e-2, results[-1]
    return {"cases": results, "tolerance": "bf16 inputs, fp32 reference: |out| err < 2e-2, |lse| err < 1e-2"}


def decode(ceil: dict, tune: bool) -> dict:
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned

    def time_case(batch: int, heads: int, length: int) -> dict:
        q, cache, table, meta = paged_case(batch, heads, [length] * batch, 64, torch.bfloat16, 0)
        scale = 1 / (192**0.5)
        t_triton = bench_graph(lambda: mla_decode(q, cache, table, meta.seq_lens, length, LAT, scale))
        t_eager = bench(lambda: mla_decode(q, cache, table, meta.seq_lens, length, LAT, scale))
        sweep = []
        if tune:  # the Triton kernel's tile (the Gluon kernels' tiles are fixed)
            args = (q, cache, table, meta.seq_lens, length, LAT, scale)
            for bh in [b for b in (16, 32, 64) if b <= max(16, heads)]:
                for bn in (32, 64):
                    for warps in (4, 8):
                        for stages in (1, 2, 3):
                            kw = dict(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)
                            try:
                                ms = bench(lambda kw=kw: mla_decode_tuned(*args, kernel="triton", **kw))
                            except Exception as e:  # out of shared memory / registers for this tile
                                ms = float("inf")
                                kw["error"] = type(e).__name__
                            sweep.append({**kw, "ms": ms})
            sweep.sort(key=lambda r: r["ms"])
        t_torch = bench(lambda: TorchBackend().decode(q, cache, None, meta, scale, LAT))
        bytes_read = batch * length * (LAT + ROPE) * 2
        flops = 2 * batch * heads * length * (LAT + ROPE + LAT)
        row = dict(B=batch, H=heads, L=length, triton_ms=t_triton, triton_eager_ms=t_eager, torch_ms=t_torch)
        row["best_configs"] = sweep[:3]
        row["triton_GBps"] = bytes_read / t_triton / 1e6
        row["triton_TFLOPs"] = flops / t_triton / 1e9
        row["torch_GBps"] = bytes_read / t_torch / 1e6
        row["pct_of_copy"] = 100 * row["triton_GBps"] / ceil["copy_GBps"] if ceil else None
        row["pct_of_gemm"] = 100 * row["triton_TFLOPs"] / ceil["bf16_gemm_TFLOPs"] if ceil else None
        if heads > 16:  # the Gluon split kernel (default on sm_90) against the Triton one it replaces there
            row["split_kernel"] = decode_plan(q, cache, length, LAT, ROPE).kernel
            row["triton_kernel_ms"] = bench_graph(
                lambda: mla_decode_tuned(q, cache, table, meta.seq_lens, length, LAT, scale, kernel="triton")
            )
            row["triton_kernel_TFLOPs"] = flops / row["triton_kernel_ms"] / 1e9
        if heads <= 16:  # memory-bound shapes: the 8-bit caches should take about half the time
            for name, dtype in QUANTIZED.items():
                rows8 = quantize_rows(cache, dtype)
                ms = bench_graph(lambda r=rows8: mla_decode(q, r, table, meta.seq_lens, length, LAT, scale))
                row[f"{name}_ms"] = ms
                row[f"{name}_vs_bf16"] = ms / t_triton
                if dtype == torch.float8_e4m3fn:  # the Gluon fp8 kernel (default on sm_90) against Triton's
                    row[f"{name}_split_kernel"] = decode_plan(q, rows8, length, LAT, ROPE).kernel
                    row[f"{name}_triton_kernel_ms"] = bench_graph(
                        lambda r=rows8: mla_decode_tuned(
                            q, r, table, meta.seq_lens, length, LAT, scale, kernel="triton"
                        )
                    )
                del rows8
        return row

    rows = []
    for batch, heads, length in [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192)]:
        rows.append(time_case(batch, heads, length))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "counting": "latent bytes read once; FLOPs 2*B*H*L*(576+512)",
        "timing": "triton_ms and the 8-bit figures: CUDA-graph replays (bench_graph); triton_eager_ms and torch_ms: "
        "eager calls",
    }


def moe() -> dict:
    """Fused MoE vs the per-expert loop at DeepSeek-V2-Lite's expert shapes (64 experts, top-6, bf16)."""
    import torch.nn.functional as F

    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.moe import experts_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(64, 2 * 1408, 2048, generator=gen, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(64, 2048, 1408, generator=gen, device="cuda") * 0.02).bfloat16()
    rows = []
    for tokens in (1, 32, 512, 4096):
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
        logits = torch.randn(tokens, 64, generator=gen, device="cuda")
        weights, ids = logits.softmax(-1).topk(6, dim=-1)
        ref = experts_reference(x, w13, w2, weights, ids, F.silu)
        out = fused_experts(x, w13, w2, weights, ids, F.silu)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        t_fused = bench(lambda x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i, F.silu))
        t_ref = bench(lambda x=x, w=weights, i=ids: experts_reference(x, w13, w2, w, i, F.silu))
        rows.append(dict(tokens=tokens, rel_err=err, fused_ms=t_fused, reference_ms=t_ref))
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def tiny(tmp: Path) -> dict:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from mlaserve import LLM, SamplingParams

    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(tmp / "tiny")
    gen = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()} for n in (5, 77, 300, 1)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for name, backend, eager in (("torch", "torch", True), ("triton_eager", "triton_mla", True),
                                 ("triton_graphs", "triton_mla", False)):  # fmt: skip
        llm = LLM(str(tmp / "tiny"), dtype="bfloat16", device="cuda", attention_backend=backend, enforce_eager=eager,
                  skip_tokenizer_init=True, num_kv_blocks=512, block_size=64, max_model_len=2048)  # fmt: skip
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm

    def compare(a: str, b: str) -> dict:
        pairs = list(zip(outs[a], outs[b]))
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in pairs]
        return {"rows_identical": [p == q for p, q in pairs], "first_difference": first}

    return {
        "torch_vs_triton_eager": compare("torch", "triton_eager"),
        "triton_eager_vs_graphs": compare("triton_eager", "triton_graphs"),
        "note": "bf16: kernels sum in different orders, so near-tied logits may flip late tokens",
    }


def lite(tmp: Path, hf_peer: bool, eager: bool = False, profile: bool = False) -> dict:
    from mlaserve import LLM, SamplingParams

    folder = tmp / "v2lite"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(V2_LITE))
    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
              block_size=64, max_model_len=4096, gpu_memory_utilization=0.85, enforce_eager=eager)  # fmt: skip
    result = {"load_s": time.perf_counter() - t0, "stats": llm.stats()}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        prompts, params = lite_workload(llm, gen, batch)
        # Repeats once spread 2-3x (cuDNN plans per prefill shape, mid-run compiles): every wall time is kept.
        walls, outs = timed_walls(llm, prompts, params, 5)
        wall = sorted(walls)[len(walls) // 2]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[f"mlaserve_batch{batch}_tok_s"] = tokens / wall
        result[f"mlaserve_batch{batch}_walls_s"] = walls
        print(
            f"lite batch {batch}: {tokens / wall:.1f} tok/s (median of {[round(w, 2) for w in walls]} s)",
            flush=True,
        )
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prompts = random_prompts(gen, 1, 512)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
            )
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20), flush=True)
    del llm
    gc.collect()  # the engine's cycles hold its KV cache until collected: transformers' model needs the memory
    torch.cuda.empty_cache()
    if hf_peer:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(folder)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for batch in (1, 32):
            ids = torch.randint(0, 100000, (batch, 512), device="cuda")
            model.generate(ids[:, :16], max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
            )
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            result[f"transformers_batch{batch}_tok_s"] = batch * (out.shape[1] - 512) / wall
            print(f"hf batch {batch}: {result[f'transformers_batch{batch}_tok_s']:.1f} tok/s", flush=True)
    return result


def lite_llm(folder: Path, **options):
    gc.collect()  # a previous engine's cache must be gone before this one sizes its own
    torch.cuda.empty_cache()
    from mlaserve import LLM

    (folder / "config.json").parent.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(V2_LITE))
    return LLM(str(folder), dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
               block_size=64, max_model_len=10240, gpu_memory_utilization=0.85, **options)  # fmt: skip


def mla_vs_mha(tmp: Path) -> dict:
    """Decode tok/s at batch 32 and the most sequences that fit, same KV memory: latent bf16 / fp8 / mla_disable."""
    from mlaserve import SamplingParams

    rows = []
    gen = torch.Generator().manual_seed(0)
    for mode, options in (("latent_bf16", {}), ("latent_fp8", {"kv_cache_dtype": "fp8_e4m3"}),
                          ("mla_disable", {"mla_disable": True})):  # fmt: skip
        llm = lite_llm(tmp / "v2lite", kv_cache_memory_bytes=KV_BYTES, **options)
        stats = llm.stats()
        for context in (512, 2048, 8192):
            prompts = random_prompts(gen, 32, context)
            llm.engine.kv_manager.reset_prefix_cache()
            with DecodeStepTimer(llm.engine, torch.cuda.synchronize) as timer:
                llm.generate(
                    prompts, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True), use_tqdm=False
                )
            blocks_per_seq = -(-(context + 64) // stats["block_size"])
            row = dict(mode=mode, context=context, kv_bytes_per_token=stats["kv_bytes_per_token"],
                       kv_blocks_total=stats["kv_blocks_total"],
                       max_concurrent_seqs=stats["kv_blocks_total"] // blocks_per_seq,
                       decode_tok_s_batch32=timer.tokens_per_s, decode_steps_timed=timer.steps)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        torch.cuda.empty_cache()
    return {"rows": rows, "kv_memory_bytes": KV_BYTES}


def timed_burst(llm, prompts: list[dict], new_tokens: int = 100) -> float:
    """Wall seconds of one generate call over every prompt at once (greedy, ignore_eos), the prefix cache emptied
    first; every request must get its new_tokens."""
    from mlaserve import SamplingParams

    llm.engine.kv_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return wall


def throughput(tmp: Path) -> dict:
    """256 requests of 1,000 random prompt tokens and 100 output tokens (ignore_eos), all submitted at once."""
    from mlaserve import SamplingParams

    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(1)
    prompts = random_prompts(gen, 256, 1000)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    wall = timed_burst(llm, prompts)
    result = {"requests": 256, "wall_s": wall, "req_per_s": 256 / wall, "output_tok_per_s": 25600 / wall}
    print(json.dumps(result), flush=True)
    return result


def byte_tokenizer(folder: Path) -> None:
    from mlaserve.testing.tiny_models import save_byte_tokenizer

    save_byte_tokenizer(folder)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections",
        default="ceilings,kernels,decode,moe,tiny,lite,mla_vs_mha,throughput,sparse,v4,tp,conversion",
    )
    parser.add_argument(
        "--hf-peer", action="store_true", help="also time transformers generate in the lite section"
    )
    parser.add_argument(
        "--tune", action="store_true", help="sweep the decode kernel's tile sizes, report the best"
    )
    parser.add_argument(
        "--flashinfer-peer",
        action="store_true",
        help="also run the flashinfer section: FlashInfer's MLA decode beside ours (it must be importable)",
    )
    parser.add_argument("--eager", action="store_true", help="lite: no CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="lite: print a torch profile of one request")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sections = args.sections.split(",")
    if args.flashinfer_peer and "flashinfer" not in sections:
        sections.append("flashinfer")
    report = {**run_header(), "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    out = args.out or f"benchmarks/results/h200-{report['date']}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ceil = ceilings() if "ceilings" in sections else {}
        report["ceilings"] = ceil
        print("ceilings", ceil, flush=True)
        for name, fn in [("kernels", kernels), ("decode", lambda: decode(ceil, args.tune)), ("moe", moe), ("tiny", lambda: tiny(Path(tmp))),
                         ("lite", lambda: lite(Path(tmp), args.hf_peer, args.eager, args.profile)),
                         ("mla_vs_mha", lambda: mla_vs_mha(Path(tmp))), ("throughput", lambda: throughput(Path(tmp))),
                         ("sparse", lambda: gpu_sparse.sparse(bench, bench_graph)),
                         ("v4", lambda: gpu_v4.v4(bench, bench_graph)),
                         ("flashinfer", lambda: gpu_flashinfer.flashinfer_peer(paged_case, bench_graph)),
                         ("mixed", lambda: gpu_mixed.mixed(Path(tmp), ceil, lite_llm, V2_LITE, DecodeStepTimer)),
                         ("conversion", lambda: gpu_conversion.conversion(Path(tmp), DecodeStepTimer, byte_tokenizer)),
                         ("tp", lambda: gpu_tp.tp(Path(tmp), lite_llm, random_prompts, DecodeStepTimer, timed_burst)),
                         ("fp8_kernels", lambda: gpu_fp8.fp8_kernels(ceil, bench, bench_graph)),
                         ("fp8_engine", lambda: gpu_fp8.fp8_engine(Path(tmp), ceil, lite_llm, lite_workload, timed_walls,
                                                                   lambda folder, ceil_, runs: gpu_mixed.mixed(folder, ceil_, lite_llm, V2_LITE, DecodeStepTimer, runs))),
                         ("fp8_v3", lambda: gpu_fp8.fp8_v3(Path(tmp), DecodeStepTimer)),
                         ("spec", lambda: gpu_spec.spec(Path(tmp), bench, V2_LITE)),
                         ("fp8_paths", lambda: gpu_fp8_paths.fp8_paths(ceil, bench_graph)),
                         ("fp8_tiles", lambda: gpu_fp8_tiles.fp8_tiles(bench_graph)),
                         ("prefill128", lambda: gpu_prefill128.prefill128(bench))]:  # fmt: skip
            if name in sections:
                t = time.perf_counter()
                try:
                    report[name] = fn()
                except Exception as e:  # keep the other sections' figures
                    report[name] = {"error": f"{type(e).__name__}: {e}"}
                report[name + "_seconds"] = time.perf_counter() - t
                print(name, json.dumps(report[name])[:2000], flush=True)
                Path(out).write_text(
                    json.dumps(report, indent=2)
                )  # each section's figures, should a later one crash
    print("wrote", out)


if __name__ == "__main__":
    main()
