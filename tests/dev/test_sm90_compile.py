"""dev/sm90_compile.py still compiles kernels for sm_90 without a GPU: run as a plugin over one kernel test file, it
names the kernel that file launches and finds no failure other than the expected assertions."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_plugin_compiles_the_window_decode_kernel_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'dev'}"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "sm90_compile", "-p", "no:cacheprovider",
         "tests/kernels/test_mla_decode_window.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert "compiled for sm_90:" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert "  _stage1: " in run.stdout and "OVER THE LIMIT" not in run.stdout
    assert "raised " not in run.stdout.split("outcomes:")[1], run.stdout[-3000:]
