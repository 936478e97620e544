"""The decode graphs' input staging (runner/cuda_graphs.py) on CPU tensors: real rows, padding rows, stale entries."""

import torch

from mlaserve.runner.batch import HostBatch
from mlaserve.runner.cuda_graphs import stage_decode_inputs


def decode_batch(ids: list[int], positions: list[int], tables: list[list[int]], block_size: int) -> HostBatch:
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor(
        [table_t[i, p // block_size].item() * block_size + p % block_size for i, p in enumerate(positions)]
    )
    n = len(ids)
    return HostBatch(ids, torch.tensor(positions), slots, table_t, [1] * n, [p + 1 for p in positions], n,
                     [], list(range(n)), [])  # fmt: skip


def test_rows_padding_and_older_entries() -> None:
    host, seq_lens, tables = (
        torch.full((3, 8), 7),
        torch.full((8,), 9, dtype=torch.int32),
        torch.full((8, 5), 3, dtype=torch.int32),
    )
    # A wider, larger batch staged first leaves its entries behind.
    stage_decode_inputs(decode_batch([5] * 6, [40] * 6, [[1, 2, 3, 4]] * 6, 16), 6, host, seq_lens, tables)
    batch = decode_batch([11, 12, 13], [3, 17, 33], [[4], [5, 6], [7, 8, 9]], 16)
    stage_decode_inputs(batch, 4, host, seq_lens, tables)

    assert host[0, :3].tolist() == [11, 12, 13]
    assert host[1, :3].tolist() == [3, 17, 33]
    assert host[2, :3].tolist() == [4 * 16 + 3, 6 * 16 + 1, 9 * 16 + 1]
    assert seq_lens[:3].tolist() == [4, 18, 34]
    assert tables[:3, :3].tolist() == [[4, 0, 0], [5, 6, 0], [7, 8, 9]]
    # the padding row: one token at slot 0 of block 0 (the null block), a zero table
    assert host[:, 3].tolist() == [0, 0, 0] and seq_lens[3].item() == 1 and tables[3].tolist() == [0] * 5
    # past the padded size nothing was touched; past the widest table the older entries stay (never read)
    assert host[0, 4:6].tolist() == [5, 5] and seq_lens[6].item() == 9
    assert tables[:3, 3].tolist() == [4, 4, 4]


def test_capture_sizes_end_at_the_rows_asked_for_once() -> None:
    from mlaserve.runner.cuda_graphs import CAPTURE_SIZES, capture_sizes

    assert (
        capture_sizes(1) == [1]
        and capture_sizes(3) == [1, 2, 3]
        and capture_sizes(32) == list(CAPTURE_SIZES[:7])
    )
    # a verify step's rows (max_num_seqs x (k + 1)) past the largest size: that size once, larger steps run eagerly
    assert capture_sizes(768) == capture_sizes(512) == list(CAPTURE_SIZES)
