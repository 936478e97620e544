"""When the Triton kernels launch with programmatic dependent launch (pdl.py): on CUDA from sm_90, never on the
CPU, the interpreter, ROCm or with MLASERVE_PDL=0. (That the launches are correct is tests/gpu's: the engine's
float32 runs on captured graphs equal the torch backend's, and per-head products chained in a graph.)"""

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels import pdl  # noqa: E402

device_pdl = pdl._device_pdl.__wrapped__  # uncached: each case sets its own environment


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """A modelled CUDA device of the given capability, no interpreter, PDL not switched off."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MLASERVE_PDL", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)

    def capability(major: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (major, 0))

    return capability


def test_on_from_sm90_only(gpu) -> None:
    gpu(9)
    assert device_pdl(0)
    gpu(10)
    assert device_pdl(0)
    gpu(8)
    assert not device_pdl(0)


@pytest.mark.parametrize("env", [("TRITON_INTERPRET", "1"), ("MLASERVE_PDL", "0")])
def test_off_under_the_interpreter_and_when_switched_off(gpu, monkeypatch: pytest.MonkeyPatch, env) -> None:
    gpu(9)
    monkeypatch.setenv(*env)
    assert not device_pdl(0)


def test_off_on_rocm(gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu(9)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not device_pdl(0)


def test_cpu_tensors_launch_plainly() -> None:
    assert pdl.pdl_launch(torch.zeros(1)) == {"PDL": False}
