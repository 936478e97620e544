"""benchmarks/diagnose/decode_compile_report.py compiles the decode kernel for sm_90 on a machine without a GPU and
reports sane figures for every configuration (in a subprocess: the test session runs Triton in interpreter mode)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "diagnose" / "decode_compile_report.py"


@pytest.mark.slow
def test_every_configuration_compiles_and_reports(tmp_path):
    triton = pytest.importorskip("triton")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this triton install has no bundled cuobjdump")
    out = tmp_path / "report.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run(
        # the six default configurations (bf16 at both grid sizes, fp8 and 64 heads in Triton and in Gluon) and the
        # widening 8-bit Gluon kernel: each compile takes a while
        [sys.executable, str(SCRIPT), "--out", str(out), "--limit", "7"],
        check=True, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 7
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0
        assert row["programs_per_sm"] >= 1
        assert row["wgmma"] + row["mma_sync"] > 0  # the dots run on tensor cores
    # The Gluon kernel's warpgroups split each tile's 64 x 64 scores: 36 m64n32k16 per warpgroup over 576 columns.
    # Triton's 64-head kernel gives both warpgroups all of them (72) in Triton 3.6; a later Triton may not.
    triton64, gluon64 = rows[3], rows[4]
    assert "Gluon" in gluon64["config"] and gluon64["wgmma_by_shape"] == {"m64n32k16": 36, "m64n256k16": 4}
    assert gluon64["kv_tile_buffers"] == 2 and gluon64["local_bytes"] == 0 and gluon64["stack_bytes"] == 0
    assert triton64["wgmma_by_shape"].get("m64n32k16") in (36, 72)
    # The fp8-dot Gluon kernel: per tile 18 score m64n32k32 (16 heads x two query terms) and 32 value m64n16k32
    # (4 chunks x 2 row blocks x two p terms x 2 k steps), in each of its two consumer warpgroups, the score dots
    # written twice (a split's first tile before the loop, the next one's behind the value dots); a ring of four
    # tiles; the value operand is read 4 bytes at a time (the one byte load is the worker partition's switch).
    fp8, gluon8 = rows[5], rows[6]
    assert "fp8-dot" in fp8["config"] and fp8["wgmma_by_shape"] == {"m64n32k32": 72, "m64n16k32": 64}
    assert fp8["kv_tile_buffers"] == 4 and fp8["local_bytes"] == 0 and fp8["shared_byte_loads"] <= 1
    # No stack frame with Triton 3.6 (the record's); 3.9's ptxas keeps 40 bytes there. A larger frame would mean
    # spills in the consumers' loop.
    assert fp8["stack_bytes"] <= 64
    # The widening 8-bit Gluon kernel: 16 heads as N, so 36 score and 32 value m64n16k16 per tile, nothing spilled.
    assert "widening" in gluon8["config"] and gluon8["wgmma_by_shape"] == {"m64n16k16": 68}
    assert gluon8["kv_tile_buffers"] == 2 and gluon8["local_bytes"] == 0 and gluon8["stack_bytes"] == 0
