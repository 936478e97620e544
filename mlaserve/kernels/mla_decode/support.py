"""What a decode kernel declares it supports (DecodeSupport, the `supports` of dispatch.py's entries): the runtime
and GPU generations it needs, the cache and query dtypes and the widths it takes. Plain data, no Triton."""

import dataclasses

import torch

from mlaserve.kernels.mla_decode.rules import DecodeDevice, DecodeShape

HALF = frozenset({torch.bfloat16, torch.float16})
FLOATS = HALF | {torch.float32}
EIGHT_BIT = frozenset({torch.float8_e4m3fn, torch.int8})


@dataclasses.dataclass(frozen=True, slots=True)
class Widths:
    """A set of sizes: low..high (high None: unbounded), powers of two only if pow2, multiples of multiple_of."""

    low: int = 1
    high: int | None = None
    pow2: bool = False
    multiple_of: int = 1

    def __contains__(self, n: int) -> bool:
        return (
            n >= self.low
            and (self.high is None or n <= self.high)
            and (not self.pow2 or n & (n - 1) == 0)
            and n % self.multiple_of == 0
        )

    def __str__(self) -> str:
        if self.low == self.high:
            return str(self.low)
        kind = (
            "powers of two"
            if self.pow2
            else f"multiples of {self.multiple_of}"
            if self.multiple_of > 1
            else ""
        )
        bounds = f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"
        return f"{kind} {bounds}".strip()


ANY = Widths(1)


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSupport:
    """The shapes a decode kernel runs, and where: called with (shape, device), None or the first reason it does
    not run them."""

    runtime: str  # "gluon", "triton" or "torch": what the device must run (DecodeDevice)
    archs: frozenset[str] | None  # GPU generations; None: wherever the runtime runs
    cache_dtypes: frozenset[torch.dtype] | None  # None: any
    query_dtypes: frozenset[torch.dtype] | None
    heads: Widths
    ranks: Widths
    ropes: Widths
    pages: Widths

    def __call__(self, shape: DecodeShape, device: DecodeDevice) -> str | None:
        runs = {"gluon": device.gluon, "triton": device.triton, "torch": True}[self.runtime]
        checks = (
            (runs, f"needs {self.runtime}, which this device does not run"),
            (self.archs is None or device.arch in self.archs, f"needs {'/'.join(sorted(self.archs or ()))}"),
            (self.cache_dtypes is None or shape.cache_dtype in self.cache_dtypes,
             f"takes caches of {_names(self.cache_dtypes)}"),
            (self.query_dtypes is None or shape.query_dtype in self.query_dtypes,
             f"takes queries of {_names(self.query_dtypes)}"),
            (self.runtime == "torch" or shape.quantized or shape.cache_dtype == shape.query_dtype,
             "needs a 16- or 32-bit cache in the query's dtype"),
            (shape.num_heads in self.heads, f"takes heads {self.heads}"),
            (shape.kv_lora_rank in self.ranks, f"takes kv_lora_rank {self.ranks}"),
            (shape.rope_dim in self.ropes, f"takes qk_rope_head_dim {self.ropes}"),
            (shape.block_size in self.pages, f"takes pages (block_size) {self.pages}"),
        )  # fmt: skip
        return next((why for ok, why in checks if not ok), None)


def _names(dtypes: frozenset[torch.dtype] | None) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes or ()))
