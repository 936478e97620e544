"""Pages smaller than a tile at many heads: the Gluon 64-head kernel (a page lookup per row) against the Triton
kernel, bf16 cache, graph replays, both checked against each other first. Decides dispatch.py's pages for
gluon_wgmma.

    python benchmarks/diagnose/small_pages.py
"""

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_suite import bench_graph  # noqa: E402
from mlaserve.kernels.mla_decode.tuning import mla_decode_tuned  # noqa: E402

LAT, ROPE = 512, 64


def decode(args: tuple, q_pe: torch.Tensor, kernel: str) -> torch.Tensor:
    return mla_decode_tuned(*args, q_pe=q_pe, kernel=kernel)[0]


def main() -> None:
    rows = []
    for heads, batch, length, page in [(128, 64, 4096, 16), (128, 128, 8192, 16), (64, 32, 2048, 1),
                                       (128, 64, 4096, 64)]:  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(page)
        blocks = batch * length // page
        cache = torch.randn(blocks + 1, page, 1, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
        table = (torch.randperm(blocks, generator=gen, device="cuda") + 1).to(torch.int32).view(batch, -1)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, heads, LAT + ROPE, generator=gen, device="cuda").to(torch.bfloat16)
        args = (q[..., :LAT], cache, table, lens, length, LAT, 0.07)
        run = {
            name: functools.partial(decode, args, q[..., LAT:], name) for name in ("triton", "gluon_wgmma")
        }
        err = (run["triton"]().float() - run["gluon_wgmma"]().float()).abs().max().item()
        assert err < 2e-2, err
        ms = {name: bench_graph(fn) for name, fn in run.items()}
        rows.append(dict(heads=heads, batch=batch, context=length, page=page, max_abs_diff=err,
                         triton_ms=ms["triton"], gluon_wgmma_ms=ms["gluon_wgmma"]))  # fmt: skip
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
