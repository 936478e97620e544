"""Where the end-to-end GPU time goes: a diagnosis run on one GPU, not the figures of record (gpu_suite.py).

  python benchmarks/diagnose/h200_diagnose.py OUT.json [--sections moe,prefill_attn,steps]

moe           fused MoE at V2-Lite expert shapes, 1 to 16,384 tokens: today's tile plan against forced tile
              heights (64 and 128 also with torch's sort in place of ours) and the unfused
              activation, each checked against the per-expert loop; plus 128-row tiles
moe_grouped_mm the prefill MoE at the engine's shape (shared experts stored with the routed ones): the Triton
              grouped GEMM against torch's (CUTLASS) grouped GEMM, 256 to 16,384 tokens, checked against each other
shared_moe    V2-Lite's MoE with its two shared experts stored after the routed ones (one grouped GEMM per
              projection, today's engine) against the shared MLP run apart as the engine ran it before (a
              merged gate/up linear, silu-and-mul, a down linear, added in the combine), 1 to 8,192 tokens,
              graph-replayed, each checked against the other
prefill_attn  prefill attention of one throughput step (10 prompts of 1,000 tokens, V2-Lite heads): the
              per-sequence SDPA loop on shapes it has not seen and on warm shapes, and torch's varlen_attn
steps         the V2-Lite engine (random bf16 weights): every engine step timed (batch 1 and 32 of the lite
              workload, five repeats each, then the 256-request throughput workload), with the Triton
              compiles that happened inside each repeat
skinny        the skinny-GEMM kernel against cuBLAS at V2-Lite's decode projections (1, 4, 16 rows), each tile
              variant timed inside a CUDA graph over enough weight copies to stream from HBM; and the float32
              router gate (kernels/router.py's gate_logits) against its cuBLAS linear
decode_timing the memory-bound decode shapes timed eagerly (as the suite does) and as CUDA-graph replays (no host
              launch work in the timed span), three rounds each, bf16 and fp8 caches, to tell kernel time from
              launch overhead in the suite's run-to-run spread
page_ahead    the decode kernel with the next tile's page looked up one tile ahead (the KV tile then gets two
              shared-memory buffers), tile and warp variants, graph-replayed beside the defaults at the
              memory-bound shapes, at short contexts under a split count sized for a long max_model_len (as the
              engine's decode graphs run them), at batch 1 and at 128 heads; checked against the default's output
decode_options the same cases: today's decode defaults against page_ahead off and against
              the defaults before page_ahead
wide_warps    the same cases, the 64-head kernel with 16 warps against 8
fp8_tiles     the same cases, the 8-bit kernel with 16-row tiles, 2 or 4 warps, and more splits
widen_bits    8-bit caches at the memory-bound shapes: tiles widened by conversion instructions against integer
              operations, beside the bf16 cache
wgmma         the Gluon split kernel (kernels/mla_decode/gluon_wgmma.py) against the Triton kernel at five many-head shapes (batch
              1 to 128, 64 and 128 heads), graph-replayed, checked against the Triton kernel's output
decode_breakdown the default decode at batch 64 over contexts 1,024-16,384 and at (128, 16, 8,192): graph replay
              time against the split and merge kernels' own durations (torch.profiler), for fitting the
              streaming rate and the fixed cost of a call
fp8_breakdown the same for the fp8-dot kernel beside the bf16 default: batch 128 at one split per sequence (128
              CTAs) over 32 to 256 tiles per CTA, and (64, 16, 4,096) with the defaults: the query split's, the
              split step's and the merge's own durations against the replay
decode_flush  the decode record shapes and the copy ceiling timed with L2 emptied by a read (the suite's bench), by
              zeroing a buffer (triton's do_bench) and not at all (back-to-back graph replays)
overlap       lite batch 1 and 32 with asynchronous scheduling off and on: walls, lookahead launches, GPU busy
              time against its span and the idle gaps between kernels (torch.profiler), the host's CUDA calls
burst         serve_vs_offline's 256-prompt burst offline, every step timed: decode-first at token budgets 2,048 and
              8,192, prefill-first; a torch profile of one mixed step (prompt chunk beside running decodes)
step_kernels  the lite workload at batch 1 and 32: walls (prefill alone and with 64 new tokens), one captured decode
              step's GPU time and its kernels by name (launches and microseconds per step)
prefill_kernels the lite workload's prefill alone at batch 1 and 32: walls, GPU busy time against the wall, kernels
              by name (torch.profiler)
big_decode    a captured decode step at batch 64, 128 and 256 with 1,024-token contexts: GPU time and kernels
host          where host time goes: torch.profiler over one batch-1 prefill of 512 tokens (CPU ops by self
              time, syncs, GPU busy time), and cProfile over the lite workload at batch 1 and 32 (functions by
              own time)
"""

import argparse
import collections
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import (  # noqa: E402
    bench,
    bench_graph,
    lite_llm,
    lite_workload,
    random_prompts,
    run_header,
    timed_walls,
)

HID, INTER, E, TOPK = 2048, 1408, 64, 6


def moe() -> dict:
    from mlaserve.kernels.moe.dispatch import fused_experts, tile_plan
    from mlaserve.kernels.moe.grouped_gemm import _grouped_gemm
    from mlaserve.kernels.moe.sort import sort_by_expert
    from mlaserve.layers.moe import experts_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    unfused = lambda t: F.silu(t)  # noqa: E731  (not F.silu itself: takes the unfused activation path)
    rows = []
    from mlaserve.kernels.moe import sort as expert_sort

    for tokens in (1, 8, 32, 256, 512, 1024, 2048, 4096, 16384):
        x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOPK, dim=-1)[1]
        weights = torch.rand(tokens, TOPK, device="cuda", generator=g)
        ref = experts_reference(x, w13, w2, weights, ids, F.silu).float() if tokens <= 4096 else None
        row = {"tokens": tokens, "plan": list(tile_plan(tokens * TOPK, E))}
        variants = {"plan": (None, F.silu), "plan_unfused_act": (None, unfused)}
        for bm in (16, 64, 128):
            variants[f"sorted{bm}"] = (bm, F.silu)
        # the same tile heights with the torch sort where the one-program sort would take them
        variants |= {f"sorted{bm}_torch_sort": (bm, F.silu) for bm in (64, 128)}
        limit = expert_sort.MAX_CHUNKS
        for name, (bm, act) in variants.items():
            expert_sort.MAX_CHUNKS = 0 if name.endswith("torch_sort") else limit
            out = fused_experts(x, w13, w2, weights, ids, act, block_m=bm)
            if ref is not None:
                row[f"{name}_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            row[f"{name}_ms"] = bench(
                lambda bm=bm, act=act, x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i, act, block_m=bm)
            )
        expert_sort.MAX_CHUNKS = limit
        rows.append(row)
        print(json.dumps(row), flush=True)

    # 128-row tile shapes for the long-prefill w13 GEMM (gated), against the 64-row default
    sweep = []
    for tokens in (4096, 16384):
        x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOPK, dim=-1)[1]
        pairs = tokens * TOPK
        for bm, bn, bk, warps, stages in [(64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3),
                                          (128, 256, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4),
                                          (128, 128, 32, 8, 4), (128, 256, 32, 8, 4)]:  # fmt: skip
            sorted_ids, tile_expert = sort_by_expert(ids, E, bm)
            c = torch.empty(pairs, INTER, dtype=x.dtype, device="cuda")
            grid = (tile_expert.numel(), -(-INTER // bn))

            def run(
                x=x,
                pairs=pairs,
                bm=bm,
                bn=bn,
                bk=bk,
                warps=warps,
                stages=stages,
                s=sorted_ids,
                t=tile_expert,
                c=c,
                grid=grid,
            ):
                _grouped_gemm[grid](
                    x, w13, c, s, t, c, pairs, INTER, HID,
                    x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), c.stride(0),
                    ROW_DIV=TOPK, MUL_ROUTE=False, GATED=True, PAIR_TILES=False, BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_K=bk, PRECISION="tf32", PDL=False, num_warps=warps, num_stages=stages,
                )  # fmt: skip

            try:
                ms = bench(run)
                flops = 2 * pairs * 2 * INTER * HID
                entry = dict(tokens=tokens, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, ms=ms,
                             tflops=flops / ms / 1e9)  # fmt: skip
            except Exception as err:  # a shape that does not fit shared memory
                entry = dict(
                    tokens=tokens, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, error=str(err)[:200]
                )
            sweep.append(entry)
            print(json.dumps(entry), flush=True)
    return {"rows": rows, "w13_gated_sweep": sweep}


def moe_mixed() -> dict:
    """The fused MoE at the mixed workload's sizes (benchmarks/gpu_mixed.py): decode batches of 45, 106 and 229
    tokens, where it streams nearly every expert's weights, and its 8,192-token prefill chunks. Each tile height
    beside the plan's: ms, and the touched experts' weight bytes per second (decode) or TFLOP/s (prefill)."""
    from mlaserve.kernels.moe.dispatch import fused_experts, tile_plan

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    rows = []
    for tokens in (45, 106, 229, 8192):
        x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOPK, dim=-1)[1]
        weights = torch.rand(tokens, TOPK, device="cuda", generator=g)
        touched = ids.unique().numel()
        row = {"tokens": tokens, "plan": list(tile_plan(tokens * TOPK, E)), "experts_touched": touched}
        for bm in (None, 16, 32, 64, 128):
            ms = bench(
                lambda bm=bm, x=x, w=weights, i=ids: fused_experts(x, w13, w2, w, i, F.silu, block_m=bm)
            )
            key = "plan" if bm is None else f"bm{bm}"
            row[f"{key}_ms"] = ms
            if tokens < 1024:
                row[f"{key}_GBps"] = touched * 3 * HID * INTER * 2 / ms / 1e6
            else:
                row[f"{key}_TFLOPs"] = tokens * TOPK * 3 * HID * INTER * 2 / ms / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def moe_grouped_mm() -> dict:
    """The prefill MoE at V2-Lite's engine shape (64 routed experts, top 6, the 2 shared experts stored after them
    and taken by every token): the Triton grouped GEMM at its planned tile height against torch's grouped GEMM
    (moe/grouped_mm.py), 256 to 16,384 tokens, each checked against the other (and the per-expert loop
    up to 2,048 tokens); ms and TFLOP/s of the routed and shared expert FLOPs."""
    from mlaserve.kernels.moe.dispatch import fused_experts, tile_plan
    from mlaserve.kernels.moe.grouped_mm import grouped_mm_experts
    from mlaserve.layers.moe import experts_reference, with_shared_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    experts = E + 2
    w13 = torch.randn(experts, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(experts, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    rows = []
    for tokens in (256, 512, 1024, 2048, 4096, 8192, 16384):
        x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOPK, dim=-1)[1]
        weights, ids = with_shared_experts(torch.rand(tokens, TOPK, device="cuda", generator=g), ids, E, 2)
        pairs = ids.numel()
        block_m = tile_plan(pairs, experts)[0]
        triton_out = fused_experts(x, w13, w2, weights, ids, F.silu, block_m=block_m).float()
        torch_out = grouped_mm_experts(x, w13, w2, weights, ids, F.silu).float()
        row = {"tokens": tokens, "pairs": pairs, "triton_block_m": block_m}
        row["rel_diff"] = ((torch_out - triton_out).norm() / triton_out.norm()).item()
        if tokens <= 2048:
            ref = experts_reference(x, w13, w2, weights, ids, F.silu).float()
            row["triton_rel_err"] = ((triton_out - ref).norm() / ref.norm()).item()
            row["grouped_mm_rel_err"] = ((torch_out - ref).norm() / ref.norm()).item()
        flops = pairs * 3 * HID * INTER * 2
        for name, fn, kwargs in (
            ("triton", fused_experts, {"block_m": block_m}),
            ("grouped_mm", grouped_mm_experts, {}),
        ):
            ms = bench(lambda fn=fn, x=x, w=weights, i=ids, kw=kwargs: fn(x, w13, w2, w, i, F.silu, **kw))
            row[f"{name}_ms"], row[f"{name}_TFLOPs"] = ms, flops / ms / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def shared_moe() -> dict:
    from mlaserve.kernels.moe.dispatch import fused_experts
    from mlaserve.layers.activation import gated_act
    from mlaserve.layers.linear import ReplicatedLinear

    shared = 2
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E + shared, 2 * INTER, HID, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E + shared, HID, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    # the same shared experts as one MLP of shared x INTER: gate rows, then up rows; down's columns in order
    # through the engine's linear layers (skinny kernel or cuBLAS, as they choose)
    gate_up, down = ReplicatedLinear(HID, 2 * shared * INTER), ReplicatedLinear(shared * INTER, HID)
    gate_up.weight.data = torch.cat(
        (w13[E:, :INTER].flatten(0, 1), w13[E:, INTER:].flatten(0, 1))
    ).contiguous()
    down.weight.data = torch.cat(list(w2[E:]), dim=1).contiguous()

    rows = []
    for tokens in (1, 4, 32, 256, 2048, 8192):
        x = torch.randn(tokens, HID, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOPK, dim=-1)[1]
        weights = torch.rand(tokens, TOPK, device="cuda", generator=g)
        ids_all = torch.cat((ids, torch.arange(E, E + shared, device="cuda").expand(tokens, -1)), 1)
        weights_all = torch.cat((weights, torch.ones(tokens, shared, device="cuda")), 1)

        def fused(x=x, w=weights_all, i=ids_all):
            return fused_experts(x, w13, w2, w, i, F.silu)

        def apart(x=x, w=weights, i=ids):
            mlp = down(gated_act(gate_up(x)))
            return fused_experts(x, w13[:E], w2[:E], w, i, F.silu, add=mlp)

        a, b = fused().float(), apart().float()
        row = dict(tokens=tokens, rel_diff=((a - b).norm() / b.norm()).item(),
                   fused_ms=bench_graph(fused), apart_ms=bench_graph(apart))  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def prefill_attn() -> dict:
    heads, dqk, dv, n_seq = 16, 192, 128, 10
    g = torch.Generator(device="cuda").manual_seed(1)
    result = {}

    def loop(lens):
        total = sum(lens)
        q = torch.randn(total, heads, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(total, heads, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(total, heads, dv, device="cuda", dtype=torch.bfloat16, generator=g)
        outs, s = [], 0
        for n in lens:
            qi, ki, vi = (t[s : s + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).squeeze(0).transpose(0, 1))
            s += n
        return torch.cat(outs)

    for label, lens in (
        ("new_shapes", [1000 + i for i in range(n_seq)]),
        ("warm_shapes", [1000 + i for i in range(n_seq)]),
    ):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loop(lens)
        torch.cuda.synchronize()
        result[f"sdpa_loop_{label}_ms"] = (time.perf_counter() - t) * 1e3
    lens = [1000 + 11 + i for i in range(n_seq)]
    loop(lens)
    result["sdpa_loop_warm_bench_ms"] = bench(lambda: loop(lens))
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        result["varlen_signature"] = str(inspect.signature(varlen_attn))
        total = sum(lens)
        q = torch.randn(total, heads, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(total, heads, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(total, heads, dqk, device="cuda", dtype=torch.bfloat16, generator=g)  # padded to dqk
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        params = inspect.signature(varlen_attn).parameters
        kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **kw)
        s0, n0 = 0, lens[0]
        ref = (
            F.scaled_dot_product_attention(
                *(t[s0 : s0 + n0].transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True
            )
            .squeeze(0)
            .transpose(0, 1)
        )
        result["varlen_max_err_seq0"] = (out[:n0].float() - ref.float()).abs().max().item()
        result["varlen_ms"] = bench(lambda: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **kw))
    except Exception as err:
        result["varlen_error"] = repr(err)[:300]
    print(json.dumps(result), flush=True)
    return result


def stall_counters() -> dict:
    stats = torch.cuda.memory_stats()
    return {
        "gc_full": gc.get_stats()[2]["collections"],
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "cuda_mallocs": stats.get("num_device_alloc", 0),
        "cuda_frees": stats.get("num_device_free", 0),
    }


class StepLog:
    """Times every engine step (synchronized) and counts Triton compiles while active."""

    def __init__(self, engine) -> None:
        self.engine, self.steps, self.compiles = engine, [], []

    def __enter__(self):
        import triton.runtime.jit as jit

        apply, step = self.engine._apply, self.engine.step
        self._jit, self._orig = jit.JITFunction, jit.JITFunction._do_compile
        info = {}

        def apply_and_note(out, result, *rest):  # the step this call collects (queued earlier when async)
            info.update(tokens=out.num_batched_tokens, seqs=len(out.scheduled))
            return apply(out, result, *rest)

        def timed_step(**kwargs):
            torch.cuda.synchronize()
            before = stall_counters()
            t, cpu = time.perf_counter(), time.thread_time()
            outs = step(**kwargs)
            # host_ms: until step() returns; cpu_ms: this thread's CPU time in it. A slow step with a small
            # host_ms waited on the GPU; a large host_ms with a small cpu_ms was blocked (a sync, a lock).
            host_ms, cpu_ms = (time.perf_counter() - t) * 1e3, (time.thread_time() - cpu) * 1e3
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) * 1e3
            # What may stall a step: a full collection, the allocator's cudaMalloc/cudaFree (a retry frees the
            # whole cache). Kept only where one happened.
            stalls = {k: v - before[k] for k, v in stall_counters().items() if v != before[k]}
            self.steps.append(
                dict(info, ms=ms, host_ms=host_ms, cpu_ms=cpu_ms, **({"stalls": stalls} if stalls else {}))
            )
            return outs

        log, orig = self.compiles, self._orig

        def counted(fn, *args, **kwargs):
            t = time.perf_counter()
            kernel = orig(fn, *args, **kwargs)
            log.append(
                dict(kernel=getattr(fn, "__name__", str(fn)), s=time.perf_counter() - t, step=len(self.steps))
            )
            return kernel

        self.engine._apply, self.engine.step = apply_and_note, timed_step
        self._jit._do_compile = counted
        self.collections = []
        gc.callbacks.append(self._full_collection)
        return self

    def _full_collection(self, phase: str, info: dict) -> None:
        """Each full collection while active: how long it took, what it walked (the unfrozen objects it found
        in the oldest generation, by type) and what it freed, at which step."""
        if info["generation"] != 2:
            return
        if phase == "start":
            walked = gc.get_objects(generation=2)
            types = collections.Counter(type(o).__name__ for o in walked).most_common(8)
            self._started = (time.perf_counter(), len(walked), types)
            return
        t, walked, types = self._started
        self.collections.append(
            dict(step=len(self.steps), ms=(time.perf_counter() - t) * 1e3, walked=walked, types=types,
                 frozen=gc.get_freeze_count(), collected=info["collected"], uncollectable=info["uncollectable"])
        )  # fmt: skip

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._full_collection)
        del self.engine._apply, self.engine.step
        self._jit._do_compile = self._orig
        self.engine = None  # a log kept for its figures must not keep the engine's memory

    def summary(self) -> dict:
        decode = [s for s in self.steps if s["tokens"] == s["seqs"]]
        mixed = [s for s in self.steps if s["tokens"] != s["seqs"]]
        slow = sorted(self.steps, key=lambda s: -s["ms"])[:8]
        return dict(
            steps=len(self.steps), total_ms=sum(s["ms"] for s in self.steps),
            decode_steps=len(decode), decode_ms=sum(s["ms"] for s in decode),
            prefill_steps=len(mixed), prefill_ms=sum(s["ms"] for s in mixed),
            prefill_tokens=sum(s["tokens"] - 0 for s in mixed), slowest=slow,
            compiles=len(self.compiles), compile_s=sum(c["s"] for c in self.compiles),
            compiled=[f"{c['kernel']}@{c['step']}:{c['s']:.2f}s" for c in self.compiles][:20],
            stalls=[dict(step=i, **s) for i, s in enumerate(self.steps) if "stalls" in s][:20],
            full_collections=self.collections,
        )  # fmt: skip


def graph_replay_ms(llm, batch: int) -> float | None:
    """GPU time of one captured decode step (the step's host work excluded)."""
    graphs = llm.engine.runner.graphs
    return None if graphs is None or batch not in graphs.graphs else bench(graphs.graphs[batch].replay)


def eager_kernels(llm, prompts: list, new_tokens: int) -> list:
    """The decode kernels of an eager run (graphs off), summed by name: [name, launches per step, us per step]."""
    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams

    runner = llm.engine.runner
    graphs, runner.graphs = runner.graphs, None
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    try:
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
        )  # cache the prompts
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.graphs = graphs
        llm.engine.kv_manager.reset_prefix_cache()
    steps = new_tokens - 1  # the first step re-prefills the last prompt token
    rows = [(e.key, e.count / steps, e.self_device_time_total / steps) for e in prof.key_averages()]
    rows = [r for r in rows if r[2] > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(
        f"eager kernels: {total:.0f} us per step (incl. one prefill of 1 token spread over the steps)",
        flush=True,
    )
    for name, count, us in rows[:40]:
        print(f"  {us:8.1f} us {count:6.1f}x  {name[:100]}", flush=True)
    return [[name[:120], round(count, 2), round(us, 2)] for name, count, us in rows]


def graph_us_per_call(fn, weights: list) -> float:
    """Microseconds per fn(w), timed inside one CUDA graph that calls it on every weight copy in turn."""
    fn(weights[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return bench(graph.replay) * 1e3 / len(weights)


def skinny() -> dict:
    from mlaserve.kernels.router import gate_logits
    from mlaserve.kernels.skinny import skinny_linear, tile_for

    shapes = {
        "q_proj": (3072, 2048), "kv_a": (576, 2048), "o_proj": (2048, 2048), "shared_gate_up": (2816, 2048),
        "shared_down": (2048, 1408), "lm_head": (102400, 2048), "gate_fp32": (64, 2048),
    }  # fmt: skip
    tiles = [
        (16, 128, 4, 4),
        (32, 256, 4, 4),
        (64, 128, 4, 4),
        (16, 512, 4, 3),
        (16, 256, 2, 4),
        (32, 128, 4, 4),
    ]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, (n, k) in shapes.items():
        gate = name.endswith("fp32")  # the router's float32 gate: its own kernel, no tiles to sweep
        wdtype = torch.float32 if gate else torch.bfloat16
        copies = max(1, -(-256_000_000 // (n * k * wdtype.itemsize)))  # 256 MB of weights: beyond L2
        ws = [torch.randn(n, k, device="cuda", generator=g).to(wdtype) / k**0.5 for _ in range(copies)]
        for rows in (1, 4, 16):
            x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
            want = F.linear(x.to(wdtype), ws[0]).float()
            kernel = gate_logits if gate else skinny_linear
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "rows": rows,
                "default_tile": None if gate else list(tile_for(n)),
            }
            row["cublas_us"] = graph_us_per_call(lambda w, x=x: F.linear(x.to(w.dtype), w), ws)
            row["default_us"] = graph_us_per_call(lambda w, x=x, f=kernel: f(x, w), ws)
            row["max_err"] = (kernel(x, ws[0]).float() - want).abs().max().item()
            for tile in [] if gate else tiles:
                row[f"tile_{'_'.join(map(str, tile))}_us"] = graph_us_per_call(
                    lambda w, x=x, t=tile: skinny_linear(x, w, tile=t), ws
                )
            row["weight_GBps_default"] = n * k * wdtype.itemsize / row["default_us"] / 1e3
            rows_out.append(row)
            print(
                json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in row.items()}),
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    return {"rows": rows_out}


def decode_timing() -> dict:
    from benchmarks.gpu_suite import LAT, paged_case
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    rows = []
    for rnd in range(3):
        for batch, length in ((64, 4096), (128, 8192)):
            q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, rnd)
            caches = {"bf16": cache, "fp8_e4m3": quantize_rows(cache, QUANTIZED["fp8_e4m3"])}
            for name, kv in caches.items():
                args = (q, kv, table, meta.seq_lens, length, LAT, 0.07)
                call = lambda args=args: mla_decode(*args)  # noqa: E731
                eager = bench(call)
                replay = bench_graph(call)
                row = dict(round=rnd, B=batch, L=length, cache=name, eager_ms=eager, graph_ms=replay)
                row["latent_GBps_graph"] = batch * length * (LAT + 64) * 2 / replay / 1e6
                if name == "bf16" and rnd < 2:  # split counts and pipeline depths, graph-timed
                    for kw in ({"num_splits": n} for n in (2, 3, 4, 6, 8)):
                        row[f"graph_ms_{kw}"] = bench_graph(
                            lambda kw=kw, args=args: mla_decode_tuned(*args, **kw)
                        )
                    for stages in (2, 4):
                        kw = dict(kernel="triton", num_splits=4, num_stages=stages)
                        row[f"graph_ms_{kw}"] = bench_graph(
                            lambda kw=kw, args=args: mla_decode_tuned(*args, **kw)
                        )
                rows.append(row)
                print(json.dumps(row), flush=True)
            del caches, cache
    return {"rows": rows}


# (batch, heads, context, the max_seq_len the split count is sized for, whether to time an fp8 cache too)
DECODE_CASES = [
    (64, 16, 4096, 4096, True),
    (128, 16, 8192, 8192, True),
    (32, 16, 512, 8192, False),
    (32, 16, 2048, 8192, False),
    (1, 16, 4096, 16384, False),
    (1, 16, 16384, 16384, False),
    (64, 128, 4096, 4096, False),
    (128, 128, 8192, 8192, False),
]
# The defaults before page_ahead (5b4c9a8, whose run labelled them {}).
OLD_DEFAULTS = {"kernel": "triton", "page_ahead": False, "block_n": 64, "num_warps": 8}


def decode_variants(
    bf16_variants: list, fp8_variants: list, wide_variants: list, cases: list = DECODE_CASES
) -> dict:
    """Decode kernel variants (mla_decode_tuned's kernel and tuning knobs) graph-replayed on the same inputs at
    `cases`, each checked against the first variant's output; the 16-head cases take bf16_variants (and
    fp8_variants on an fp8 cache), more heads wide_variants."""
    from benchmarks.gpu_suite import LAT, paged_case
    from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    rows = []
    for batch, heads, length, max_len, with_fp8 in cases:
        q, cache, table, meta = paged_case(batch, heads, [length] * batch, 64, torch.bfloat16, 0)
        runs = [("bf16", cache, bf16_variants if heads <= 16 else wide_variants)]
        if with_fp8:
            fp8 = quantize_rows(cache, QUANTIZED["fp8_e4m3"])
            runs.append(("fp8_e4m3", fp8, fp8_variants))
        bf16_ms = None
        for name, kv, variants in runs:
            args = (q, kv, table, meta.seq_lens, max_len, LAT, 0.07)
            want = mla_decode_tuned(*args, **variants[0])[0].float()
            for kw in variants:
                label = {k: str(v) for k, v in kw.items()}
                try:
                    got = mla_decode_tuned(*args, **kw)[0].float()
                    ms = bench_graph(lambda kw=kw, args=args: mla_decode_tuned(*args, **kw))
                except Exception as err:  # a variant that does not compile is a result too
                    rows.append(
                        dict(B=batch, H=heads, L=length, cache=name, kwargs=label, error=repr(err)[:300])
                    )
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                bf16_ms = bf16_ms if bf16_ms is not None else ms
                row = dict(B=batch, H=heads, L=length, max_seq_len=max_len, cache=name, kwargs=label, graph_ms=ms,
                           max_diff_vs_first=(got - want).abs().max().item(),
                           latent_GBps=batch * length * (LAT + 64) * 2 / ms / 1e6, vs_bf16_first=ms / bf16_ms)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        del runs, cache
        torch.cuda.empty_cache()
    return {"rows": rows}


def page_ahead() -> dict:
    """The Triton kernel's page lookup one tile ahead, with tile, warp, stage, split and partial-dtype variants."""
    ahead32 = {"kernel": "triton", "page_ahead": True, "block_n": 32, "num_warps": 4}
    return decode_variants(
        bf16_variants=[
            OLD_DEFAULTS,
            {"kernel": "triton", "page_ahead": True},
            ahead32,
            {**ahead32, "num_warps": 8},
            {**ahead32, "num_stages": 4},
            {**ahead32, "partial_dtype": torch.bfloat16},
            *({**ahead32, "num_splits": n} for n in (2, 3, 6, 8)),
        ],
        fp8_variants=[
            {"kernel": "triton"},
            {"kernel": "triton", "page_ahead": True, "prefetch": False},
            {"kernel": "triton", "page_ahead": True, "prefetch": False, "block_n": 64, "num_warps": 8},
        ],
        wide_variants=[
            {"kernel": "triton"},
            {"kernel": "triton", "page_ahead": True},
            {"kernel": "triton", "page_ahead": True, "block_n": 32, "num_stages": 3},
        ],
    )


def wgmma() -> dict:
    """The Gluon split kernel for 64 heads per program (gluon_wgmma.py: each warpgroup computes half of the
    scores) against the Triton kernel, whose two warpgroups both computed all of them, at many-head shapes."""
    cases = [
        (64, 128, 4096, 4096, False),
        (128, 128, 8192, 8192, False),
        (32, 128, 2048, 8192, False),
        (1, 128, 16384, 16384, False),
        (64, 64, 4096, 4096, False),
    ]
    return decode_variants(
        bf16_variants=[{}], fp8_variants=[{}], wide_variants=[{"kernel": "triton"}, {}], cases=cases
    )


def eight_bit_variants(cases: list, variants: list, caches: tuple = ("fp8_e4m3", "int8")) -> dict:
    """8-bit caches at 16 heads, at (batch, context, max_seq_len) `cases`: each of `variants` (mla_decode_tuned's
    kernel and tuning knobs)
    graph-replayed beside the bf16 cache and checked against the first variant's output and against the torch
    reference over the dequantized cache (output and LSE), beside how far the cache's own rounding moved that
    reference from the one over the bf16 cache."""
    from benchmarks.gpu_suite import LAT, ROPE, paged_case
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kernels.mla_decode.tuning import decode_plan, mla_decode_tuned
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    rows = []
    for batch, length, max_len in cases:
        q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
        args = (table, meta.seq_lens, max_len, LAT, 0.07)
        bf16_ms = bench_graph(lambda q=q, c=cache, a=args: mla_decode(q, c, *a))
        exact, exact_lse = TorchBackend().decode(q.float(), cache, None, meta, 0.07, LAT, need_lse=True)
        for name in caches:
            rows8 = quantize_rows(cache, QUANTIZED[name])
            ref, ref_lse = TorchBackend().decode(q.float(), rows8, None, meta, 0.07, LAT, need_lse=True)
            want = mla_decode_tuned(q, rows8, *args, **variants[0])[0].float()
            for kw in variants:
                got, lse = mla_decode_tuned(q, rows8, *args, **kw)
                ms = bench_graph(lambda kw=kw, q=q, r=rows8, a=args: mla_decode_tuned(q, r, *a, **kw))
                rows.append(dict(B=batch, L=length, cache=name, kwargs={k: str(v) for k, v in kw.items()},
                                 kernel=decode_plan(q, rows8, max_len, LAT, ROPE, **kw).kernel,
                                 graph_ms=ms, bf16_ms=bf16_ms, vs_bf16=ms / bf16_ms,
                                 max_diff_vs_first=(got.float() - want).abs().max().item(),
                                 max_diff_vs_ref=(got.float() - ref).abs().max().item(),
                                 lse_max_diff_vs_ref=(lse - ref_lse).abs().max().item(),
                                 cache_rounding_out=(ref - exact).abs().max().item(),
                                 cache_rounding_lse=(ref_lse - exact_lse).abs().max().item(),
                                 ref_max_abs=ref.abs().max().item()))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del rows8
        del q, cache
        torch.cuda.empty_cache()
    return {"rows": rows}


def widen_bits() -> dict:
    """8-bit caches at the memory-bound shapes, in the Triton kernel: tiles widened to fp16 by conversion
    instructions (widen_bits=False) against integer operations (its default since the run at 74c9aa9, which timed
    them in the other order and named the check column max_diff_vs_default)."""
    variants = [{"kernel": "triton", "widen_bits": False}, {"kernel": "triton"}]
    return eight_bit_variants([(64, 4096, 4096), (128, 8192, 8192)], variants)


def wgmma8() -> dict:
    """8-bit caches at 16 heads: the Triton kernel, today's default (the dispatcher's: a Gluon kernel for fp8 on
    sm_90, the Triton kernel for int8) and the widening Gluon kernel. The run at a5aa549 (check column
    max_diff_vs_triton) also timed fp8 widened by integer operations inside the Gluon kernel: 1.4-1.6x the
    paired conversion's time."""
    cases = [(64, 4096, 4096), (128, 8192, 8192), (32, 2048, 8192), (1, 16384, 16384)]
    return eight_bit_variants(cases, [{"kernel": "triton"}, {}, {"kernel": "gluon_wgmma8"}])


def fp8_dots() -> dict:
    """fp8 caches at 16 heads: the Triton kernel, the Gluon kernel that widens the tile (gluon_wgmma8), the
    dispatcher's choice, and the one running both dots on fp8 tensor cores (gluon_fp8: the default where
    fp8_dots_pay says so), that one also with plain launches of its split step and merge (pdl=False)."""
    cases = [(64, 4096, 4096), (128, 8192, 8192), (32, 2048, 8192), (1, 16384, 16384)]
    variants = [
        {"kernel": "triton"},
        {"kernel": "gluon_wgmma8"},
        {},
        {"kernel": "gluon_fp8"},
        {"kernel": "gluon_fp8", "pdl": False},
    ]
    return eight_bit_variants(cases, variants, caches=("fp8_e4m3",))


def fp8_splits() -> dict:
    """The fp8-dot kernel at other split counts than fp8_dot_splits picks (about one CTA per SM): more CTAs than SMs
    run in waves, and the block scheduler gives the later ones to whichever SMs finish first, which could even out
    the SMs' unequal bandwidth (fp8_phases.py's per-CTA timestamps show CTAs of equal work ending over a 4.5 us
    spread). At 16416a3 one CTA per SM was fastest at every shape, by far: (64, 4,096) 54.6 us at 2 splits against
    63.9-77.7 at 3, 4 and 8."""
    rows = []
    for case, counts in (
        ((64, 4096, 4096), (2, 3, 4, 8)),
        ((128, 8192, 8192), (1, 2, 3)),
        ((32, 2048, 8192), (4, 8)),
    ):
        variants = [{"kernel": "gluon_fp8", "num_splits": n} for n in counts]
        rows += eight_bit_variants([case], variants, caches=("fp8_e4m3",))["rows"]
    return {"rows": rows}


def fp8_rule() -> dict:
    """Where the fp8-dot kernel should take over from the widening one by default (rules.fp8_dots_pay): both kernels
    at contexts whose split gives each CTA 4, 8, 12 and 16 tiles (fp8_dot_splits on 132 SMs), from batch 1 to 128;
    then 8 to 32 tiles per CTA on grids of 16 to 128 CTAs (the grid's fill), and 4 tiles on a full grid. At 52c0c31
    and c4426da the fp8-dot kernel won on every grid of 128 CTAs, on 64 and 96 at 8 tiles, and at batch 1 with 16
    and 32 tiles; it lost at 8 tiles on 16 and 32 CTAs and at 4 tiles on 64. Rerun at e0625db (one partial per
    CTA), fp8_dots_pay picked the faster kernel at 26 of 27 shapes."""
    cases = [
        (1, 8192, 8192),
        (8, 8192, 8192),
        (16, 4096, 4096),
        (16, 6144, 6144),
        (32, 2048, 2048),
        (32, 3072, 3072),
        (64, 1024, 1024),
        (64, 1536, 1536),
        (128, 512, 512),
        (128, 768, 768),
        (64, 256, 256),
        (128, 1024, 1024),
        (2, 8192, 8192),
        (4, 8192, 8192),
        (6, 8192, 8192),
        (16, 2048, 2048),
        (48, 1024, 1024),
        (96, 512, 512),
        (2, 16384, 16384),
        (1, 32768, 32768),
        (1, 65536, 65536),
        (4, 65536, 65536),
        (128, 256, 256),
        (1, 16384, 16384),
        (1, 4096, 4096),
        (2, 4096, 4096),
        (8, 2048, 2048),
    ]
    variants = [{"kernel": "gluon_wgmma8"}, {"kernel": "gluon_fp8"}]
    return eight_bit_variants(cases, variants, caches=("fp8_e4m3",))


def decode_options() -> dict:
    """Today's defaults against page_ahead off and against the defaults before it. The run at f5fa3ce also
    timed the merge on programmatic dependent launch, since
    removed: 3-5% faster at batch 1, even at the large shapes, 1.5-3% slower at batch 32 with short contexts."""
    return decode_variants(
        bf16_variants=[
            {},
            {"kernel": "triton", "page_ahead": False},
            OLD_DEFAULTS,
            {"partial_dtype": torch.bfloat16},
        ],
        fp8_variants=[{}],
        wide_variants=[{}],
    )


def wide_warps() -> dict:
    """The 64-head (compute-bound) kernel with 16 warps: four warpgroups share each wgmma's columns, at 128
    registers a thread with no spills (compiled for sm_90), against today's 8."""
    return decode_variants(
        bf16_variants=[{}],
        fp8_variants=[{}],
        wide_variants=[
            {},
            {"kernel": "triton", "num_warps": 16},
            {"kernel": "triton", "num_warps": 16, "block_n": 32, "num_stages": 3},
        ],
    )


def fp8_tiles() -> dict:
    """The 8-bit kernel with 16-row tiles (192 registers at 4 warps; at 2 warps, four programs fit per SM), and more
    splits for the smaller programs, against today's 32-row tiles."""
    return decode_variants(
        bf16_variants=[{}],
        fp8_variants=[
            {"kernel": "triton"},
            {"kernel": "triton", "num_splits": 8},
            {"kernel": "triton", "block_n": 16},
            {"kernel": "triton", "block_n": 16, "num_warps": 2},
            {"kernel": "triton", "block_n": 16, "num_warps": 2, "num_splits": 8},
        ],
        wide_variants=[{}],
    )


def breakdown_row(batch: int, length: int, cache_dtype: str = "bfloat16", **kwargs) -> dict:
    """One decode call's graph replay median against its kernels' own durations (torch.profiler over replays of the
    same graph): the query split (fp8-dot kernel only), the split step and the merge. kwargs: mla_decode_tuned's
    kernel and tuning knobs."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_suite import LAT, paged_case
    from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    q, cache, table, meta = paged_case(batch, 16, [length] * batch, 64, torch.bfloat16, 0)
    if cache_dtype != "bfloat16":
        cache = quantize_rows(cache, QUANTIZED[cache_dtype])
    args = (q, cache, table, meta.seq_lens, length, LAT, 0.07)
    call = lambda: mla_decode_tuned(*args, **kwargs)  # noqa: E731
    replay_ms = bench_graph(call)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    replays = 50
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = {
        e.key: e.self_device_time_total / replays for e in prof.key_averages() if e.self_device_time_total
    }
    split_q = sum(us for name, us in kernels.items() if "split_queries" in name)
    stage2 = sum(us for name, us in kernels.items() if "_stage2" in name)
    stage1 = sum(kernels.values()) - split_q - stage2
    row = dict(B=batch, L=length, cache=cache_dtype, kwargs={k: str(v) for k, v in kwargs.items()},
               MB_read=cache[0, 0].numel() * cache.element_size() * batch * length / 1e6, graph_us=replay_ms * 1e3,
               split_queries_us=split_q, stage1_us=stage1, stage2_us=stage2,
               gaps_us=replay_ms * 1e3 - stage1 - stage2 - split_q,
               kernels={k[:80]: round(v, 2) for k, v in kernels.items()})  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def decode_breakdown() -> dict:
    """Where a decode call's time goes, default configuration, bf16 cache, over a sweep of context lengths at batch
    64 and the (128, 16, 8,192) shape (breakdown_row). Fitting time against bytes read separates the streaming rate
    from the fixed cost of a call."""
    shapes = ((64, 1024), (64, 2048), (64, 4096), (64, 8192), (64, 16384), (128, 8192))
    return {"rows": [breakdown_row(batch, length) for batch, length in shapes]}


def fp8_breakdown() -> dict:
    """The same for the fp8-dot kernel (fp8 cache, gluon_fp8) beside the bf16 default: batch 128 with one split
    per sequence (128 CTAs, one per SM) at 32 to 256 tiles per CTA, then (64, 16, 4,096) with the defaults.
    Fitting the split step's duration against tiles per CTA gives its per-tile time and its fixed cost. The fp8
    calls launch plainly (pdl=False): on programmatic dependent launch each kernel starts while the one before runs,
    so its duration would include that wait (the fp8_dots section times both launches)."""
    rows = []
    for length in (2048, 4096, 8192, 16384):
        rows.append(breakdown_row(128, length, "fp8_e4m3", kernel="gluon_fp8", num_splits=1, pdl=False))
        rows.append(breakdown_row(128, length))
    rows.append(breakdown_row(64, 4096, "fp8_e4m3", kernel="gluon_fp8", pdl=False))
    rows.append(breakdown_row(64, 4096))
    return {"rows": rows}


def decode_flush() -> dict:
    """How emptying L2 between timed runs moves the figures: the suite's bench (a read of 256 MiB), triton's
    do_bench (a 256 MiB buffer zeroed: dirty lines the timed kernels must write back first) and back-to-back graph
    replays (no emptying; 100 replays between two events), for the decode record shapes and the copy ceiling."""
    from benchmarks.gpu_suite import LAT, bench_dirty, paged_case
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kvcache.quant import QUANTIZED, quantize_rows

    def back_to_back(graph: torch.cuda.CUDAGraph, n: int = 100) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    rows = []
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = lambda pair=(dst, src): pair[0].copy_(pair[1])  # noqa: E731
    rows.append(dict(case="copy 1 GiB", read_flush_ms=bench(copy), dirty_flush_ms=bench_dirty(copy)))
    print(json.dumps(rows[-1]), flush=True)
    del copy, src, dst
    for batch, heads, length, cache_dtype in (
        (64, 16, 4096, "bf16"), (64, 16, 4096, "fp8_e4m3"), (128, 16, 8192, "bf16"), (64, 128, 4096, "bf16"),
    ):  # fmt: skip
        q, cache, table, meta = paged_case(batch, heads, [length] * batch, 64, torch.bfloat16, 0)
        if cache_dtype != "bf16":
            cache = quantize_rows(cache, QUANTIZED[cache_dtype])
        args = (q, cache, table, meta.seq_lens, length, LAT, 0.07)
        mla_decode(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mla_decode(*args)
        row = dict(case=f"decode B={batch} H={heads} L={length} {cache_dtype}", read_flush_ms=bench(graph.replay),
                   dirty_flush_ms=bench_dirty(graph.replay), back_to_back_ms=back_to_back(graph))  # fmt: skip
        row["latent_GBps_read_flush"] = batch * length * (LAT + 64) * 2 / row["read_flush_ms"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
        del graph, args, cache
        torch.cuda.empty_cache()
    return {"rows": rows}


def logged_generate(llm, prompts: list, params) -> tuple[float, StepLog]:
    """(wall seconds, the step log) of one generate call; the prefix cache is emptied after, so repeats prefill."""
    with StepLog(llm.engine) as log:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
    llm.engine.kv_manager.reset_prefix_cache()
    return wall, log


def steps(tmp: Path) -> dict:
    from mlaserve import SamplingParams

    result = {}
    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        prompts, params = lite_workload(llm, gen, batch)
        reps = []
        for _ in range(5):
            wall, log = logged_generate(llm, prompts, params)
            reps.append(dict(wall_s=wall, tok_s=batch * 64 / wall, **log.summary()))
            print(json.dumps({f"batch{batch}": reps[-1]}), flush=True)
        result[f"lite_batch{batch}"] = reps
        result[f"lite_batch{batch}_graph_replay_ms"] = graph_replay_ms(llm, batch)
        result[f"lite_batch{batch}_eager_kernels"] = eager_kernels(llm, prompts, 12)
        print(
            json.dumps({f"batch{batch}_graph_replay_ms": result[f"lite_batch{batch}_graph_replay_ms"]}),
            flush=True,
        )
    prompts = random_prompts(torch.Generator().manual_seed(1), 256, 1000)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    for rep in range(2):
        wall, log = logged_generate(llm, prompts, params)
        summary = dict(wall_s=wall, req_s=256 / wall, **log.summary())
        summary["step_list"] = [(s["tokens"], s["seqs"], round(s["ms"], 2)) for s in log.steps]
        result[f"throughput_{rep}"] = summary
        print(json.dumps({k: v for k, v in summary.items() if k != "step_list"}), flush=True)
    return result


def step_kernels(tmp: Path) -> dict:
    llm, gen, first = lite_engine(tmp)
    result = {}
    for batch in (1, 32):
        prompts, params = lite_workload(llm, gen, batch)
        walls = timed_walls(llm, prompts, params, 3)[0]
        result[f"batch{batch}"] = dict(
            walls_s=walls,
            tok_s=batch * 64 / sorted(walls)[1],
            prefill_walls_s=timed_walls(llm, prompts, first, 3)[0],
            graph_replay_ms=graph_replay_ms(llm, batch),
            kernels=graph_kernels(llm, batch),
        )
        print(json.dumps({k: v for k, v in result[f"batch{batch}"].items() if k != "kernels"}), flush=True)
    return result


def gpu_busy(kernels: list) -> tuple[float, float, list]:
    """(busy us: the union of the kernels' spans, span us from the first start to the last end, idle gaps as
    (us, the kernel after it)) of (start, end, name) sorted by start."""
    busy, gaps, reach = 0.0, [], kernels[0][0]
    for start, end, name in kernels:
        if start > reach:
            gaps.append((start - reach, name))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy, reach - kernels[0][0], gaps


def lite_engine(tmp: Path) -> tuple:
    """(the V2-Lite engine, a seeded generator, greedy one-token params) for the lite-workload sections."""
    from mlaserve import SamplingParams

    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    return llm, torch.Generator().manual_seed(0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prefill_kernels(tmp: Path) -> dict:
    """The lite workload's prefill alone (max_tokens=1) at batch 1 and 32: walls, then one run under torch.profiler:
    the GPU's busy time (union of kernel spans) against the wall, and the kernels by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    llm, gen, first = lite_engine(tmp)
    result = {}
    for batch in (1, 32):
        prompts, _ = lite_workload(llm, gen, batch)
        walls = timed_walls(llm, prompts, first, 3)[0]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        llm.engine.kv_manager.reset_prefix_cache()
        busy, span, _ = gpu_busy(
            sorted(
                (e.time_range.start, e.time_range.end, e.name)
                for e in prof.events()
                if e.device_type == DeviceType.CUDA
            )
        )
        rows = sorted(
            (
                (e.key, e.count, e.self_device_time_total)
                for e in prof.key_averages()
                if e.self_device_time_total > 0
            ),
            key=lambda r: -r[2],
        )
        result[f"batch{batch}"] = dict(
            walls_s=walls, profiled_wall_s=wall, gpu_busy_ms=busy / 1e3, gpu_span_ms=span / 1e3,
            launches=sum(r[1] for r in rows), kernels=[[k[:100], c, round(us, 1)] for k, c, us in rows[:25]],
        )  # fmt: skip
        print(json.dumps({k: v for k, v in result[f"batch{batch}"].items() if k != "kernels"}), flush=True)
        for k, c, us in rows[:25]:
            print(f"  {us:9.1f} us {c:5d}x  {k[:90]}", flush=True)
    return result


def big_decode(tmp: Path) -> dict:
    """A captured decode step at the mixed workload's batch sizes: 64, 128 and 256 sequences with 1,024-token
    prompts decode 8 tokens each, then that size's graph is replayed on the last step's inputs: its GPU time and
    kernels by name, beside the weight and KV bytes it must read."""
    from mlaserve import SamplingParams

    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(0)
    result = {}
    for batch in (64, 128, 256):
        prompts = random_prompts(gen, batch, 1024)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        result[f"batch{batch}"] = dict(
            graph_replay_ms=graph_replay_ms(llm, batch), kv_bytes=batch * 1032 * 27 * 576 * 2,
            kernels=graph_kernels(llm, batch),
        )  # fmt: skip
        llm.engine.kv_manager.reset_prefix_cache()
        print(f"batch {batch}: {result[f'batch{batch}']['graph_replay_ms']} ms", flush=True)
    return result


def host(tmp: Path) -> dict:
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams

    result = {}
    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(0)
    prompts, _ = lite_workload(llm, gen, 1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    walls = [w * 1e3 for w in timed_walls(llm, prompts, one, 3)[0]]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, one, use_tqdm=False)
        torch.cuda.synchronize()
    llm.engine.kv_manager.reset_prefix_cache()
    events = prof.key_averages()
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)
    gpu_us = sum(e.self_device_time_total for e in events)
    syncs = {
        e.key: e.count for e in events if "Synchronize" in e.key or "Memcpy" in e.key or "Malloc" in e.key
    }
    result["prefill512_batch1"] = dict(
        walls_ms=walls,
        gpu_busy_ms=gpu_us / 1e3,
        cpu_self_ms=sum(e.self_cpu_time_total for e in events) / 1e3,
        runtime_calls=syncs,
        top_cpu_ops=[[e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in cpu[:40]],
    )
    print(json.dumps(result["prefill512_batch1"]), flush=True)
    for batch in (1, 32):
        prompts, params = lite_workload(llm, gen, batch)
        llm.generate(prompts, params, use_tqdm=False)
        llm.engine.kv_manager.reset_prefix_cache()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
        wall = time.perf_counter() - t
        llm.engine.kv_manager.reset_prefix_cache()
        stats = pstats.Stats(prof).stats
        rows = [(f"{fn[0].split('/')[-1]}:{fn[1]}:{fn[2]}", s[1], s[2], s[3]) for fn, s in stats.items()]
        by_own = sorted(rows, key=lambda r: -r[2])[:40]
        by_cum = sorted(rows, key=lambda r: -r[3])[:40]
        result[f"cprofile_batch{batch}"] = dict(
            wall_s=wall,
            by_own_s=[[n, c, round(o, 4), round(cu, 4)] for n, c, o, cu in by_own],
            by_cumulative_s=[[n, c, round(o, 4), round(cu, 4)] for n, c, o, cu in by_cum],
        )
        print(
            json.dumps({f"cprofile_batch{batch}": result[f"cprofile_batch{batch}"]["by_own_s"][:25]}),
            flush=True,
        )
        result[f"graph_kernels_batch{batch}"] = graph_kernels(llm, batch)
    return result


def graph_kernels(llm, batch: int, replays: int = 20) -> list | None:
    """The kernels of one captured decode step, summed by name: [name, launches per step, us per step]. The
    graph replays with the inputs of the last decode step it ran."""
    from torch.profiler import ProfilerActivity, profile

    graphs = llm.engine.runner.graphs
    if graphs is None or batch not in graphs.graphs:
        return None
    graph = graphs.graphs[batch]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / replays, e.self_device_time_total / replays) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    print(
        f"graph kernels, batch {batch}: {sum(r[2] for r in rows):.0f} us, {sum(r[1] for r in rows):.0f} launches"
    )
    for name, count, us in rows[:30]:
        print(f"  {us:8.1f} us {count:6.1f}x  {name[:100]}", flush=True)
    return [[name[:120], round(count, 2), round(us, 2)] for name, count, us in rows]


def overlap(tmp: Path) -> dict:
    """Lite batch 1 and 32 with asynchronous scheduling off and on (one engine, the flag flipped between runs):
    wall times, lookahead launches, and from a torch.profiler trace of one run the GPU's busy time (union of kernel
    spans) against the span from its first to last kernel, the idle gaps between kernels, and the host calls that
    took longest in total (where the host waited)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams
    from mlaserve.runner.model_runner import ModelRunner

    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(0)
    launches = [0]
    launch = ModelRunner.launch

    def counted(self, output, previous=None):
        launches[0] += previous is not None
        return launch(self, output, previous)

    ModelRunner.launch = counted
    result = {}
    try:
        for batch in (1, 32):
            prompts, params = lite_workload(llm, gen, batch)
            first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            # the prefill step alone: what the decode steps add to it is the rest of a wall
            result[f"batch{batch}_prefill_walls_s"] = timed_walls(llm, prompts, first_token, 3)[0]
            for flag in (False, True):
                llm.engine.async_scheduling = flag
                launches[0] = 0
                walls = timed_walls(llm, prompts, params, 3)[0]
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    llm.generate(prompts, params, use_tqdm=False)
                    torch.cuda.synchronize()
                llm.engine.kv_manager.reset_prefix_cache()
                events = prof.events()
                kernels = sorted(
                    (e.time_range.start, e.time_range.end, e.name)
                    for e in events
                    if e.device_type == DeviceType.CUDA
                )
                busy, span, gaps = gpu_busy(kernels)
                host = {}
                for e in events:
                    if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
                        total, count = host.get(e.name, (0.0, 0))
                        host[e.name] = (total + e.cpu_time_total, count + 1)
                row = dict(
                    batch=batch, async_scheduling=flag, walls_s=walls, tok_s=batch * 64 / sorted(walls)[1],
                    lookahead_launches=launches[0] / 3, gpu_span_ms=span / 1e3,
                    gpu_busy_ms=busy / 1e3, gaps_over_20us=sum(1 for g, _ in gaps if g > 20),
                    gap_ms_over_20us=sum(g for g, _ in gaps if g > 20) / 1e3,
                    largest_gaps=[[round(g), n[:60]] for g, n in sorted(gaps, reverse=True)[:12]],
                    host_cuda_calls=sorted(
                        ([k, c, round(t / 1e3, 2)] for k, (t, c) in host.items()), key=lambda r: -r[2]
                    )[:12],
                )  # fmt: skip
                print(json.dumps(row), flush=True)
                result[f"batch{batch}_{'async' if flag else 'sync'}"] = row
    finally:
        ModelRunner.launch = launch
    return result


def burst(tmp: Path, runs: list[str] | None = None) -> dict:
    """serve_vs_offline's burst offline (256 prompts of 512 random ids, 128 new tokens, all at once) on the V2-Lite
    shape, every step timed: decode-first at token budgets of 2,048 and 8,192 and prefill-first at 8,192. Then a
    torch profile of one decode-first step that mixes a 2,048-token prompt chunk with running decodes (at a 2,048
    budget the burst ran at half the speed of 8,192: 65 such steps instead of 17): GPU kernel time by kernel, GPU
    busy time against the step's wall, the host's own time by op. runs: the schedules to run (default all)."""
    from torch.profiler import ProfilerActivity, profile

    from mlaserve import SamplingParams

    result = {}
    prompts = random_prompts(torch.Generator().manual_seed(2), 256, 512)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    schedules = {
        "decode_first_2048": {"max_num_batched_tokens": 2048},
        "decode_first_8192": {"max_num_batched_tokens": 8192},
        "prefill_first_8192": {"max_num_batched_tokens": 8192, "prefill_first": True},
    }
    for i, name in enumerate(runs or list(schedules)):  # a name given twice runs twice (the stall is rare)
        options = schedules[name]
        key = name if name not in result else f"{name}_{i}"
        llm = lite_llm(tmp / "v2lite", max_num_seqs=256, **options)
        llm.generate(prompts[:8], params, use_tqdm=False)
        llm.engine.kv_manager.reset_prefix_cache()
        wall, log = logged_generate(llm, prompts, params)
        summary = dict(wall_s=wall, tok_s=256 * 128 / wall, **log.summary())
        summary["step_list"] = [(s["tokens"], s["seqs"], round(s["ms"], 2)) for s in log.steps]
        result[key] = summary
        print(key, json.dumps({k: v for k, v in summary.items() if k != "step_list"}), flush=True)
        if name == "decode_first_2048":
            result["mixed_step_profile"] = _profile_mixed_step(
                llm, prompts, params, profile, ProfilerActivity
            )
            print(json.dumps(result["mixed_step_profile"])[:3000], flush=True)
        del llm, log
    return result


def _profile_mixed_step(llm, prompts: list, params, profile, activities) -> dict:
    """Admit 64 requests and decode them a few steps, add the rest, then profile the next three steps (each carries
    a prompt chunk beside the running decodes)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts[:64]):
        engine.add_request(prompt, params, request_id=f"warm-{i}")
    while engine.scheduler.num_waiting or not engine.scheduler.num_running:
        engine.step()
    for _ in range(3):
        engine.step()
    for i, prompt in enumerate(prompts[64:]):
        engine.add_request(prompt, params, request_id=f"burst-{i}")
    torch.cuda.synchronize()
    # Three steps: with asynchronous scheduling one call may only queue its step (the first try profiled nothing).
    with profile(activities=[activities.CPU, activities.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    events = prof.key_averages()
    gpu = sorted(events, key=lambda e: -e.self_device_time_total)
    cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)
    while engine.has_unfinished_requests():  # drain, so the engine ends clean
        engine.step()
    llm.engine.kv_manager.reset_prefix_cache()
    return dict(
        steps=3,
        wall_ms=wall_ms,
        gpu_busy_ms=sum(e.self_device_time_total for e in events) / 1e3,
        cpu_self_ms=sum(e.self_cpu_time_total for e in events) / 1e3,
        kernels=sum(e.count for e in events if e.self_device_time_total > 0),
        top_gpu=[[e.key[:80], e.count, round(e.self_device_time_total / 1e3, 3)] for e in gpu[:25]],
        top_cpu=[[e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in cpu[:25]],
    )


def mixed_steps(tmp: Path) -> dict:
    """The mixed section's bf16 workload (benchmarks/gpu_mixed.py), step by step. One run with every step timed
    (synchronized, StepLog): the decode-only steps by batch size (mean ms, host ms until step() returns, this
    thread's CPU ms) and how many ran as a graph replay; the prompt steps' tokens and ms. Then an unsynchronized run
    with torch.profiler windows of a few steps at four points (prompt chunks, a large decode batch, a middle one,
    the tail): wall, GPU busy time (union of kernel spans) and its gaps, kernels and host ops by time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_mixed import requests, workload
    from mlaserve import SamplingParams

    prompts, params = requests(workload())
    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    graphs = llm.engine.runner.graphs
    replays, run = [0], graphs.run

    def counted(*args, **kwargs):
        replays[0] += 1
        return run(*args, **kwargs)

    graphs.run = counted
    t = time.perf_counter()
    with StepLog(llm.engine) as log:
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    del graphs.run
    llm.engine.kv_manager.reset_prefix_cache()
    result = dict(synced_wall_s=wall, graph_replays=replays[0], **{k: v for k, v in log.summary().items()
                  if k in ("steps", "decode_steps", "decode_ms", "prefill_steps", "prefill_ms", "prefill_tokens",
                           "compiles", "stalls", "full_collections")})  # fmt: skip
    buckets = {}
    for s in log.steps:
        if s["tokens"] != s["seqs"]:
            continue
        key = next(b for b in (8, 16, 32, 64, 128, 192, 256) if s["seqs"] <= b)
        rows = buckets.setdefault(key, [])
        rows.append((s["ms"], s["host_ms"], s["cpu_ms"]))
    result["decode_by_batch_upto"] = {
        k: dict(steps=len(v), ms=sum(r[0] for r in v) / len(v), host_ms=sum(r[1] for r in v) / len(v),
                cpu_ms=sum(r[2] for r in v) / len(v))
        for k, v in sorted(buckets.items())
    }  # fmt: skip
    result["prompt_steps"] = [(s["tokens"], s["seqs"], round(s["ms"], 1), round(s["host_ms"], 1))
                              for s in log.steps if s["tokens"] != s["seqs"]]  # fmt: skip
    print(json.dumps(result), flush=True)

    engine, windows = llm.engine, {}
    marks = {1: "prompt_chunks", 40: "decode_early", 150: "decode_middle", 350: "decode_tail"}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=f"mixed-{i}")
    number, t = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        if number in marks:
            running = engine.scheduler.num_running
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(6):
                    engine.step()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 1e3
            number += 6
            kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                             if e.device_type == DeviceType.CUDA)  # fmt: skip
            busy, span, gaps = gpu_busy(kernels)
            events = prof.key_averages()
            gpu = sorted(events, key=lambda e: -e.self_device_time_total)
            cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)
            windows[marks[number - 6]] = dict(
                steps=6, running_before=running, wall_ms=ms, gpu_busy_ms=busy / 1e3, gpu_span_ms=span / 1e3,
                gap_ms_over_20us=sum(g for g, _ in gaps if g > 20) / 1e3,
                largest_gaps=[[round(g), n[:60]] for g, n in sorted(gaps, reverse=True)[:8]],
                top_gpu=[[e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)] for e in gpu[:20]],
                top_cpu=[[e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 3)] for e in cpu[:15]],
            )  # fmt: skip
            print(marks[number - 6], json.dumps(windows[marks[number - 6]]), flush=True)
            continue
        engine.step()
        number += 1
    torch.cuda.synchronize()
    result["profiled_run_wall_s"] = time.perf_counter() - t
    result["windows"] = windows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--sections", default="moe,prefill_attn,steps")
    parser.add_argument(
        "--burst-runs", default="", help="burst: the schedules to run, comma-separated (repeats allowed)"
    )
    args = parser.parse_args()
    out = run_header()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            fn = {
                "moe": moe,
                "moe_mixed": moe_mixed,
                "moe_grouped_mm": moe_grouped_mm,
                "shared_moe": shared_moe,
                "prefill_attn": prefill_attn,
                "steps": lambda: steps(Path(tmp)),
                "host": lambda: host(Path(tmp)),
                "step_kernels": lambda: step_kernels(Path(tmp)),
                "prefill_kernels": lambda: prefill_kernels(Path(tmp)),
                "big_decode": lambda: big_decode(Path(tmp)),
                "mixed_steps": lambda: mixed_steps(Path(tmp)),
                "skinny": skinny,
                "decode_timing": decode_timing,
                "page_ahead": page_ahead,
                "decode_options": decode_options,
                "wgmma": wgmma,
                "wgmma8": wgmma8,
                "fp8_dots": fp8_dots,
                "fp8_rule": fp8_rule,
                "fp8_splits": fp8_splits,
                "widen_bits": widen_bits,
                "decode_breakdown": decode_breakdown,
                "fp8_breakdown": fp8_breakdown,
                "decode_flush": decode_flush,
                "wide_warps": wide_warps,
                "fp8_tiles": fp8_tiles,
                "overlap": lambda: overlap(Path(tmp)),
                "burst": lambda: burst(Path(tmp), [r for r in args.burst_runs.split(",") if r]),
            }[name]
            t = time.perf_counter()
            try:
                out[name] = fn()
            except Exception as err:  # keep the other sections' figures
                import traceback

                traceback.print_exc()
                out[name] = {"error": repr(err)[:500]}
            out[f"{name}_seconds"] = time.perf_counter() - t
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
