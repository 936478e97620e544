"""Test-session set-up: Triton kernels run on the CPU interpreter (CI has no GPU)."""

import os

import pytest

# Before anything imports triton: it reads the variable once.
os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton.runtime.interpreter as _interpreter
except ImportError:  # the kernel tests skip themselves
    _interpreter = None

if _interpreter is not None:
    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_with_scalar_index(tensor, scope) -> None:
        # The interpreter keeps scalars as 1-element arrays and int()s them for range(); NumPy >= 2.4 refuses.
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_with_scalar_index


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook signature
    """Everything under tests/gpu is marked `gpu`, so `-m "not slow and not gpu"` is the fast CPU subset; tests
    that take the `device` fixture are marked `twin`, so the GPU run adds `-m twin` to run them natively."""
    for item in items:
        if "/tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.twin)


@pytest.fixture
def device() -> str:
    """A twin test's device: "cuda" on a GPU machine run with TRITON_INTERPRET=0, else "cpu" (the interpreter)."""
    from mlaserve.testing.device import kernel_test_device

    return kernel_test_device()


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' SmolLM2-135M-Instruct read from the shipped GGUF (float32, eval): the reference of the tests
    on the real model. Reading it takes about 35 s on 2 cores, so it is read once a session."""
    import torch
    from transformers import AutoModelForCausalLM

    from mlaserve.loader.model_files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
