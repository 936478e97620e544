"""The GPU suite's `flashinfer` section (`--flashinfer-peer`): FlashInfer's paged MLA decode beside ours.

FlashInfer (its fa3 backend on sm_90, which vLLM and SGLang can use, and fa2) reads the very cache and queries our
kernel reads: the packed [pages, 64, 576] latent cache is our layout, and its page lists are our block table's
rows. Each shape is first checked against the torch reference (float32 over the same bf16 inputs), then timed as
CUDA-graph replays with L2 emptied before each (bench_graph); FlashInfer's `plan` (host-side scheduling, once per
step in the engine: attention/flashinfer_plan.py) stays outside the timed region and is timed apart on the host
(`plan_us`), since the engine pays it every step. FlashInfer runs without writing its log-sum-exp; ours always
writes one (the engine merges split contexts with it). The GPU image has no FlashInfer:
../shared/peers/flashinfer/README.md says how to carry it.

Rows: issue 46's shapes; a batch sweep at 16 and 128 heads that places the crossing the table rule
(attention/flashinfer_rule.py, FLASHINFER_MIN_BATCH) reads; uneven batches (lengths drawn from 1 to the context);
fp8 caches. Our 8-bit rows carry a per-row scale in their tail, which FlashInfer cannot read: its fp8 on sm_90 takes
per-tensor scales, so its fp8 row reads its own copy of the cache quantized with one scale (the check column says
how far each is from the bf16 reference), and ours reads our fp8 rows.

    python -m benchmarks.gpu_suite --sections flashinfer --flashinfer-peer --out benchmarks/results/h200-flashinfer-DATE.json
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch

from mlaserve.attention.flashinfer_rule import FLASHINFER_RULE, flashinfer_pays

LAT, ROPE, PAGE = 512, 64, 64
# (batch, heads, context): issue 46's shapes (bf16, pages of 64), then its batch-1 row at 128 heads.
ISSUE_SHAPES = [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192), (32, 16, 2048),
                (1, 16, 16384), (1, 128, 16384)]  # fmt: skip
# Where fa3 starts to lead: the batches the issue's table left unmeasured, at both head counts.
SWEEP = [(b, h, 4096) for h in (16, 128) for b in (2, 4, 8, 16, 24, 32)]
# Uneven batches: (batch, heads, longest context), lengths drawn from 1 to the longest.
UNEVEN = [(64, 16, 8192), (128, 128, 8192), (33, 128, 4096)]
# fp8 caches: ours (per-row scales) and FlashInfer's (one scale per tensor), at 128 heads and at 16.
FP8_SHAPES = [(64, 128, 4096), (128, 128, 8192), (64, 16, 4096)]


def flashinfer_peer(paged_case: Callable, bench_graph: Callable) -> dict:
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    groups = (("issue", ISSUE_SHAPES, False, False), ("sweep", SWEEP, False, False),
              ("uneven", UNEVEN, True, False), ("fp8", FP8_SHAPES, False, True))  # fmt: skip
    for group, shapes, uneven, fp8 in groups:
        for batch, heads, length in shapes:
            lens = _uneven(batch, length) if uneven else [length] * batch
            case = paged_case(batch, heads, lens, PAGE, torch.bfloat16, 0)
            row = _shape(flashinfer, workspace, case, lens, bench_graph, fp8)
            row["group"] = group
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    for row in rows:  # fp8 against each kernel's own bf16 time at the same shape
        bf16 = next(
            (
                r
                for r in rows
                if r["group"] == "issue" and (r["B"], r["H"], r["L"]) == (row["B"], row["H"], row["L"])
            ),
            None,
        )
        if row["group"] == "fp8" and bf16 is not None:
            row["mlaserve_fp8_over_own_bf16"] = row["mlaserve_us"] / bf16["mlaserve_us"]
            row["fa3_fp8_over_own_bf16"] = row["fa3_us"] / bf16["fa3_us"]
    _print_table(rows)
    return {
        "flashinfer": flashinfer.__version__,
        "rows": rows,
        "rule": FLASHINFER_RULE,
        "timing": "CUDA-graph replays, L2 emptied before each (bench_graph), medians; plan() outside the timed "
        "region, its host time apart (plan_us, median of 20)",
        "check": "max |out - torch reference (float32 over the same bf16 inputs)|",
        "fp8": "ours: our fp8 rows (per-row scale in the row's tail); fa3: FlashInfer's fp8 cache, one per-tensor "
        "scale (kv-per-tensor), a copy of the same bf16 cache",
    }


def _uneven(batch: int, longest: int) -> list[int]:
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, longest + 1, (batch,), generator=gen).tolist()
    lens[0] = longest
    return lens


def _print_table(rows: list[dict]) -> None:
    print("group   (B, H, L)            mlaserve us   fa3 us   fa2 us   ours/fa3   plan us   rule picks")
    for r in rows:
        fa2 = f"{r['fa2_us']:8.1f}" if "fa2_us" in r else "       -"
        pick = "fa3" if r["rule_picks_flashinfer"] else "ours"
        print(
            f"{r['group']:<8}"
            + f"({r['B']}, {r['H']}, {r['L']}{'~' if r['group'] == 'uneven' else ''})".ljust(21)
            + f"{r['mlaserve_us']:11.1f} {r['fa3_us']:8.1f} {fa2} {r['mlaserve_over_fa3']:10.2f} "
            + f"{r['plan_us']:9.1f}   {pick}"
        )


def _metadata(flashinfer: object, table: torch.Tensor, lens: list[int]) -> object:
    """The batch's page lists as the engine hands them to FlashInfer: pinned host tensors (flashinfer_plan.py)."""
    pages = [-(-n // PAGE) for n in lens]
    host = table.cpu()
    kv_indices = torch.cat([host[i, :p] for i, p in enumerate(pages)]).to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    ints = [torch.arange(len(lens) + 1, dtype=torch.int32), kv_indptr, kv_indices, torch.tensor(lens).int()]
    return flashinfer.mla.MLAPlanMetadata.csr(*[t.pin_memory() for t in ints])


def _plan(wrapper: object, metadata: object, heads: int, scale: float, kv_dtype: torch.dtype) -> None:
    fp8 = dict(scale_mode="kv-per-tensor") if kv_dtype == torch.float8_e4m3fn else {}
    wrapper.plan(
        metadata=metadata, num_heads=heads, head_dim_ckv=LAT, head_dim_kpe=ROPE, page_size=PAGE, causal=False,
        sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=kv_dtype, **fp8,
    )  # fmt: skip


def _plan_us(plan: Callable[[], object]) -> float:
    times = []
    for _ in range(20):
        start = time.perf_counter()
        plan()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * sorted(times)[len(times) // 2]


def _shape(
    flashinfer: object,
    workspace: torch.Tensor,
    case: tuple,
    lens: list[int],
    bench_graph: Callable,
    fp8: bool,
) -> dict:
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kvcache.quant import quantize_rows

    q, cache, table, meta = case
    batch, heads, _ = q.shape
    length = max(lens)
    scale = 1 / (192**0.5)
    ref = TorchBackend().decode(q.float(), cache.float(), None, meta, scale, LAT)[0]
    row: dict = {
        "B": batch,
        "H": heads,
        "L": length,
        "rule_picks_flashinfer": flashinfer_pays(batch) and not fp8,
    }
    if len(set(lens)) > 1:
        row["mean_L"] = sum(lens) / batch
    ours_rows = quantize_rows(cache, torch.float8_e4m3fn) if fp8 else cache

    def ours() -> torch.Tensor:
        return mla_decode(q, ours_rows, table, meta.seq_lens, length, LAT, scale)[0]

    row["mlaserve_max_err"] = (ours().float() - ref).abs().max().item()
    row["mlaserve_us"] = 1000 * bench_graph(ours)
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kv = cache.view(cache.shape[0], PAGE, LAT + ROPE)
    run_scales = {}
    if (
        fp8
    ):  # FlashInfer's own fp8 copy: one scale for the whole cache, the largest magnitude at e4m3's largest
        kv_scale = kv.abs().amax().float().item() / torch.finfo(torch.float8_e4m3fn).max
        kv = (kv.float() / kv_scale).to(torch.float8_e4m3fn)
        run_scales = dict(ckv_scale=kv_scale, kpe_scale=kv_scale)
    metadata = _metadata(flashinfer, table, lens)
    for backend in ("fa3",) if fp8 else ("fa3", "fa2"):
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        _plan(wrapper, metadata, heads, scale, kv_dtype)

        def peer(w: object = wrapper) -> torch.Tensor:
            return w.run(query=q, kv_cache=kv, **run_scales)

        row[f"{backend}_max_err"] = (peer().float() - ref).abs().max().item()
        row[f"{backend}_us"] = 1000 * bench_graph(peer)
        row[f"mlaserve_over_{backend}"] = row["mlaserve_us"] / row[f"{backend}_us"]
    if heads >= 64 and not fp8:  # the seesaw kernel (gluon_seesaw.py, off by default) at the same shape
        from benchmarks.gpu_kernels import seesaw_rows

        flops = 2 * heads * sum(lens) * (LAT + ROPE + LAT)
        row.update(seesaw_rows(q, cache, table, meta.seq_lens, length, scale, flops))
        for key in [k for k in row if k.startswith("seesaw") and k.endswith("_ms")]:
            row[f"{key[:-3]}_over_fa3"] = 1000 * row[key] / row["fa3_us"]
    replanned = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
    row["plan_us"] = _plan_us(lambda: _plan(replanned, metadata, heads, scale, kv_dtype))
    return row
