"""Tensors of an HF checkpoint folder, one at a time, from one or many safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from mlaserve.loader.checkpoint_slice import CheckpointSlice

INDEX_FILE = "model.safetensors.index.json"


def safetensors_shards(folder: str | Path) -> list[Path]:
    """The shard files to read: those the index lists, else every *.safetensors in name order."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map object")
        # sorted, not in weight_map order: shards are named -00001-of-0000N, and each is opened once
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that are not in {folder}: {missing}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return shards


def iter_safetensor_slices(folder: str | Path) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(name, slice) for every tensor of the checkpoint, nothing read until a loader reads its part (scalars are
    read at once); each slice is valid until the next one is taken."""
    for shard in safetensors_shards(folder):
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                source = reader.get_slice(name)
                yield name, CheckpointSlice.of(source) if source.get_shape() else reader.get_tensor(name)


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read lazily so at most one is held at a time."""
    for shard in safetensors_shards(folder):
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)
