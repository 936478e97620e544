"""What Triton makes of the MLA decode kernel for an H100/H200 (sm_90), without a GPU: per configuration, how many
shared-memory buffers the KV tile gets, whether its loads are asynchronous copies, which tensor-core instructions
the dots use, shared memory, registers and local memory (spills), and how many programs fit on one SM.

  python benchmarks/diagnose/decode_compile_report.py [--out report.json]

The kernel is compiled with the specialization a launch gives it (16-byte-divisible pointers and strides, the
kernel's do_not_specialize ints left generic); without those attributes Triton does not vectorize the loads and
never pipelines them, which would misreport every configuration. Device time is scarce: this screens variants
before a GPU run times them (benchmarks/diagnose/h200_diagnose.py). It reads compiled code, it times nothing.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Compiled kernels, not the interpreter: triton.jit reads this when the kernel module is imported.
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.backends.nvidia as nvidia_backend  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from mlaserve.kernels.mla_decode import gluon_fp8, gluon_wgmma, gluon_wgmma8, triton_split  # noqa: E402

SM90_SHARED_BYTES = 227 * 1024  # per SM, usable by thread blocks
SM90_REGISTERS = 65536
POINTERS = {
    "Q": "*bf16",
    "QPe": "*bf16",
    "BlockTable": "*i32",
    "SeqLens": "*i32",
    "MidO": "*fp32",
    "MidLse": "*fp32",
    "Terms": "*fp8e4nv",
    "Scales": "*fp32",
}
FLOATS = {"scale_log2"}
# The fp8-dot kernel's TMA descriptors (gluon_fp8_ring.tma_descriptors) over a 576-wide fp8 latent row
TENSOR_DESCS = {
    "DescLat": "tensordesc<fp8e4nv[4, 64, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)>",
    "DescPe": "tensordesc<fp8e4nv[64, 64],NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)>",
    "DescTail": "tensordesc<fp8e4nv[64, 16],NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)>",
}

# (name, cache, constexpr overrides, num_warps, num_stages): today's six defaults first, then variants. Cache
# "gluon" is the bf16 Gluon kernel of gluon_wgmma.py, "gluonfp8" the fp8 one of gluon_fp8.py, "gluon8" the
# widening 8-bit one of gluon_wgmma8.py (their tiles are fixed; stages are their own two buffers).
AHEAD = dict(BLOCK_H=16, PAGE_AHEAD=True)
SPANS = dict(
    BALANCED=True, MIN_TILES=4
)  # balanced spans of 128 rows or more (the 16-head default from 41 sequences)
CONFIGS = [
    ("bf16 16 heads, page ahead, 32-row tiles, 4 warps (default, full grid)", "bf16", AHEAD | SPANS | dict(BLOCK_N=32), 4, 3),
    ("bf16 16 heads, page ahead, 64-row tiles (default, grid under 1/SM)", "bf16", AHEAD | dict(BLOCK_N=64), 8, 3),
    ("fp8 16 heads (default where the Gluon kernel cannot run)", "fp8", dict(BLOCK_H=16, BLOCK_N=32, PREFETCH=True, Q_F16=True, WIDEN_BITS=True), 4, 3),
    ("bf16 64 heads (default where the Gluon kernel cannot run)", "bf16", dict(BLOCK_H=64, BLOCK_N=64), 8, 2),
    ("bf16 64 heads, Gluon split kernel (default on sm_90)", "gluon", {}, 8, 1),
    ("fp8 16 heads, Gluon fp8-dot kernel (default on sm_90)", "gluonfp8", dict(PDL=True), 4, 1),
    ("fp8 16 heads, Gluon 8-bit widening kernel (fp8 where fp8 dots do not pay; int8 when named)", "gluon8", {}, 4, 1),
    ("bf16 16 heads, page ahead, 32-row tiles, one sequence's split per program", "bf16", AHEAD | dict(BLOCK_N=32), 4, 3),
    ("bf16 16 heads, page ahead, 32-row tiles, 4 warps, 4 stages", "bf16", AHEAD | SPANS | dict(BLOCK_N=32), 4, 4),
    ("bf16 16 heads, page looked up in the loop (the old default)", "bf16", dict(BLOCK_H=16, BLOCK_N=64), 8, 3),
    ("bf16 16 heads, page looked up in the loop, 32-row tiles", "bf16", dict(BLOCK_H=16, BLOCK_N=32), 4, 3),
    ("fp8 16 heads, pipeliner instead of prefetch", "fp8", dict(BLOCK_H=16, BLOCK_N=32, Q_F16=True), 4, 3),
    ("fp8 16 heads, widened by conversion instructions", "fp8", dict(BLOCK_H=16, BLOCK_N=32, PREFETCH=True, Q_F16=True), 4, 3),
    ("bf16 64 heads, page ahead", "bf16", dict(BLOCK_H=64, BLOCK_N=64, PAGE_AHEAD=True), 8, 2),
    ("bf16 64 heads, page ahead, 32-row tiles", "bf16", dict(BLOCK_H=64, BLOCK_N=32, PAGE_AHEAD=True), 8, 3),
]  # fmt: skip


def compile_stage1(
    cache: str, constexprs: dict, num_warps: int, num_stages: int
) -> triton.compiler.CompiledKernel:
    gluon = cache.startswith("gluon")
    kernel = {
        "gluon": gluon_wgmma.stage1_wgmma,
        "gluon8": gluon_wgmma8.stage1_wgmma8,
        "gluonfp8": gluon_fp8.stage1_fp8,
    }.get(cache, triton_split._stage1)
    heads = 16 if cache in ("gluon8", "gluonfp8") else 64
    consts = dict(PAGE=64, D_LAT=512, D_ROPE=64, BLOCK_H=heads, BLOCK_N=64) if gluon else dict(
        PAGE=64, D_LAT=512, D_ROPE=64, PRECISION="tf32", QUANTIZED=cache != "bf16", TILE_IN_PAGE=True,
        PREFETCH=False, Q_F16=False, PAGE_AHEAD=False, WIDEN_BITS=False, LAT_TILE=512, ROPE_TILE=64, PDL=False,
        BALANCED=False, MIN_TILES=1,
    )  # fmt: skip
    consts |= constexprs
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name in TENSOR_DESCS:
            signature[name] = TENSOR_DESCS[name]
            continue
        if name == "KV":
            signature[name] = "*fp8e4nv" if cache in ("fp8", "gluon8", "gluonfp8") else "*bf16"
        else:
            signature[name] = POINTERS.get(name, "fp32" if name in FLOATS else "i32")
        generic = name in FLOATS or name in kernel.do_not_specialize or index in kernel.do_not_specialize
        if not generic:  # what a launch with the engine's tensors specializes on
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = (GluonASTSource if gluon else ASTSource)(
        fn=kernel, signature=signature, constexprs=consts, attrs=attrs
    )
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def resource_usage(cubin: bytes, workdir: Path) -> dict:
    """Registers, per-thread local memory and stack frame (where spills go) of the cubin Triton built, read by the bundled
    cuobjdump (running ptxas here on Triton's PTX can fail: a newer Triton writes PTX newer than its sm_90 ptxas)."""
    tool = Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    binary = workdir / "kernel.cubin"
    binary.write_bytes(cubin)
    run = subprocess.run(
        [str(tool), "--dump-resource-usage", str(binary)], capture_output=True, text=True, check=True
    )
    return dict(
        registers=int(re.search(r"REG:(\d+)", run.stdout).group(1)),
        local_bytes=int(re.search(r"LOCAL:(\d+)", run.stdout).group(1)),
        # ptxas puts spilled registers in the stack frame: > 0 here means spills (the ABI needs no frame otherwise)
        stack_bytes=int(re.search(r"STACK:(\d+)", run.stdout).group(1)),
    )


def report(cache: str, constexprs: dict, num_warps: int, num_stages: int, workdir: Path) -> dict:
    compiled = compile_stage1(cache, constexprs, num_warps, num_stages)
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    # The pipeliner's multi-buffered allocations look like memdesc<NxROWSxCOLS...>: N buffers of one tile.
    kv_buffers = [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x512x", ttgir)]
    if cache.startswith("gluon"):  # allocated by the kernel itself: the [2, 64, 512] tile ring
        kv_buffers = [int(n) for n in re.findall(r"memdesc<(\d+)x64x512x(?:bf16|f8E4M3FN)", ttgir)][:1]
    usage = resource_usage(compiled.asm["cubin"], workdir)
    shared = compiled.metadata.shared
    by_registers = SM90_REGISTERS // (usage["registers"] * 32 * num_warps)
    by_shared = SM90_SHARED_BYTES // shared if shared else 32
    return dict(
        kv_tile_buffers=kv_buffers[0] if kv_buffers else 0,  # 0: loaded to registers, not pipelined
        async_copies=ttgir.count("async_copy_global_to_local"),
        wgmma=ptx.count("wgmma.mma_async"),
        # Per warpgroup and tile: 64 heads x 64 rows of scores over 576 columns take 36 m64n32k16 when the two
        # warpgroups split the columns, 72 when each computes them all.
        wgmma_by_shape=dict(Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        mma_sync=ptx.count("mma.sync"),
        shared_byte_loads=ptx.count("ld.shared.b8"),  # operands gathered one byte at a time
        shared_bytes=shared,
        **usage,
        programs_per_sm=min(by_registers, by_shared),
        limited_by="registers" if by_registers < by_shared else "shared memory",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--limit", type=int, default=None, help="only the first N configurations (defaults first)"
    )
    args = parser.parse_args()
    rows = []
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "decode_compile_report"
    workdir.mkdir(exist_ok=True)
    for name, cache, constexprs, warps, stages in CONFIGS[: args.limit]:
        row = dict(
            config=name,
            num_warps=warps,
            num_stages=stages,
            **report(cache, constexprs, warps, stages, workdir),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "date": datetime.date.today().isoformat(),
                    "command": "python " + " ".join(sys.argv),
                    "triton": triton.__version__,
                    "target": "sm_90",
                    "rows": rows,
                },
                indent=1,
            )  # fmt: skip
        )


if __name__ == "__main__":
    main()
