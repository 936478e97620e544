"""The GPU suite's `flashinfer` section (`--flashinfer-peer`): FlashInfer's paged MLA decode beside ours.

FlashInfer (its fa3 backend on sm_90, which vLLM and SGLang can use, and fa2) reads the very cache and queries our
kernel reads: the packed [pages, 64, 576] latent cache is our layout, and its page lists are our block table's
rows. Each shape is first checked against the torch reference (float32 over the same bf16 inputs), then timed as
CUDA-graph replays with L2 emptied before each (bench_graph); FlashInfer's `plan` (host-side scheduling, once per
batch layout) stays outside the timed region, as the engine would plan once per step. FlashInfer runs without
writing its log-sum-exp; ours always writes one (the engine merges split contexts with it). At the 16-head shapes our
fp8 cache is timed too (FlashInfer's fp8 on sm_90 takes per-tensor scales, not our per-row ones, so it is left
out). The GPU image has no FlashInfer: ../shared/peers/flashinfer/README.md says how to carry it.

    python -m benchmarks.gpu_suite --sections flashinfer --flashinfer-peer --out benchmarks/results/h200-flashinfer-DATE.json
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

# (batch, heads, context): the shapes of the issue that set FlashInfer as the peer (bf16, pages of 64).
SHAPES = [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192), (32, 16, 2048), (1, 16, 16384)]
LAT, ROPE, PAGE = 512, 64, 64


def flashinfer_peer(paged_case: Callable, bench_graph: Callable) -> dict:
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for batch, heads, length in SHAPES:
        rows.append(
            _shape(
                flashinfer,
                workspace,
                paged_case(batch, heads, [length] * batch, PAGE, torch.bfloat16, 0),
                length,
                bench_graph,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print("(B, H, L)            mlaserve us   fa3 us   fa2 us   ours/fa3   fp8/bf16")
    for r in rows:
        fp8 = f"{r['fp8_over_bf16']:.2f}" if "fp8_over_bf16" in r else "-"
        print(
            f"({r['B']}, {r['H']}, {r['L']})".ljust(20)
            + f"{r['mlaserve_us']:11.1f} {r['fa3_us']:8.1f} {r['fa2_us']:8.1f} {r['mlaserve_over_fa3']:10.2f} {fp8:>10}"
        )
    return {
        "flashinfer": flashinfer.__version__,
        "rows": rows,
        "timing": "CUDA-graph replays, L2 emptied before each (bench_graph), medians; plan() outside the timed region",
        "check": "max |out - torch reference (float32 over the same bf16 inputs)|",
    }


def _shape(
    flashinfer: object, workspace: torch.Tensor, case: tuple, length: int, bench_graph: Callable
) -> dict:
    from mlaserve.attention.torch_ref import TorchBackend
    from mlaserve.kernels.mla_decode.decode import mla_decode
    from mlaserve.kvcache.quant import quantize_rows

    q, cache, table, meta = case
    batch, heads, _ = q.shape
    scale = 1 / (192**0.5)
    ref = TorchBackend().decode(q.float(), cache.float(), None, meta, scale, LAT)[0]
    row: dict = {"B": batch, "H": heads, "L": length}

    def ours(rows: torch.Tensor = cache) -> torch.Tensor:
        return mla_decode(q, rows, table, meta.seq_lens, length, LAT, scale)[0]

    row["mlaserve_max_err"] = (ours().float() - ref).abs().max().item()
    row["mlaserve_us"] = 1000 * bench_graph(ours)
    pages = -(-length // PAGE)
    ints = dict(dtype=torch.int32, device="cuda")
    metadata = flashinfer.mla.MLAPlanMetadata.csr(
        torch.arange(batch + 1, **ints),  # one query row per request
        torch.arange(batch + 1, **ints) * pages,
        table[:, :pages].reshape(-1).to(torch.int32).contiguous(),
        meta.seq_lens.to(torch.int32),
    )
    kv = cache.view(cache.shape[0], PAGE, LAT + ROPE)
    for backend in ("fa3", "fa2"):
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        wrapper.plan(
            metadata=metadata,
            num_heads=heads,
            head_dim_ckv=LAT,
            head_dim_kpe=ROPE,
            page_size=PAGE,
            causal=False,
            sm_scale=scale,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )

        def peer(w: object = wrapper) -> torch.Tensor:
            return w.run(query=q, kv_cache=kv)

        row[f"{backend}_max_err"] = (peer().float() - ref).abs().max().item()
        row[f"{backend}_us"] = 1000 * bench_graph(peer)
        row[f"mlaserve_over_{backend}"] = row["mlaserve_us"] / row[f"{backend}_us"]
    if heads <= 16:  # memory-bound shapes: our fp8 cache against our bf16
        rows8 = quantize_rows(cache, torch.float8_e4m3fn)
        row["mlaserve_fp8_max_err"] = (ours(rows8).float() - ref).abs().max().item()
        row["mlaserve_fp8_us"] = 1000 * bench_graph(lambda: ours(rows8))
        row["fp8_over_bf16"] = row["mlaserve_fp8_us"] / row["mlaserve_us"]
    return row
