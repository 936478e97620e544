"""The GPU suite's block-FP8 sections: DeepSeek's FP8 weights (float8_e4m3fn, a float32 scale per 128x128 block)
against bf16 weights, side by side in one run.

  fp8_kernels  the block-FP8 GEMM against its torch reference, then timed (from CUDA graphs) beside the bf16 GEMM
               the engine would run on the same dequantized weight: decode rows (1, 8, 32; W8A16) as weight bytes
               over the copy ceiling, prefill rows (4,096; W8A8) as FLOPs over the dense FP8 GEMM rate measured here
               (torch._scaled_mm, per-tensor scales, 8,192 cubed); and the fused MoE at V2-Lite's and V3's expert
               shapes, FP8 against bf16 experts
  fp8_engine   the V2-Lite shape with random weights quantized to block FP8 on load (quantization="fp8") against
               bf16: the lite workload (512 + 64 tokens, batch 1 and 32, median of 5 walls) and the mixed workload
               (benchmarks/gpu_mixed.py), output tok/s of each
  fp8_v3       DeepSeek-V3's widths (hidden 7,168, 128 heads, q_lora 1,536, 256 experts top-8 in 8 groups) at 4
               layers (1 dense, 3 MoE) with random FP8 weights on one GPU: a float32 spot check (triton_mla with CUDA
               graphs against the torch backend run eagerly, greedy tokens and logprobs), then decode tok/s at batch
               1, 32 and 128 (decode-only steps, benchmarks/step_timer.py) and each layer part's share of an eager
               decode step (CUDA events around attention, dense MLP and MoE modules)
  fp8_paths    every dense and MoE block-FP8 path forced at each batch size (benchmarks/gpu_fp8_paths.py)

    python -m benchmarks.gpu_suite --sections ceilings,fp8_kernels,fp8_engine --out benchmarks/results/h200-fp8-DATE.json
    python -m benchmarks.gpu_suite --sections fp8_v3 --out benchmarks/results/h200-fp8-v3-DATE.json
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, N, K): the projections of a decode step, V2-Lite's and V3's
DENSE_SHAPES = [
    ("v2lite q_proj", 3072, 2048),
    ("v2lite kv_b_proj", 4096, 512),
    ("v2lite o_proj", 2048, 2048),
    ("v3 fused_qkv_a_proj", 2112, 7168),
    ("v3 q_b_proj", 24576, 1536),
    ("v3 o_proj", 7168, 16384),
    ("v3 dense gate_up", 36864, 7168),
    ("v3 dense down", 7168, 18432),
]
DECODE_ROWS = (1, 8, 32)
PREFILL_ROWS = 4096
# (name, experts incl. shared, hidden, expert width, top-k incl. shared)
MOE_SHAPES = [("v2lite", 66, 2048, 1408, 8), ("v3", 257, 7168, 2048, 9)]

V3_LAYERS = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=4,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
    moe_intermediate_size=2048, intermediate_size=18432, first_k_dense_replace=1, n_group=8, topk_group=4,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}, rope_theta=10000, torch_dtype="bfloat16",
)  # fmt: skip


def fp8_gemm_rate(bench: Callable) -> float:
    """TFLOP/s of torch's dense FP8 GEMM (cuBLASLt, per-tensor scales) at 8,192 cubed: the prefill denominator."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = bench(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * n**3 / ms / 1e9


def _bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the engine's bf16 linear layer runs (layers/linear.py): the skinny kernel where it pays, else cuBLAS."""
    from mlaserve.kernels.registry import SKINNY_LINEAR

    kernel = SKINNY_LINEAR.choose(x, w, None)
    return kernel(x, w, None) if kernel is not None else F.linear(x, w)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


def fp8_kernels(ceilings: dict, bench: Callable, bench_graph: Callable) -> dict:
    from mlaserve.kernels.block_fp8 import block_fp8_linear
    from mlaserve.layers.block_fp8 import dequantize, linear_reference, quantize

    if not ceilings:
        raise ValueError("the fp8_kernels section needs the ceilings section in the same run")
    fp8_tflops = fp8_gemm_rate(bench)
    copy = ceilings["copy_GBps"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, n, k in DENSE_SHAPES:
        w, s = quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
        bf16 = dequantize(w, s, 128).to(torch.bfloat16)
        weight_bytes = w.numel() + s.numel() * 4
        for rows in (*DECODE_ROWS, PREFILL_ROWS):
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            w8a8 = rows > 16
            error = _relative_error(
                block_fp8_linear(x, w, s, 128), linear_reference(x, w, s, 128, quantize_activations=w8a8)
            )
            fp8_ms = bench_graph(partial(block_fp8_linear, x, w, s, 128))
            bf16_ms = bench_graph(partial(_bf16_linear, x, bf16))
            row = {"shape": name, "N": n, "K": k, "rows": rows, "path": "W8A8" if w8a8 else "W8A16",
                   "relative_error": error, "fp8_ms": fp8_ms, "bf16_ms": bf16_ms, "bf16_over_fp8": bf16_ms / fp8_ms}  # fmt: skip
            if w8a8:
                row["fp8_TFLOPs"] = 2 * rows * n * k / fp8_ms / 1e9
                row["pct_of_fp8_gemm"] = 100 * row["fp8_TFLOPs"] / fp8_tflops
            else:
                row["fp8_GBps"] = weight_bytes / fp8_ms / 1e6
                row["pct_of_copy"] = 100 * row["fp8_GBps"] / copy
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    return {"fp8_gemm_TFLOPs": fp8_tflops, "dense": rows_out, "moe": _moe_rows(gen, bench_graph)}


def _moe_rows(gen: torch.Generator, bench_graph: Callable) -> list[dict]:
    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.block_fp8 import dequantize, quantize
    from mlaserve.layers.moe import experts_reference

    def experts_fp8(count: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 weights, scales and the bf16 weights they stand for, drawn one expert at a time (float32 draws of
        all of V3's experts at once would not fit beside them)."""
        w = torch.empty(count, n, k, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(count, -(-n // 128), -(-k // 128), device="cuda")
        b = torch.empty(count, n, k, dtype=torch.bfloat16, device="cuda")
        for e in range(count):
            w[e], s[e] = quantize(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)
            b[e] = dequantize(w[e], s[e], 128)
        return w, s, b

    rows = []
    for name, experts, hidden, inter, top_k in MOE_SHAPES:
        w13, s13, b13 = experts_fp8(experts, 2 * inter, hidden)
        w2, s2, b2 = experts_fp8(experts, hidden, inter)
        scales = {"w13_scale": s13, "w2_scale": s2, "group_n": 128}
        for tokens in (1, 32, 4096):
            x = torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            ids = torch.stack(
                [torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)]
            )
            weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
            got = fused_experts(x, w13, w2, weights, ids, F.silu, **scales)
            error = None
            if tokens <= 32:  # the per-expert loop is the reference; at 4,096 tokens it is slow, not wrong
                error = _relative_error(got, experts_reference(x, b13, b2, weights, ids, F.silu))
            fp8_ms = bench_graph(partial(fused_experts, x, w13, w2, weights, ids, F.silu, **scales))
            bf16_ms = bench_graph(partial(fused_experts, x, b13, b2, weights, ids, F.silu))
            row = {"shape": name, "tokens": tokens, "relative_error": error, "fp8_ms": fp8_ms, "bf16_ms": bf16_ms,
                   "bf16_over_fp8": bf16_ms / fp8_ms}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        w13 = w2 = b13 = b2 = None  # before the next shape's experts are drawn
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def fp8_engine(
    tmp: Path,
    ceilings: dict,
    lite_llm: Callable,
    lite_workload: Callable,
    timed_walls: Callable,
    mixed: Callable,
) -> dict:
    """Lite and mixed workloads, bf16 weights then the same model's weights in block FP8."""
    result: dict = {}
    for label, options in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
        llm = lite_llm(tmp / "v2lite", **options)
        stats = llm.stats()
        result[f"{label}_weight_bytes_by_kind"] = stats["weight_bytes_by_kind"]
        gen = torch.Generator().manual_seed(0)
        for batch in (1, 32):
            prompts, params = lite_workload(llm, gen, batch)
            walls, outs = timed_walls(llm, prompts, params, 5)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            result[f"{label}_batch{batch}_tok_s"] = tokens / sorted(walls)[len(walls) // 2]
            result[f"{label}_batch{batch}_walls_s"] = walls
            print(
                f"fp8_engine {label} batch {batch}: {result[f'{label}_batch{batch}_tok_s']:.1f} tok/s",
                flush=True,
            )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for batch in (1, 32):
        result[f"fp8_over_bf16_batch{batch}"] = (
            result[f"fp8_batch{batch}_tok_s"] / result[f"bf16_batch{batch}_tok_s"]
        )
    runs = [("bf16", {}), ("fp8_weights", {"quantization": "fp8"})]
    result["mixed"] = mixed(tmp, ceilings, runs)
    by_run = {r["run"]: r["output_tok_per_s"] for r in result["mixed"]["rows"]}
    result["mixed_fp8_over_bf16"] = by_run["fp8_weights"] / by_run["bf16"]
    return result


def fp8_v3(tmp: Path, step_timer: Callable) -> dict:
    from mlaserve import LLM, SamplingParams

    folder = tmp / "v3layers"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(V3_LAYERS))
    base = dict(load_format="dummy", quantization="fp8", device="cuda", skip_tokenizer_init=True, block_size=64,
                max_model_len=2048, gpu_memory_utilization=0.85)  # fmt: skip
    result: dict = {}
    gen = torch.Generator().manual_seed(0)
    spot = [{"prompt_token_ids": torch.randint(0, 129280, (n,), generator=gen).tolist()} for n in (7, 100)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = {}
    for label, options in (
        ("reference", dict(attention_backend="torch", enforce_eager=True)),
        ("graphs", {}),
    ):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=8, **base, **options)
        runs[label] = llm.generate(spot, params, use_tqdm=False)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    worst = 0.0
    for a, b in zip(runs["reference"], runs["graphs"], strict=True):
        for token, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            worst = max(worst, abs(x[token].logprob - y[token].logprob if token in y else float("inf")))
    result["float32_spot_check"] = {
        "tokens_equal": [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["reference"], runs["graphs"])],
        "max_logprob_difference": worst,
    }  # fmt: skip
    print("fp8_v3 spot check", json.dumps(result["float32_spot_check"]), flush=True)

    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=128, **base)
    result["weight_bytes_by_kind"] = llm.stats()["weight_bytes_by_kind"]
    decode = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for batch in (1, 32, 128):
        prompts = [
            {"prompt_token_ids": torch.randint(0, 129280, (128,), generator=gen).tolist()}
            for _ in range(batch)
        ]
        llm.generate(
            prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        llm.engine.kv_manager.reset_prefix_cache()
        with step_timer(llm.engine, torch.cuda.synchronize) as timer:
            llm.generate(prompts, decode, use_tqdm=False)
        result[f"batch{batch}_decode_tok_s"] = timer.tokens_per_s
        result[f"batch{batch}_decode_step_ms"] = 1e3 * timer.seconds / max(timer.steps, 1)
        print(f"fp8_v3 batch {batch}: {timer.tokens_per_s:.1f} tok/s", flush=True)
        llm.engine.kv_manager.reset_prefix_cache()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    result["eager_step_shares"] = _shares(folder, base, gen)
    return result


def _shares(folder: Path, base: dict, gen: torch.Generator) -> dict:
    """Milliseconds of an eager decode step at batch 32 in attention, dense MLPs and MoE layers (CUDA events around
    each module, kept for the calls of 32 rows: the decode steps), beside the whole step's wall time."""
    from mlaserve import LLM, SamplingParams

    batch, steps = 32, 16
    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=batch, enforce_eager=True, **base)
    model = llm.engine.core.executor.model
    spans: dict[str, list] = {"attention": [], "dense_mlp": [], "moe": []}
    open_spans: dict[int, torch.cuda.Event] = {}

    def rows(args: tuple) -> int:
        return next(t.shape[0] for t in args if isinstance(t, torch.Tensor) and t.dim() == 2)

    def before(module: torch.nn.Module, args: tuple) -> None:
        if rows(args) == batch:
            open_spans[id(module)] = _event()

    def after(module: torch.nn.Module, args: tuple, out: object, name: str) -> None:
        start = open_spans.pop(id(module), None)
        if start is not None:
            spans[name].append((start, _event()))

    for layer in model.model.layers:
        mlp = "moe" if hasattr(layer.mlp, "experts") else "dense_mlp"
        for module, name in ((layer.self_attn, "attention"), (layer.mlp, mlp)):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(lambda m, a, out, name=name: after(m, a, out, name))
    prompts = [
        {"prompt_token_ids": torch.randint(0, 129280, (128,), generator=gen).tolist()} for _ in range(batch)
    ]
    with_steps = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    for kept in spans.values():
        kept.clear()
    from benchmarks.step_timer import DecodeStepTimer

    with DecodeStepTimer(llm.engine, torch.cuda.synchronize) as timer:
        llm.generate(prompts, with_steps, use_tqdm=False)
    decode_steps = len(spans["attention"]) // len(model.model.layers)
    shares = {f"{name}_ms_per_step": sum(a.elapsed_time(b) for a, b in kept) / max(decode_steps, 1)
              for name, kept in spans.items()}  # fmt: skip
    shares["decode_step_ms"] = 1e3 * timer.seconds / max(timer.steps, 1)
    shares["decode_steps"] = decode_steps
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return shares


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
