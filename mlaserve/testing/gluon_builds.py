"""Every Gluon split step of paged MLA decode, compiled for sm_90 on any machine (no GPU needed).

Gluon kernels do not run under TRITON_INTERPRET and CI has no GPU, so without this a kernel that no longer builds
(a renamed Gluon call, a layout a new Triton refuses, a buffer that outgrew shared memory) would be found only on a
GPU. Each kernel is compiled as its launch calls it, at the dispatch table's tile for DeepSeek's widths (512 latent +
64 rope), with the argument types and 16-byte divisibility a real launch gives it.

`python -m mlaserve.testing.gluon_builds [--ptxas]` prints one JSON line per build: its shared memory, PTX facts,
and with --ptxas the registers and spills ptxas reports. It must run with TRITON_INTERPRET unset (the interpreter
wraps the Triton helpers these kernels call), so tests/kernels/test_gluon_compile.py runs it as a subprocess.

It builds with this machine's Triton. Gluon changes between releases (names, and what a shared-memory
descriptor's shape is), so a kernel that builds here may not build with the GPU image's Triton: to try that one,
unzip its wheel into a directory and put that first, `TRITON_CACHE_DIR=DIR/cache PYTHONPATH=DIR:. python -m
mlaserve.testing.gluon_builds` (its own cache: builds of two Tritons must not share one).
"""

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import tempfile

import torch

LAT, ROPE = 512, 64


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel as its launch builds it: the pointer arguments' dtypes (the rest are i32 sizes and strides, and
    scale_log2), its constexprs and warps, its plan's tile (block_h, block_n, warps) and the rules function that
    estimates that plan's shared memory."""

    module: str
    kernel: str
    pointers: dict[str, torch.dtype]
    constexprs: dict[str, int | bool]
    num_warps: int
    tile: tuple[int, int, int]
    estimate: str
    cache_dtype: torch.dtype = torch.bfloat16
    descriptors: str = ""  # whose TMA descriptors it takes: "fp8" (gluon_fp8's three) or "seesaw" (two)


def _seesaw_name(block_n: int, page: int, dtype: torch.dtype, tma: bool, prefetch: bool) -> str:
    options = ("/tma" if tma else "") + ("/prefetch" if prefetch else "")
    return f"gluon_seesaw/{block_n}rows/page{page}/{str(dtype).removeprefix('torch.')}{options}"


_OUT = dict(BlockTable=torch.int32, SeqLens=torch.int32, MidO=torch.float32, MidLse=torch.float32)
_BF16 = dict(Q=torch.bfloat16, QPe=torch.bfloat16, KV=torch.bfloat16, **_OUT)
_WIDTHS = dict(D_LAT=LAT, D_ROPE=ROPE)
FP8 = torch.float8_e4m3fn
BUILDS: dict[str, Build] = {
    "gluon_wgmma": Build("gluon_wgmma", "stage1_wgmma", _BF16, dict(PAGE=64, **_WIDTHS, BLOCK_H=64, BLOCK_N=64), 8,
                         (64, 64, 8), "gluon_wgmma_shared_bytes"),
    "gluon_wgmma8": Build("gluon_wgmma8", "stage1_wgmma8", {**_BF16, "KV": FP8},
                          dict(PAGE=64, **_WIDTHS, BLOCK_H=16, BLOCK_N=64), 4, (16, 64, 4), "gluon_wgmma8_shared_bytes",
                          FP8),
    "gluon_fp8": Build("gluon_fp8", "stage1_fp8", {"Terms": FP8, "Scales": torch.float32, "KV": FP8, **_OUT},
                       dict(PAGE=64, **_WIDTHS, BLOCK_H=16, BLOCK_N=64, PDL=True), 4, (16, 64, 4),
                       "gluon_fp8_shared_bytes", FP8, descriptors="fp8"),
    **{
        _seesaw_name(block_n, page, dtype, tma, prefetch): Build(
            "gluon_seesaw", "stage1_seesaw", {**_BF16, "Q": dtype, "QPe": dtype, "KV": dtype},
            dict(PAGE=page, **_WIDTHS, BLOCK_H=64, BLOCK_N=block_n, TMA=tma, PREFETCH=prefetch), 4,
            (64, block_n, 12), "gluon_seesaw_shared_bytes", dtype, descriptors="seesaw",
        )
        for block_n, page, dtype, tma, prefetch in (
            (32, 64, torch.bfloat16, False, False), (64, 64, torch.bfloat16, False, False),
            (32, 1, torch.bfloat16, False, False), (32, 16, torch.float16, False, False),
            (32, 64, torch.bfloat16, True, False), (64, 64, torch.bfloat16, True, False),
            (32, 64, torch.bfloat16, True, True),
        )
    },
}  # fmt: skip


def _descriptors(build: Build) -> dict[str, object]:
    """The kernel's TMA descriptors over a small cache of its row width (the compiled kernel depends on their type,
    not on the cache's size)."""
    if build.descriptors == "fp8":
        from mlaserve.kernels.mla_decode.gluon_fp8_ring import tma_descriptors
        from mlaserve.kvcache.quant import TAIL_BYTES

        kv = torch.zeros(256, LAT + ROPE + TAIL_BYTES, dtype=build.cache_dtype)
        return dict(zip(("DescLat", "DescPe", "DescTail"), tma_descriptors(kv, ROPE), strict=True))
    if build.descriptors == "seesaw":
        from mlaserve.kernels.mla_decode.gluon_seesaw_ring import tma_descriptors

        kv = torch.zeros(256, LAT + ROPE, dtype=build.cache_dtype)
        block_n = build.constexprs["BLOCK_N"]
        return dict(zip(("DescLat", "DescPe"), tma_descriptors(kv, LAT, ROPE, block_n), strict=True))
    return {}


def compile_for_sm90(build: Build):
    """The kernel compiled for sm_90: Triton's CompiledKernel (.metadata.shared, .asm["ptx"], .asm["cubin"])."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fn = getattr(importlib.import_module(f"mlaserve.kernels.mla_decode.{build.module}"), build.kernel)
    descriptors = _descriptors(build)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in build.constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = mangle_type(descriptors[name])
        elif name in build.pointers:
            signature[name] = mangle_type(torch.empty(0, dtype=build.pointers[name]))
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]  # DeepSeek's strides are multiples of 16
    source = GluonASTSource(fn, signature, build.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=build.num_warps))


def _ptxas_report(ptx: str) -> dict[str, int]:
    """Registers and spill bytes as ptxas -v reports them for sm_90a. Triton's bundled ptxas for Blackwell is the
    newest, and Triton's PTX may carry a version older ones refuse."""
    import triton.backends.nvidia

    bin_dir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    ptxas = next(p for p in (os.path.join(bin_dir, "ptxas-blackwell"), os.path.join(bin_dir, "ptxas"))
                 if os.path.exists(p))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    numbers = {
        "registers": r"Used (\d+) registers",
        "spill_store_bytes": r"(\d+) bytes spill stores",
        "spill_load_bytes": r"(\d+) bytes spill loads",
    }
    return {key: int(m.group(1)) for key, pattern in numbers.items() if (m := re.search(pattern, out))}


def report(name: str, ptxas: bool = False) -> dict[str, object]:
    """What one build compiles to: its shared memory, the plan's estimate of it, and the PTX's dots and barriers."""
    from mlaserve.kernels.mla_decode import rules

    build = BUILDS[name]
    kernel = compile_for_sm90(build)
    ptx = kernel.asm["ptx"]
    plan = rules.DecodePlan(build.module, 1, *build.tile)
    shape = rules.DecodeShape(64, LAT, ROPE, build.cache_dtype, build.pointers.get("Q", torch.bfloat16),
                              build.constexprs["PAGE"])  # fmt: skip
    facts = {
        "name": name,
        "shared": kernel.metadata.shared,
        "estimate": getattr(rules, build.estimate)(plan, shape),
        "dots": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "setmaxnreg": sorted(
            {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
        ),
        "mbarrier_copies": "cp.async.mbarrier.arrive" in ptx,
        "tma_copies": sorted(set(re.findall(r"cp\.async\.bulk\.tensor\.(\dd)", ptx))),
    }
    if ptxas:
        facts.update(_ptxas_report(ptx))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"builds (default: all): {', '.join(BUILDS)}")
    parser.add_argument("--ptxas", action="store_true", help="also report ptxas's registers and spills")
    args = parser.parse_args()
    for name in args.names or BUILDS:
        print(json.dumps(report(name, args.ptxas)), flush=True)


if __name__ == "__main__":
    main()
