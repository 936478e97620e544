# ruff: noqa: B023, F401  (kept as it ran: every lambda is called inside its own loop iteration)
"""Exploration on one H200 (2026-11-30), kept as it ran at commit 445da04 so its figures can be traced:
decode-kernel variants (split counts, tiles, an fp8 "hi+lo" dot path that no longer exists in the kernel, so the
decode section fails on today's code), the one-launch MoE sort against the torch version, and profiles of the
V2-Lite engine at batch 1 and 32. Output: benchmarks/results/h200-explore-2026-11-30/.

    python benchmarks/h200_explore.py OUT_DIR sort,decode,e2e

Known fault: the e2e section's throughput part ran out of GPU memory, because the first engine was still
referenced (`runner`) when the second was built: explore.json holds the sort and decode sections, and the e2e
section left its two profile tables. The suite (gpu_suite.py) is the figure of record.
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_suite import LAT, ROPE, bench, ceilings, lite_llm, paged_case  # noqa: E402
from mlaserve.attention.torch_ref import TorchBackend  # noqa: E402
from mlaserve.attention.triton.mla_decode import mla_decode  # noqa: E402
from mlaserve.kvcache.quant import quantize_rows  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")
report = {}
sections = sys.argv[2].split(",") if len(sys.argv) > 2 else ["decode", "e2e"]


def timed(fn):
    try:
        return bench(fn)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


if "sort" in sections:
    from mlaserve.layers.fused_moe import sort_by_expert, sort_by_expert_reference

    res = []
    for tokens in (1, 32, 256, 682):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        ids = torch.stack([torch.randperm(64, generator=g, device="cuda")[:6] for _ in range(tokens)])
        a, b = sort_by_expert(ids, 64, 16), sort_by_expert_reference(ids, 64, 16)
        ok = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        res.append(
            dict(
                tokens=tokens,
                equal=ok,
                fused_ms=timed(lambda: sort_by_expert(ids, 64, 16)),
                torch_ms=timed(lambda: sort_by_expert_reference(ids, 64, 16)),
            )
        )
        print(res[-1], flush=True)
    report["sort"] = res

if "decode" in sections:
    ceil = ceilings()
    print("ceilings", ceil, flush=True)
    report["ceilings"] = ceil
    scale = 1 / (192**0.5)
    rows = []
    for batch, heads, length in [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192)]:
        q, cache, table, meta = paged_case(batch, heads, [length] * batch, 64, torch.bfloat16, 0)
        sl = meta.seq_lens

        def run(c=cache, **kw):
            return mla_decode(q, c, table, sl, length, LAT, scale, **kw)

        row = {"B": batch, "H": heads, "L": length, "default": timed(run)}
        row["splits"] = {n: timed(lambda n=n: run(num_splits=n)) for n in (1, 2, 3, 4, 6, 8)}
        cfgs = {}
        if heads <= 16:
            for bn, w, st in [
                (64, 4, 2),
                (64, 4, 3),
                (64, 8, 2),
                (64, 8, 4),
                (32, 4, 3),
                (32, 4, 4),
                (128, 8, 2),
            ]:
                cfgs[f"bh16_bn{bn}_w{w}_s{st}"] = timed(
                    lambda bn=bn, w=w, st=st: run(block_h=16, block_n=bn, num_warps=w, num_stages=st)
                )
            rows8 = quantize_rows(cache.view(-1, LAT + ROPE), torch.float8_e4m3fn).view(
                *cache.shape[:3], LAT + ROPE + 16
            )
            row["fp8"] = timed(lambda: run(rows8))
            row["fp8_split"] = timed(lambda: run(rows8, fp8_split=True))
            for bn, w, st in [(64, 4, 3), (64, 8, 3), (64, 8, 4), (128, 8, 3), (32, 4, 4)]:
                cfgs[f"fp8split_bn{bn}_w{w}_s{st}"] = timed(
                    lambda bn=bn, w=w, st=st: run(
                        rows8, fp8_split=True, block_n=bn, num_warps=w, num_stages=st
                    )
                )
            # correctness of the split path against the dequantizing path (same rows)
            a = run(rows8)[0].float()
            b = run(rows8, fp8_split=True)[0].float()
            row["fp8_split_vs_dequant_max_abs"] = (a - b).abs().max().item()
            row["fp8_out_max_abs"] = a.abs().max().item()
            rows_i8 = quantize_rows(cache.view(-1, LAT + ROPE), torch.int8).view(
                *cache.shape[:3], LAT + ROPE + 16
            )
            row["int8"] = timed(lambda: run(rows_i8))
            del rows8, rows_i8
        else:
            for bh, bn, w, st in [
                (64, 32, 4, 2),
                (64, 32, 8, 2),
                (64, 64, 4, 1),
                (64, 64, 8, 1),
                (64, 64, 8, 2),
                (32, 64, 4, 2),
                (32, 64, 8, 2),
                (64, 16, 4, 3),
                (128, 32, 8, 1),
            ]:
                cfgs[f"bh{bh}_bn{bn}_w{w}_s{st}"] = timed(
                    lambda bh=bh, bn=bn, w=w, st=st: run(block_h=bh, block_n=bn, num_warps=w, num_stages=st)
                )
        row["configs"] = cfgs
        nbytes = batch * length * (LAT + ROPE) * 2
        flops = 2 * batch * heads * length * (LAT + ROPE + LAT)
        best = min(
            [
                row["default"],
                *[v for v in row["splits"].values() if isinstance(v, float)],
                *[v for v in cfgs.values() if isinstance(v, float) and "fp8" not in str(v)],
            ]
        )
        row["default_pct_copy"] = 100 * nbytes / row["default"] / 1e6 / ceil["copy_GBps"]
        row["default_pct_gemm"] = 100 * flops / row["default"] / 1e9 / ceil["bf16_gemm_TFLOPs"]
        row["best_ms"] = best
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache, q
        torch.cuda.empty_cache()
    report["decode"] = rows
    (OUT / "explore.json").write_text(json.dumps(report, indent=1))


if "e2e" in sections:
    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams

    tmp = Path("/tmp/explore")
    tmp.mkdir(exist_ok=True)
    llm = lite_llm(tmp / "v2lite")
    gen = torch.Generator().manual_seed(0)
    runner = llm.engine.runner
    for batch in (1, 32):
        prompts = [
            {"prompt_token_ids": torch.randint(0, 100000, (512,), generator=gen).tolist()}
            for _ in range(batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(
            prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        llm.engine.kv_manager.reset_prefix_cache()
        exec_time = [0.0]
        orig = runner.execute

        def wrapped(out, orig=orig):
            t = time.perf_counter()
            r = orig(out)
            exec_time[0] += time.perf_counter() - t
            return r

        runner.execute = wrapped
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        runner.execute = orig
        llm.engine.kv_manager.reset_prefix_cache()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"e2e batch {batch}: {tokens / wall:.1f} tok/s wall {wall:.3f}s, runner.execute {exec_time[0]:.3f}s",
            flush=True,
        )
        report[f"e2e_batch{batch}"] = {"tok_s": tokens / wall, "wall": wall, "execute_s": exec_time[0]}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
            )
        llm.engine.kv_manager.reset_prefix_cache()
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70
        )
        print(table, flush=True)
        (OUT / f"profile_b{batch}.txt").write_text(table)
    # throughput workload, with a split of wall time between scheduling and model steps
    del llm
    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 100000, (1000,), generator=gen).tolist()} for _ in range(256)
    ]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    exec_time, steps = [0.0], [0]
    orig = runner.execute

    def wrapped2(out, orig=orig):
        t = time.perf_counter()
        r = orig(out)
        torch.cuda.synchronize()
        exec_time[0] += time.perf_counter() - t
        steps[0] += 1
        return r

    runner.execute = wrapped2
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    print(
        f"throughput: {256 / wall:.2f} req/s wall {wall:.2f}s execute(synced) {exec_time[0]:.2f}s steps {steps[0]}",
        flush=True,
    )
    report["throughput"] = {
        "req_s": 256 / wall,
        "wall": wall,
        "execute_synced_s": exec_time[0],
        "steps": steps[0],
    }
    runner.execute = orig
    llm.engine.kv_manager.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(
            prompts[:64], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
        )
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
    print(table, flush=True)
    (OUT / "profile_tp.txt").write_text(table)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    print(table, flush=True)
    (OUT / "explore.json").write_text(json.dumps(report, indent=1))
