"""The GPU suite's prefill128 section: MLA's expanded prefill attention at 128 heads (192-wide queries and keys,
128-wide values, bf16), issue 46's build item 3: our Triton varlen kernel beside torch's flash varlen (today's
path, V zero-padded to 192 columns) and FlashInfer's ragged prefill.

Rows: one fresh sequence of 2,048, 4,096, 8,192 and 16,384 tokens (causal over itself), and 4 sequences of 2,048
new tokens over a 2,048-token prefix each (chunked prefill). Each contender is checked against the torch reference
first (float32 over the same bf16 inputs, on CHECK_HEADS: 128 heads of float32 scores would not fit at 16k), and
timed only if it agrees (bench: CUDA events, L2 emptied before each run, median):

  triton <tile>   kernels/prefill_attn with each tile of TILE_CANDIDATES (the sweep that picks DEFAULT_TILE), with
                  the compiled kernel's registers, spills and shared memory (its occupancy, for the profile)
  triton          the engine's call (the default tile's ladder)
  flash           torch's flash varlen op (attention/sdpa.varlen_prefill) on V already padded to 192 columns: what
                  the engine runs today, where kernels/prefill_kv.py writes V padded
  flash+pad       the same with the pad copy inside the call (F.pad): what a caller with unpadded V pays
  fa3             FlashInfer's BatchPrefillWithRaggedKVCacheWrapper(backend="fa3"), head_dim_qk 192, head_dim_vo
                  128, plan() outside the timed region, when flashinfer imports
                  (../shared/peers/flashinfer/README.md says how to carry it; then
                  dev/flashinfer_prefill_peer.py puts back the batch_prefill sources this wrapper compiles from)

TFLOP/s count what the attention needs: each query's visible keys (its prefix and itself: causal, bottom-right),
2 * (192 + 128) FLOPs per (query, key, head); flash's padded V columns are not counted. The row's verdict compares
the fastest Triton tile with flash and with fa3 (issue 46's target: within 1.1x of the peer at 8k).

    python -m benchmarks.gpu_suite --sections prefill128 --out benchmarks/results/h100-prefill128-DATE.json
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

HEADS, QK, V = 128, 192, 128
# (name, new tokens per sequence, context per sequence: prefix + new tokens)
CASES = [
    *((f"1 x {n}", [n], [n]) for n in (2048, 4096, 8192, 16384)),
    ("4 x 2048 over 2048", [2048] * 4, [4096] * 4),
]
CHECK_HEADS = (0, 1, 77, 127)
TOLERANCE = 2e-2


def causal_flops(query_lens: Sequence[int], kv_lens: Sequence[int], heads: int, qk: int, v: int) -> int:
    """2 * (qk + v) FLOPs per visible (query, key) pair and head: query j of a sequence with q queries over n keys
    sees n - q + j + 1 keys."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, kv_lens, strict=True))
    return 2 * (qk + v) * pairs * heads


def prefill128(
    bench: Callable[[Callable[[], object]], float],
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    heads: int = HEADS,
    cases: Sequence[tuple[str, list[int], list[int]]] = CASES,
    check_heads: Sequence[int] = CHECK_HEADS,
    tiles: Sequence[object] | None = None,
) -> dict:
    """The section; device, dtype, heads, cases and tiles are the suite's unless a CPU test shrinks them."""
    from mlaserve.kernels.prefill_attn.tiles import DEFAULT_TILE, TILE_CANDIDATES

    tiles = TILE_CANDIDATES if tiles is None else tiles
    flashinfer = _import_flashinfer()
    rows = []
    for name, query_lens, kv_lens in cases:
        row = _case(name, query_lens, kv_lens, bench, device, dtype, heads, check_heads, tiles, flashinfer)
        rows.append(row)
        print("prefill128", json.dumps(row), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    _print_table(rows)
    return {
        "rows": rows,
        "default_tile": list(DEFAULT_TILE),
        "tile_wins": _tile_wins(rows),
        "flashinfer": flashinfer if isinstance(flashinfer, str) else flashinfer.__version__,
        "timing": "bench: CUDA events, L2 emptied before each run, median; FlashInfer's plan() outside",
        "check": f"max |out - torch reference| on heads {list(check_heads)} (float32 over the same inputs); "
        f"timed only within {TOLERANCE}",
        "flops": "2 * (192 + 128) per visible (query, key) pair and head, causal bottom-right",
    }


def _import_flashinfer() -> object:
    """The module, or why it is not there (a string)."""
    try:
        import flashinfer
        import flashinfer.prefill  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure is reported, not raised
        return f"unavailable: {type(error).__name__}: {error}"
    return flashinfer


def _offsets(lens: Sequence[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _case(
    name: str,
    query_lens: list[int],
    kv_lens: list[int],
    bench: Callable[[Callable[[], object]], float],
    device: str,
    dtype: torch.dtype,
    heads: int,
    check_heads: Sequence[int],
    tiles: Sequence[object],
    flashinfer: object,
) -> dict:
    from mlaserve.kernels.prefill_attn.reference import prefill_attention_reference
    from mlaserve.kernels.prefill_attn.triton_prefill import (
        prefill_attention,
        prefill_attention_tiled,
        tile_facts,
    )

    gen = torch.Generator(device=device).manual_seed(sum(kv_lens))
    q = torch.randn(sum(query_lens), heads, QK, device=device, generator=gen, dtype=dtype)
    k = torch.randn(sum(kv_lens), heads, QK, device=device, generator=gen, dtype=dtype)
    v = torch.randn(sum(kv_lens), heads, V, device=device, generator=gen, dtype=dtype)
    cu_q, cu_k = _offsets(query_lens, device), _offsets(kv_lens, device)
    scale = QK**-0.5
    picked = list(check_heads)
    want = prefill_attention_reference(q[:, picked], k[:, picked], v[:, picked], cu_q, cu_k, scale)[0].float()
    flops = causal_flops(query_lens, kv_lens, heads, QK, V)

    def measure(call: Callable[[], torch.Tensor]) -> dict:
        try:
            err = (call()[:, picked].float() - want).abs().max().item()
            if not err <= TOLERANCE:
                return {"max_err": err, "error": f"off the reference by {err:.3g}: not timed"}
            ms = bench(call)
        except Exception as error:  # noqa: BLE001 - a tile that does not build is a row of the table too
            return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        return {"us": 1000 * ms, "tflops": flops / ms / 1e9, "max_err": err}

    row: dict = {
        "case": name,
        "query_lens": query_lens,
        "kv_lens": kv_lens,
        "heads": heads,
        "GFLOP": flops / 1e9,
    }
    results = {}
    for tile in tiles:
        result = measure(lambda t=tile: prefill_attention_tiled(q, k, v, cu_q, cu_k, scale, tile=t)[0])
        if "us" in result:  # registers, spills and shared memory: what occupancy the tile gets
            result.update(tile_facts(q, k, v, cu_q, cu_k, tile))
        results[f"triton {tuple(tile)}"] = result
    results["triton"] = measure(lambda: prefill_attention(q, k, v, cu_q, cu_k, scale)[0])
    results.update(_flash(q, k, v, query_lens, kv_lens, scale, measure))
    results["fa3"] = _fa3(flashinfer, q, k, v, cu_q, cu_k, heads, scale, measure)
    row["results"] = results
    row.update(_verdict(results))
    return row


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: list[int],
    kv_lens: list[int],
    scale: float,
    measure: Callable[[Callable[[], torch.Tensor]], dict],
) -> dict:
    from mlaserve.attention.metadata import build_metadata
    from mlaserve.attention.sdpa import can_use_varlen, varlen_prefill

    if not can_use_varlen(q):
        reason = {"error": "unavailable: torch's flash varlen op takes 16-bit CUDA tensors"}
        return {"flash": reason, "flash+pad": reason}
    # one page per sequence: the metadata's context gather is never read here, only its offsets
    page = max(kv_lens)
    table = torch.arange(len(kv_lens), dtype=torch.int32, device=q.device).view(-1, 1)
    meta = build_metadata(
        page, table, query_lens, kv_lens, 0, torch.zeros(1, dtype=torch.long, device=q.device)
    )
    v_padded = F.pad(v, (0, QK - V))
    return {
        "flash": measure(lambda: varlen_prefill(q, k, v_padded, meta, scale)[..., :V]),
        "flash+pad": measure(lambda: varlen_prefill(q, k, v, meta, scale)),
    }


def _fa3(
    flashinfer: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    heads: int,
    scale: float,
    measure: Callable[[Callable[[], torch.Tensor]], dict],
) -> dict:
    if isinstance(flashinfer, str):
        return {"error": flashinfer}
    try:
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(
            cu_q.cpu(), cu_k.cpu(), heads, heads, QK, head_dim_vo=V, causal=True, sm_scale=scale,
            q_data_type=q.dtype, kv_data_type=k.dtype,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the peer's failure is reported in its column
        return {"error": f"plan: {type(error).__name__}: {str(error)[:300]}"}
    return measure(lambda: wrapper.run(q, k, v))


def _verdict(results: dict) -> dict:
    """The fastest Triton tile and its time over flash's and fa3's (below 1 is faster)."""
    timed = {name: r["us"] for name, r in results.items() if name.startswith("triton") and "us" in r}
    if not timed:
        return {"best_triton": None}
    best = min(timed, key=timed.get)
    verdict = {"best_triton": best, "best_triton_us": timed[best]}
    for peer in ("flash", "flash+pad", "fa3"):
        if "us" in results.get(peer, {}):
            verdict[f"best_triton_over_{peer}"] = timed[best] / results[peer]["us"]
    return verdict


def _tile_wins(rows: list[dict]) -> dict:
    """Each tile's time summed over the rows where every tile ran: the sweep's pick for DEFAULT_TILE."""
    names = [n for n in rows[0]["results"] if n.startswith("triton (")] if rows else []
    complete = [r for r in rows if all("us" in r["results"][n] for n in names)]
    totals = {n: sum(r["results"][n]["us"] for r in complete) for n in names}
    return dict(sorted(totals.items(), key=lambda item: item[1]))


def _print_table(rows: list[dict]) -> None:
    columns = ("triton", "flash", "flash+pad", "fa3")
    print("case                    best tile               " + "".join(f"{c:>18}" for c in columns))
    for row in rows:
        cells = []
        for column in columns:
            r = row["results"].get(column, {})
            cells.append(f"{r['us']:9.0f} us {r['tflops']:4.0f}T" if "us" in r else f"{'-':>18}")
        best = row.get("best_triton") or "-"
        print(f"{row['case']:<24}{best:<24}" + "".join(f"{c:>18}" for c in cells))
