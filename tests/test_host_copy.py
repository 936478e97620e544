"""host_copy: the same values, dtypes and shapes as torch's plain copies (on the CPU they are those copies; on CUDA
tests/gpu runs them under every eager and graphed step)."""

import torch

from mlaserve.host_copy import copy_queued, queued_tensor, queued_values


def test_queued_copies_keep_values_dtypes_and_shapes() -> None:
    cpu = torch.device("cpu")
    tables = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert torch.equal(queued_tensor(tables, cpu), tables) and queued_tensor(tables, cpu).dtype == torch.int32
    lens = queued_values([[0, 3, 5], [0, 4, 9]], torch.int32, cpu)
    assert lens.dtype == torch.int32 and lens.tolist() == [[0, 3, 5], [0, 4, 9]]
    assert queued_values([], torch.long, cpu).shape == (0,)
    target = torch.zeros(4, 6, dtype=torch.long)
    copy_queued(target[:2, :3], torch.ones(2, 3, dtype=torch.long))
    assert target.sum() == 6 and target[:2, :3].eq(1).all()
