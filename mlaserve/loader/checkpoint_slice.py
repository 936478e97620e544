"""A checkpoint tensor that is not read yet: a tensor-parallel rank narrows it to its part and reads only that.

Weight loaders that only look at `shape`, `narrow` it and hand it to `default_weight_loader` take these
(`slice_aware`); any other loader gets the whole tensor, read as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class CheckpointSlice:
    def __init__(self, source: object, ranges: tuple[tuple[int, int], ...]) -> None:
        self.source = source  # a safetensors slice: indexing it with slices reads only those rows and columns
        self.ranges = ranges  # (start, stop) per dimension

    @classmethod
    def of(cls, source: object) -> CheckpointSlice:
        return cls(source, tuple((0, n) for n in source.get_shape()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self.ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        lo, hi = self.ranges[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise RuntimeError(
                f"narrow({dim}, {start}, {length}) is outside a checkpoint slice of shape {self.shape}"
            )
        ranges = list(self.ranges)
        ranges[dim] = (lo + start, lo + start + length)
        return CheckpointSlice(self.source, tuple(ranges))

    def read(self) -> torch.Tensor:
        return self.source[tuple(slice(start, stop) for start, stop in self.ranges)]


def read(tensor: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, CheckpointSlice) else tensor


def slice_aware(loader: Callable) -> Callable:
    """Marks a weight loader that takes a CheckpointSlice (it uses shape and narrow, and reads through read())."""
    loader.takes_slices = True
    return loader


class ShapeMismatch(ValueError):
    """A checkpoint tensor whose shape does not fit the parameter slice it is loaded into."""


def check_shape(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ShapeMismatch(f"{what}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")


@slice_aware
def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
    check_shape(param, loaded, "tensor")
    param.data.copy_(read(loaded))  # in the parameter's dtype
