"""The one shape of every kernel on the floor: what it supports, when it pays, how it launches.

`supports` answers None, or in one line why the kernel cannot run a call; `pays` whether it beats what would run
instead (the torch code beside the layer, or the next entry of an ordered table); `launch` runs it. For the
kernels the layers call, the first two take the launch's own arguments, so a layer reads
`kernel = RMS_NORM.choose(x, weight, eps)` and runs either that or its torch code. The ordered tables (MLA decode's
in mla_decode/dispatch.py, fused MoE's in moe/dispatch.py) take the first entry that supports a call and pays.

A launch in a Triton module is `Lazy`: the module is imported on the first call that chooses it, so CPU runs never
import triton, and where triton does not import every such entry declines.
"""

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

# What the elementwise and GEMM kernels load and widen to float32; float64 keeps the torch code.
KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@functools.cache
def _load(module: str, name: str) -> Callable[..., Any] | None:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Lazy:
    """The function `name` of `module`, imported on first use."""

    module: str
    name: str

    def load(self) -> Callable[..., Any] | None:
        """The function, or None where its module does not import (no triton, or a Triton without Gluon)."""
        return _load(self.module, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function = self.load()
        if function is None:
            raise ImportError(f"{self.module} does not import: is triton installed?")
        return function(*args, **kwargs)


def always(*args: Any, **kwargs: Any) -> bool:
    """The `pays` of a kernel that is faster at every call it supports."""
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class Kernel:
    """A kernel: `supports` (None, or why not), `pays` (whether to take it where it can run), `launch`."""

    name: str
    supports: Callable[..., str | None]
    launch: Callable[..., Any]
    pays: Callable[..., bool] = always

    def choose(self, *args: Any, **kwargs: Any) -> Callable[..., Any] | None:
        """The launch function for a call this kernel supports and pays for; None otherwise."""
        if self.supports(*args, **kwargs) is not None or not self.pays(*args, **kwargs):
            return None
        return self.launch.load() if isinstance(self.launch, Lazy) else self.launch

    def why_not(self, *args: Any, **kwargs: Any) -> str | None:
        """None where choose() takes this kernel for the call; else why not, in one line."""
        reason = self.supports(*args, **kwargs)
        if reason is not None:
            return reason
        if not self.pays(*args, **kwargs):
            return "does not pay at this call"
        if isinstance(self.launch, Lazy) and self.launch.load() is None:
            return f"{self.launch.module} does not import"
        return None


def first(table: Sequence[Kernel], *args: Any, **kwargs: Any) -> Kernel:
    """The first kernel of an ordered table that choose() takes for the call (tables end in one that runs all)."""
    for kernel in table:
        if kernel.choose(*args, **kwargs) is not None:
            return kernel
    raise LookupError(f"no kernel of {[k.name for k in table]} takes this call")


def on_cuda(*tensors: torch.Tensor) -> str | None:
    """None when every tensor is on CUDA in a dtype of KERNEL_DTYPES, else why not."""
    for t in tensors:
        if not t.is_cuda:
            return "needs CUDA tensors"
        if t.dtype not in KERNEL_DTYPES:
            return f"takes float32, bfloat16 and float16, not {t.dtype}"
    return None
