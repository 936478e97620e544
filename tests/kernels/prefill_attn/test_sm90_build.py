"""The prefill kernel compiled for sm_90 without a GPU (Triton's CUDA backend and its bundled ptxas, no driver):
it builds at the default tile and with a window and the LSE, its K/V loads go through the pipeliner's async copies
(cp.async: with 16-byte aligned pointers and strides, as the JIT specializes real launches), and its shared memory
is within tiles.shared_bytes, the estimate the ladder goes by. The build runs in a child process with
TRITON_INTERPRET=0: under the interpreter (tests/conftest.py) the kernels are not compilable objects."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
if importlib.util.find_spec("triton.backends.nvidia") is None:
    pytest.skip("Triton's CUDA backend is not installed", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from mlaserve.kernels.prefill_attn import triton_prefill  # noqa: E402
from mlaserve.kernels.prefill_attn.tiles import DEFAULT_TILE, head_split, shared_bytes  # noqa: E402


def build_for_sm90(tile, window: bool, write_lse: bool, element: str = "bf16"):
    kernel = triton_prefill._prefill_kernel
    constants = triton_prefill.kernel_constants(192, 128, tile, window, write_lse, element == "fp32")
    pointers = {"Q", "K", "V", "Out", "Lse", "TileSeq", "TileStart", "CuQ", "CuK"}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*i32" if name in ("TileSeq", "TileStart", "CuQ", "CuK") else f"*{element}"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    signature["Lse"] = "*fp32" if write_lse else signature["Lse"]
    aligned = [i for i, name in enumerate(kernel.arg_names) if name in pointers or name.startswith("stride")]
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs=constants,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": tile.warps, "num_stages": tile.stages}
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def summary(window: bool, write_lse: bool) -> dict:
    """What the child process reports of the default tile's sm_90 build."""
    built = build_for_sm90(DEFAULT_TILE, window, write_lse)
    ptx = built.asm["ptx"]
    return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx, "shared": built.metadata.shared}


@pytest.mark.parametrize("window, write_lse", [(False, False), (True, True)])
def test_default_tile_builds_pipelined_within_its_estimate(window, write_lse):
    root = Path(__file__).resolve().parents[3]
    code = (
        "import json; from tests.kernels.prefill_attn.test_sm90_build import summary; "
        f"print(json.dumps(summary({window}, {write_lse})))"
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert built["wgmma"]  # Hopper's warpgroup dots
    assert built["cp_async"]  # K and V streamed ahead of the dots
    assert built["shared"] <= shared_bytes(DEFAULT_TILE, head_split(192, 128), 2)
