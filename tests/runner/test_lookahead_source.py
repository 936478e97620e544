import torch

from mlaserve.runner.model_runner import lookahead_source


def test_known_rows_take_their_own_tokens_after_the_sampled_ones() -> None:
    sampled = torch.tensor([11, 12, 13])
    ids, rows = lookahead_source(sampled, [2, -1, 0, -1], [0, 40, 0, 41])
    assert rows == [2, 3, 0, 4]
    assert ids[rows].tolist() == [13, 40, 11, 41]
    same, unchanged = lookahead_source(sampled, [1, 0], [0, 0])
    assert same is sampled and unchanged == [1, 0]
