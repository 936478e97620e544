"""The GPU suite's `tp` section: the DeepSeek-V2-Lite shape (random bf16 weights) at each tensor-parallel layout the
machine allows, from one run.

Layouts: size 1 in one process ("uni"); size 1 through the process group ("mp": the NCCL code path of the
multi-GPU engine, with its plan broadcast and collectives, on one GPU); and, with two GPUs or more, size N tensor
parallel and size N expert parallel. For each: the greedy tokens of 8 fixed prompts (compared with the first
layout's), decode tok/s at batch 1 and 32 (decode-only steps, benchmarks/step_timer.py), requests/s for 256
requests of 1,000 prompt + 100 output tokens submitted at once, and the collectives' share of a batch-32 decode
step: the device time of NCCL kernels over all device time in a torch profile of 8 eager steps (CUDA graphs hide
their kernels from the profiler, so those steps run in an engine built with enforce_eager).

    python -m benchmarks.gpu_suite --sections tp --out benchmarks/results/h200-tp-DATE.json
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path

import torch


def layouts() -> list[dict]:
    found = [dict(tensor_parallel_size=1), dict(tensor_parallel_size=1, distributed_executor_backend="mp")]
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        found += [
            dict(tensor_parallel_size=gpus),
            dict(tensor_parallel_size=gpus, enable_expert_parallel=True),
        ]
    return found


def tp(
    tmp: Path, lite_llm: Callable, random_prompts: Callable, timer_cls: type, timed_burst: Callable
) -> dict:
    from mlaserve import SamplingParams

    rows, reference = [], None
    gen = torch.Generator().manual_seed(0)
    fixed = random_prompts(gen, 8, 256)
    batch32 = random_prompts(gen, 32, 512)
    burst = random_prompts(gen, 256, 1000)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for layout in layouts():
        row: dict = {"layout": layout}
        llm = lite_llm(tmp / "v2lite", max_num_seqs=256, **layout)
        try:
            row["stats"] = llm.stats()
            tokens = [o.outputs[0].token_ids for o in llm.generate(fixed, greedy, use_tqdm=False)]
            if reference is None:
                reference = tokens
            row["greedy_tokens_equal_first_layout"] = tokens == reference
            row["greedy_tokens_differing_prompts"] = sum(
                a != b for a, b in zip(tokens, reference, strict=True)
            )
            for batch, prompts in ((1, batch32[:1]), (32, batch32)):
                llm.engine.kv_manager.reset_prefix_cache()
                with timer_cls(llm.engine, torch.cuda.synchronize) as timer:
                    llm.generate(
                        prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False
                    )
                row[f"decode_tok_s_batch{batch}"] = timer.tokens_per_s
            row["burst_256x1000+100_req_s"] = 256 / timed_burst(llm, burst)
        except Exception as e:  # noqa: BLE001 - the other layouts' figures still count
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            llm.engine.close()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        if "error" not in row:
            row["collective_share_of_decode_step"] = collective_share(tmp, lite_llm, batch32, layout)
        print(json.dumps({k: v for k, v in row.items() if k != "stats"}), flush=True)
        rows.append(row)
    return {"rows": rows, "gpus": torch.cuda.device_count(), "float32_tiny": float32_tiny(tmp)}


def float32_tiny(tmp: Path) -> dict:
    """bf16 greedy tokens may flip at near-ties between layouts (the MoE's shared-expert add is fused into the expert
    kernel in one process and joins after the all-reduce in a group); in float32 on a tiny random DeepSeek-V2 every
    layout must give the first layout's tokens, with logprobs within 1e-4."""
    from mlaserve import LLM, SamplingParams
    from mlaserve.testing.tiny_models import build_tiny

    folder = build_tiny("deepseek_v2", tmp / "tiny-f32")
    gen = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 40, 90, 17)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    results, reference = [], None
    for layout in layouts():
        llm = LLM(str(folder), dtype="float32", device="cuda", max_model_len=256, **layout)
        try:
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.close()
            del llm
            gc.collect()
        tokens = [o.token_ids for o in outs]
        chosen = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=True)] for o in outs]
        if reference is None:
            reference = tokens, chosen
        gap = (
            max(abs(a - b) for x, y in zip(chosen, reference[1]) for a, b in zip(x, y))
            if tokens == reference[0]
            else None
        )
        results.append({"layout": layout, "tokens_equal": tokens == reference[0], "max_logprob_diff": gap})
    return {"rows": results}


def collective_share(tmp: Path, lite_llm: Callable, prompts: list, layout: dict) -> dict:
    """NCCL kernels' device time over all kernels' device time in 8 eager decode steps at batch 32 (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams

    if layout["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in layout:
        return {"nccl_us_per_step": 0.0, "share": 0.0}  # one process: no collectives to profile
    llm = lite_llm(tmp / "v2lite", max_num_seqs=64, enforce_eager=True, **layout)
    try:
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        while engine.core.scheduler.num_waiting or any(
            r.num_output_tokens == 0 for r in engine.core.scheduler.running
        ):  # past every prefill
            engine.step()
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.engine.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    total = nccl = 0.0
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) or 0.0
        total += device_us
        if "nccl" in event.key.lower():
            nccl += device_us
    return {
        "nccl_us_per_step": nccl / 8,
        "device_us_per_step": total / 8,
        "share": nccl / total if total else None,
    }
