"""benchmarks/decode_compile_report.py compiles the decode kernel for sm_90 on a machine without a GPU and reports
sane figures for every configuration (in a subprocess: the test session runs Triton in interpreter mode)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_configuration_compiles_and_reports(tmp_path):
    triton = pytest.importorskip("triton")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this triton install has no bundled cuobjdump")
    out = tmp_path / "report.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run(
        # the four default configurations (bf16 at both grid sizes, fp8, 64 heads): each compile takes a while
        [sys.executable, str(REPO / "benchmarks" / "decode_compile_report.py"), "--out", str(out), "--limit", "4"],
        check=True, capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0
        assert row["programs_per_sm"] >= 1
        assert row["wgmma"] + row["mma_sync"] > 0  # the dots run on tensor cores
