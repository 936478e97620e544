"""The GPU suite's `mixed` section: a mixed-length workload on the DeepSeek-V2-Lite shape (random bf16 weights), all
submitted at once, against a roofline computed from the model's shapes and the GPU's measured ceilings.

Workload (seeded): 256 requests, prompt lengths log-normal around 500 tokens (16 to 4,000), output lengths
log-normal around 100 (8 to 512), ignore_eos. Reported: requests/s and output tokens/s of one `LLM.generate` over
all of them, for the bf16 and the fp8 latent cache, first with plenty of KV memory (gpu_memory_utilization 0.85),
then with a 2 GiB KV budget that holds only part of the workload at once (the 8-bit cache fits twice the rows).

Roofline (a lower bound on the wall time, printed beside it): every prompt's prefill at the measured bf16 GEMM rate
(2 x the active parameters per token, plus causal attention), then the decode steps as the workload's lengths make
them (every request decoding from the start, the longest last), each at the larger of its bytes at the measured
copy rate (the weights the step touches: attention, shared and dense MLPs, the routed experts its batch is expected
to hit, the LM head; and every running request's KV rows) and its FLOPs at the GEMM rate.

    python -m benchmarks.gpu_suite --sections ceilings,mixed --out benchmarks/results/h200-mixed-DATE.json
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

REQUESTS = 256
# About a third of the bf16 KV the whole workload would hold at once (kv_bytes_whole_workload_bf16 in the JSON).
LIMITED_KV_BYTES = 2 << 30


def workload(seed: int = 0, count: int = REQUESTS) -> list[tuple[int, int]]:
    """(prompt length, output length) per request."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.exp(torch.randn(count, generator=gen) * 0.9 + math.log(500)).clamp(16, 4000)
    outputs = torch.exp(torch.randn(count, generator=gen) * 1.0 + math.log(100)).clamp(8, 512)
    return list(zip(prompts.round().int().tolist(), outputs.round().int().tolist(), strict=True))


def requests(work: list[tuple[int, int]]) -> tuple[list[dict], list]:
    """The workload as seeded random prompt ids and greedy params of each output length (ignore_eos)."""
    from mlaserve import SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, 100000, (p,), generator=gen).tolist()} for p, _ in work]
    return prompts, [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]


def shapes(cfg: dict) -> dict:
    """Parameter counts of a DeepSeek-V2/V3-style config: per layer kind, and what a token activates."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, rank = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    q = (
        h * heads * (nope + rope)
        if not cfg.get("q_lora_rank")
        else cfg["q_lora_rank"] * (h + heads * (nope + rope))
    )
    attention = q + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
    layers, dense_layers = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
    expert = 3 * h * cfg["moe_intermediate_size"]
    return {
        "attention": attention * layers,
        "dense_mlp": 3 * h * cfg["intermediate_size"] * dense_layers,
        "shared_experts": expert * (cfg.get("n_shared_experts") or 0) * (layers - dense_layers),
        "expert": expert,
        "moe_layers": layers - dense_layers,
        "experts": cfg["n_routed_experts"],
        "top_k": cfg["num_experts_per_tok"],
        "lm_head": h * cfg["vocab_size"],
        "attention_width": heads * (nope + rope + v),  # per layer: the expanded prefill's QK and PV widths
        "latent_width": heads * (2 * rank + rope),  # per layer: absorbed decode's FLOPs per context row / 2
        "layers": layers,
    }


def roofline(
    work: list[tuple[int, int]], s: dict, kv_bytes_per_token: int, copy_Bps: float, flops: float
) -> dict:
    per_token = (
        s["attention"] + s["dense_mlp"] + s["shared_experts"] + s["moe_layers"] * s["top_k"] * s["expert"]
    )
    prefill_flops = sum(
        2 * p * per_token + 2 * s["lm_head"] + 2 * s["layers"] * s["attention_width"] * p * (p + 1) / 2
        for p, _ in work
    )
    decode_s, steps = 0.0, max(o for _, o in work) - 1
    for t in range(1, steps + 1):  # step t: every request with more than t output tokens makes its (t+1)-th
        running = [(p, o) for p, o in work if o > t]
        b = len(running)
        touched = s["experts"] * (
            1 - (1 - s["top_k"] / s["experts"]) ** b
        )  # expected distinct experts per layer
        weights = s["attention"] + s["dense_mlp"] + s["shared_experts"] + s["lm_head"]
        weights += s["moe_layers"] * touched * s["expert"]
        context = sum(p + t for p, _ in running)
        step_bytes = 2 * weights + context * kv_bytes_per_token
        step_flops = 2 * b * (per_token + s["lm_head"]) + 2 * s["layers"] * s["latent_width"] * context
        decode_s += max(step_bytes / copy_Bps, step_flops / flops)
    prefill_s = prefill_flops / flops
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "decode_steps": steps,
    }


RUNS: list[tuple[str, dict]] = [
    ("bf16", {}),
    ("fp8", {"kv_cache_dtype": "fp8_e4m3"}),
    ("bf16_kv_limited", {"kv_cache_memory_bytes": LIMITED_KV_BYTES}),
    ("fp8_kv_limited", {"kv_cache_memory_bytes": LIMITED_KV_BYTES, "kv_cache_dtype": "fp8_e4m3"}),
    ("bf16_prefill_first", {"prefill_first": True}),
]


def mixed(
    tmp: Path,
    ceilings: dict,
    lite_llm: Callable,
    config: dict,
    step_timer: Callable,
    runs: list[tuple[str, dict]] = RUNS,
) -> dict:
    """runs: (name, engine options) of each pass over the workload; the cache ratios need RUNS' names."""
    from mlaserve import SamplingParams

    if not ceilings:
        raise ValueError("the mixed section's roofline needs the ceilings section in the same run")
    work = workload()
    prompts, params = requests(work)
    s = shapes(config)
    copy_Bps, flops = ceilings["copy_GBps"] * 1e9, ceilings["bf16_gemm_TFLOPs"] * 1e12
    rows = []
    tok_s = {}
    for name, options in runs:
        gc.collect()
        torch.cuda.empty_cache()
        llm = lite_llm(tmp / "v2lite", max_num_seqs=REQUESTS, **options)
        kv_bpt = llm.stats()["kv_bytes_per_token"]
        llm.generate(
            prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
        llm.engine.kv_manager.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == sum(o for _, o in work)
        bound = roofline(work, s, kv_bpt, copy_Bps, flops)
        row = {
            "run": name,
            "options": options,
            "kv_capacity_tokens": llm.stats()["kv_capacity_tokens"],
            "num_preemptions": llm.stats()["num_preemptions"],
            "kv_bytes_per_token": kv_bpt,
            "wall_s": wall,
            "req_per_s": len(work) / wall,
            "output_tok_per_s": tokens / wall,
            "roofline": bound,
            "roofline_over_wall": bound["total_s"] / wall,
        }
        if name in ("bf16", "bf16_prefill_first"):  # where the time goes: a second run, every step timed
            llm.engine.kv_manager.reset_prefix_cache()
            with step_timer(llm.engine, torch.cuda.synchronize) as timer:
                llm.generate(prompts, params, use_tqdm=False)
            row["steps_timed"] = {
                "decode_only": {"steps": timer.steps, "seconds": timer.seconds, "tokens": timer.tokens},
                "with_prompt_tokens": {
                    "steps": timer.other_steps,
                    "seconds": timer.other_seconds,
                    "tokens": timer.other_tokens,
                },
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
        tok_s[name] = row["output_tok_per_s"]
        del llm
    lengths = [p for p, _ in work], [o for _, o in work]
    return {
        "rows": rows,
        "requests": len(work),
        "prompt_tokens": sum(lengths[0]),
        "output_tokens": sum(lengths[1]),
        "prompt_len_p50_p99_max": _spread(lengths[0]),
        "output_len_p50_p99_max": _spread(lengths[1]),
        "kv_bytes_whole_workload_bf16": sum(p + o for p, o in work) * rows[0]["kv_bytes_per_token"],
        **({"fp8_over_bf16_tok_s": tok_s["fp8"] / tok_s["bf16"]} if {"fp8", "bf16"} <= tok_s.keys() else {}),
        **(
            {"fp8_over_bf16_tok_s_kv_limited": tok_s["fp8_kv_limited"] / tok_s["bf16_kv_limited"]}
            if {"fp8_kv_limited", "bf16_kv_limited"} <= tok_s.keys()
            else {}
        ),
    }


def _spread(values: list[int]) -> list[int]:
    ordered = sorted(values)
    return [ordered[len(ordered) // 2], ordered[int(0.99 * (len(ordered) - 1))], ordered[-1]]
