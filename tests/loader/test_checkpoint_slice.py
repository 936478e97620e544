"""A tensor-parallel rank reads only its part of each checkpoint tensor (loader/checkpoint_slice.py)."""

from pathlib import Path

import torch
from safetensors.torch import save_file

from mlaserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from mlaserve.layers.moe import FusedExperts
from mlaserve.loader.checkpoint_slice import CheckpointSlice
from mlaserve.loader.safetensors_reader import iter_safetensor_slices
from mlaserve.parallel import ParallelContext


class RecordingSource:
    """A safetensors slice stand-in that records what was read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.reads = tensor, []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        self.reads.append(tuple((s.start, s.stop) for s in index))
        return self.tensor[index]


def test_slices_of_a_file_read_the_narrowed_part(tmp_path: Path) -> None:
    tensor = torch.arange(24.0).reshape(4, 6)
    save_file({"w": tensor, "scalar": torch.tensor(2.5)}, tmp_path / "model.safetensors")
    items = dict(iter_safetensor_slices(tmp_path))
    assert items["scalar"].item() == 2.5  # a 0-dim tensor comes read
    w = items["w"]
    assert isinstance(w, CheckpointSlice) and w.shape == (4, 6)
    part = w.narrow(1, 2, 3).narrow(0, 1, 2)
    assert part.shape == (2, 3) and torch.equal(part.read(), tensor[1:3, 2:5])


def test_each_rank_reads_its_columns_rows_and_experts_only() -> None:
    column = ColumnParallelLinear(6, 8, ctx=ParallelContext(1, 2))
    source = RecordingSource(torch.randn(8, 6))
    column.weight_loader(column.weight, CheckpointSlice.of(source))
    assert source.reads == [((4, 8), (0, 6))] and torch.equal(column.weight, source.tensor[4:])
    row = RowParallelLinear(6, 8, ctx=ParallelContext(0, 2))
    source = RecordingSource(torch.randn(8, 6))
    row.weight_loader(row.weight, CheckpointSlice.of(source))
    assert source.reads == [((0, 8), (0, 3))]
    experts = FusedExperts(4, 6, 5, "silu", ParallelContext(1, 2, expert_parallel=True))
    sources = [RecordingSource(torch.randn(6, 5)) for _ in range(4)]
    for expert, source in enumerate(sources):
        experts.load_w2(experts.w2, CheckpointSlice.of(source), expert)
    assert [len(s.reads) for s in sources] == [0, 0, 1, 1]  # experts 0 and 1 live on rank 0: never read here
    assert torch.equal(experts.w2[0], sources[2].tensor)
