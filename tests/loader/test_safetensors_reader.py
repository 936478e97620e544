"""iter_safetensors over single files, indexed shards, and unindexed shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mlaserve.loader.safetensors_reader import iter_safetensors

SHARDS = {
    "model-00001-of-00002.safetensors": {
        "a.weight": torch.arange(6.0).reshape(2, 3),
        "b.bias": torch.ones(3),
    },
    "model-00002-of-00002.safetensors": {"c.weight": torch.full((4,), 7, dtype=torch.bfloat16)},
}


def _write_shards(folder: Path, with_index: bool) -> dict[str, torch.Tensor]:
    expected = {}
    for shard, tensors in SHARDS.items():
        save_file(tensors, str(folder / shard))
        expected.update(tensors)
    if with_index:
        weight_map = {name: shard for shard, tensors in SHARDS.items() for name in tensors}
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return expected


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_round_trip(tmp_path: Path, with_index: bool) -> None:
    expected = _write_shards(tmp_path, with_index)
    loaded = list(iter_safetensors(tmp_path))
    assert [name for name, _ in loaded] == ["a.weight", "b.bias", "c.weight"]  # shard order, then file order
    for name, tensor in loaded:
        assert tensor.dtype == expected[name].dtype
        assert torch.equal(tensor, expected[name])


def test_index_only_reads_listed_shards(tmp_path: Path) -> None:
    _write_shards(tmp_path, with_index=True)
    save_file({"stale": torch.zeros(1)}, str(tmp_path / "leftover.safetensors"))
    assert "stale" not in dict(iter_safetensors(tmp_path))


def test_missing_shard_is_named(tmp_path: Path) -> None:
    _write_shards(tmp_path, with_index=True)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        list(iter_safetensors(tmp_path))


def test_no_weights(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(iter_safetensors(tmp_path))
