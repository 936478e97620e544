"""Compile every Triton kernel a CPU test launches for Hopper (sm_90), on a machine with no GPU, before a GPU session
spends device time on it.

    TRITON_INTERPRET=0 PYTHONPATH=.:dev python -m pytest -q -p sm90_compile tests/kernels

As a pytest plugin it makes Triton believe an sm_90 device is current, compiles each launch (PTX and ptxas, as on
the GPU) and skips running it, so the tests' outputs are garbage and their assertions fail: what it reports is the
kernels compiled, each one's largest shared memory (the H100 / H200 limit is 232,448 bytes per block) and every
test that failed with anything but an AssertionError, which is where a compile error or a refused launch shows.
Only the kernels the tests reach on CPU are compiled (the Gluon kernels are never chosen there), at the tests' tile
sizes, and with this machine's Triton, not the GPU image's.
"""

import collections

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver, jit

SHARED_LIMIT = 232_448


class _Sm90:
    """The little of a Triton driver that compiling needs."""

    def is_active(self) -> bool:
        return True

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


driver.set_active(_Sm90())
_compiled: dict[str, int] = {}
_launches = collections.Counter()
_problems: list[tuple[str, str, str]] = []
_outcomes = collections.Counter()
_run = jit.JITFunction.run


def _compile_only(
    self: jit.JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object
) -> object:
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    _launches[self.__name__] += 1
    _compiled[self.__name__] = max(_compiled.get(self.__name__, 0), kernel.metadata.shared)
    return kernel


jit.JITFunction.run = _compile_only


def pytest_runtest_makereport(item: object, call: object) -> None:
    if call.when != "call":
        return
    error = call.excinfo.value if call.excinfo is not None else None
    if error is None:
        _outcomes["passed (no kernel output checked)"] += 1
    elif call.excinfo.typename == "Skipped":  # pytest.skip inside the test body
        _outcomes["skipped"] += 1
    elif isinstance(error, AssertionError):
        _outcomes["assertion failed (expected: nothing ran)"] += 1
    else:
        _outcomes[f"raised {type(error).__name__}"] += 1
        first = (str(error).splitlines() or [""])[0][:300]
        _problems.append((item.nodeid, type(error).__name__, first))


def pytest_terminal_summary(terminalreporter: object) -> None:
    write = terminalreporter.write_line
    write(f"compiled for sm_90: {len(_compiled)} kernels over {sum(_launches.values())} launches")
    for name, shared in sorted(_compiled.items()):
        flag = "  OVER THE LIMIT" if shared > SHARED_LIMIT else ""
        write(f"  {name}: {_launches[name]} launches, shared memory up to {shared} bytes{flag}")
    write(f"outcomes: {dict(_outcomes)}")
    for nodeid, kind, first in _problems:
        write(f"  {kind} in {nodeid}: {first}")
