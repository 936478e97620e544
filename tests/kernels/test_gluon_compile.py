"""Every Gluon decode kernel in mlaserve/kernels/mla_decode/ compiles for sm_90 without a GPU and fits a Hopper SM
(mlaserve/testing/gluon_builds.py).

The builds compile in one subprocess with TRITON_INTERPRET unset: the session's interpreter (tests/conftest.py) wraps
the Triton helpers the kernels call, which Gluon's compiler then refuses. About 40 s on 2 cores at first; Triton's
cache makes later runs a few seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")

from mlaserve.kernels.fit import DEFAULT_SHARED_BYTES  # noqa: E402
from mlaserve.kernels.mla_decode import dispatch  # noqa: E402
from mlaserve.testing.gluon_builds import BUILDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "mlaserve.testing.gluon_builds"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return {facts["name"]: facts for facts in map(json.loads, run.stdout.splitlines())}


def test_every_gluon_kernel_of_the_table_is_built():
    gluon = {k.name for k in dispatch.DECODE_KERNELS if k.supports.runtime == "gluon"}
    assert gluon == {build.module for build in BUILDS.values()}


@pytest.mark.parametrize("name", list(BUILDS))
def test_gluon_decode_kernel_compiles_for_sm90_within_shared_memory(compiled, name):
    facts = compiled[name]
    assert facts["shared"] <= DEFAULT_SHARED_BYTES, facts
    # plans are checked against the table's estimate: it must not undercount the compiled kernel
    assert facts["shared"] <= facts["estimate"], facts
    assert facts["dots"], facts  # the dots are wgmma


@pytest.mark.parametrize("name", [name for name in BUILDS if name.startswith("gluon_seesaw/")])
def test_the_seesaw_kernel_is_warp_specialized_over_mbarriers(compiled, name):
    """Its consumers take setmaxnreg's larger share (a 64 x 256 float32 accumulator each), the copies are counted on
    mbarriers, the score dots are 64 heads x BLOCK_N rows and the value dots 64 x 256 (half the latent each)."""
    facts = compiled[name]
    block_n = BUILDS[name].constexprs["BLOCK_N"]
    assert 232 in facts["setmaxnreg"] and facts["mbarrier_copies"], facts
    assert set(facts["dots"]) == {f"m64n{block_n}k16", "m64n256k16"}, facts
    # with TMA, whole tiles come as a 3-D latent box and a 2-D rope box; partial tiles still by cp.async
    assert facts["tma_copies"] == (["2d", "3d"] if BUILDS[name].constexprs["TMA"] else []), facts
