"""benchmarks/gpu_v4.py's check at tiny sizes on CPU (the interpreter): each layer kind's composition equals the
torch reference, and the engine's composition (attention/v4_decode.py) equals the benchmark's."""

import pytest
import torch

pytest.importorskip("triton")

from benchmarks import gpu_v4 as section  # noqa: E402
from mlaserve.attention.triton_mla import TritonMLABackend  # noqa: E402

TINY = dict(HEADS=16, DIM=32, WINDOW=8, PAGE=4, HCA_RATE=8, TOPK=4, INDEX_HEADS=16, INDEX_DIM=16)


def test_the_check_runs_and_the_engine_equals_the_composed_layers(monkeypatch):
    # the check also runs every launch group the section times alone (Case.engine_groups)
    for name, value in TINY.items():
        monkeypatch.setattr(section, name, value)
    errors = section.check(TritonMLABackend(), context=64, device="cpu", dtype=torch.float32)
    kinds = {f"{p}{k}_max_abs_err" for p in ("", "engine_") for k in ("sliding", "hca", "csa")}
    assert set(errors) == kinds | {"engine_groups_sliding_max_abs_err"}
    assert all(e < 1e-4 for e in errors.values()), errors
