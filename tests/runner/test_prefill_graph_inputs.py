"""The fresh-prefill graphs' input staging (runner/prefill_graphs.py) on CPU tensors: real tokens, the padding
sequence, empty sequences, sampled rows; and which batches qualify for a graph."""

import torch

from mlaserve.runner.batch import HostBatch
from mlaserve.runner.prefill_graphs import MAX_SEQS, PrefillGraphs, stage_prefill_inputs


class _Scheduled:
    def __init__(self, num_computed_tokens: int) -> None:
        self.num_computed_tokens = num_computed_tokens


def prefill_batch(lens: list[int], sampled: list[bool], computed: list[int] | None = None) -> HostBatch:
    ids, positions, slots, rows = [], [], [], []
    for i, n in enumerate(lens):
        ids += [100 + i] * n
        positions += list(range(n))
        slots += [(i + 1) * 64 + p for p in range(n)]
        if sampled[i]:
            rows.append(len(ids) - 1)
    computed = computed or [0] * len(lens)
    order = [_Scheduled(c) for c in computed]
    seq_lens = [c + n for c, n in zip(computed, lens, strict=True)]
    return HostBatch(ids, torch.tensor(positions), torch.tensor(slots), torch.zeros(len(lens), 1, dtype=torch.int32),
                     lens, seq_lens, 0, order, rows, [o for o, s in zip(order, sampled) if s])  # fmt: skip


def test_tokens_padding_sequence_and_sampled_rows() -> None:
    host_i64, host_small = torch.full((3, 16), 7), torch.full((2, MAX_SEQS + 2), 9)
    batch = prefill_batch([3, 5, 2], [True, False, True])
    stage_prefill_inputs(batch, 16, host_i64, host_small)
    assert host_i64[0, :10].tolist() == [100] * 3 + [101] * 5 + [102] * 2
    assert host_i64[1, :10].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert host_i64[2, :4].tolist() == [64, 65, 66, 128]
    assert host_i64[:, 10:].eq(0).all()  # padding: token 0 at position 0, slot 0 of the null block
    # three sequences, the padding sequence (tokens 10..16), then empty sequences
    assert host_small[0].tolist() == [0, 3, 8, 10] + [16] * (MAX_SEQS - 2)
    assert host_small[1].tolist() == [2, 9] + [0] * MAX_SEQS


def test_which_batches_a_graph_takes() -> None:
    graphs = PrefillGraphs.__new__(PrefillGraphs)  # can_run reads the captured sizes only
    graphs.sizes = [64, 128]
    assert graphs.can_run(prefill_batch([50, 60], [True, True]))
    assert not graphs.can_run(prefill_batch([100, 60], [True, True]))  # 160 tokens: past the largest size
    assert not graphs.can_run(prefill_batch([5, 6], [True, True], computed=[0, 16]))  # context from earlier
    assert not graphs.can_run(prefill_batch([1] * (MAX_SEQS + 1), [True] * (MAX_SEQS + 1)))
    decode = prefill_batch([1, 1], [True, True])
    decode.num_decodes = 2
    assert not graphs.can_run(decode)
