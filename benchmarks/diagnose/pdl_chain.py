"""What programmatic dependent launch (PDL) saves between the small kernels of a decode step, on one GPU.

    python benchmarks/diagnose/pdl_chain.py OUT.json

A batch-1 decode step of V2-Lite is some 380 kernels inside one CUDA graph, most of them 1.5-3 us long for far less
work than that: each waits for its predecessor to finish before its blocks start, then waits again on its first
loads. With PDL a kernel's blocks may start while its predecessor finishes and load what does not depend on it (its
weights) before `griddepcontrol.wait`. This times chains of 48 dependent kernels captured in one graph, each
reading the previous one's output, in four ways: plain launches; PDL with the wait first; PDL with the wait first and
the dependents released at once; PDL with the weights loaded before the wait. Kernels: an RMSNorm of one or 32
rows of 2,048 (one program per row), a GEMV of 2,048 x 2,048 (o_proj's shape at batch 1; every launch reads its own
weight copy, so the chain streams from HBM), and the two alternating. cuBLAS's GEMV on the same chain is the
reference. Every variant's final output must equal the plain chain's bit for bit (a missing wait would race).
"""

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu_suite import bench, run_header  # noqa: E402

HIDDEN, LINKS = 2048, 48
VARIANTS = {  # name: (launch_pdl, wait first, release dependents at once, weights before the wait)
    "plain": (False, False, False, False),
    "pdl_wait": (True, True, False, False),
    "pdl_wait_release": (True, True, True, False),
    "pdl_prefetch_release": (True, False, True, True),
}


@triton.jit
def _norm(
    X, W, Y, N, eps, PDL: tl.constexpr, RELEASE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    if PREFETCH:
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    if RELEASE:
        gdc_launch_dependents()
    x = tl.load(X + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    if not PREFETCH:
        w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * w
    tl.store(Y + row * N + offs, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _gemv(X, W, Y, K, PDL: tl.constexpr, RELEASE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    if PREFETCH:
        w = tl.load(W + n[:, None] * K + k[None, :]).to(tl.float32)
    if PDL:
        gdc_wait()
    if RELEASE:
        gdc_launch_dependents()
    x = tl.load(X + k).to(tl.float32)
    if not PREFETCH:
        w = tl.load(W + n[:, None] * K + k[None, :]).to(tl.float32)
    tl.store(Y + n, tl.sum(w * x[None, :], 1).to(Y.dtype.element_ty))


def launch(kind: str, variant: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    pdl, wait, release, prefetch = VARIANTS[variant]
    flags = dict(
        PDL=wait or prefetch, RELEASE=release, PREFETCH=prefetch, **({"launch_pdl": True} if pdl else {})
    )
    if kind == "norm":
        _norm[(x.shape[0],)](x, w, y, HIDDEN, 1e-6, BLOCK=HIDDEN, num_warps=8, **flags)
    elif kind == "gemv":
        _gemv[(HIDDEN // 8,)](x, w, y, HIDDEN, BLOCK_N=8, BLOCK_K=HIDDEN, num_warps=4, **flags)
    else:
        torch.matmul(w, x.view(-1), out=y.view(-1))


def chain(kinds: list[str], variant: str, rows: int, weights: dict) -> tuple[float, torch.Tensor]:
    """(us per link, final output) of LINKS dependent launches of kinds in turn, graph-replayed."""
    bufs = [torch.full((rows, HIDDEN), 0.5, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    torch.manual_seed(0)
    bufs[0].normal_()

    def run():
        for i in range(LINKS):
            kind = kinds[i % len(kinds)]
            launch(kind, variant, bufs[i % 2], weights[kind][i], bufs[(i + 1) % 2])

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = bench(graph.replay)
    bufs[0].normal_(generator=torch.Generator(device="cuda").manual_seed(1))
    graph.replay()
    torch.cuda.synchronize()
    return ms * 1e3 / LINKS, bufs[LINKS % 2].clone()


def main() -> None:
    out = run_header()
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats = [
        torch.randn(HIDDEN, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=gen) / 45
        for _ in range(LINKS)
    ]
    vecs = [
        torch.rand(HIDDEN, dtype=torch.bfloat16, device="cuda", generator=gen) + 0.5 for _ in range(LINKS)
    ]
    weights = {"norm": vecs, "gemv": mats, "cublas": mats}
    rows = []
    for kinds, batch in (
        (["norm"], 1),
        (["norm"], 32),
        (["gemv"], 1),
        (["norm", "gemv"], 1),
        (["cublas"], 1),
    ):
        want = None
        for variant in VARIANTS if kinds != ["cublas"] else ["plain"]:
            us, final = chain(kinds, variant, batch, weights)
            want = final if want is None else want
            row = dict(kinds="+".join(kinds), rows=batch, variant=variant, us_per_link=round(us, 3),
                       equal_to_plain=bool(torch.equal(final, want)))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    out["chains"] = rows
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
