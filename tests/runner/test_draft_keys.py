"""runner/mtp_graphs.py's captured (rows, requests) pairs: a step whose requests all carry k drafts chains at its
request count, any other step finds a pair it fits."""

from mlaserve.runner.mtp_graphs import draft_key, draft_keys


def test_full_steps_chain_at_their_request_count() -> None:
    keys = draft_keys([1, 2, 4, 8, 16, 32, 48, 64, 96, 128], 3)
    assert draft_key(keys, 128, 32) == (128, 32)  # 32 requests with 3 drafts each
    assert draft_key(keys, 4, 1) == (4, 1)
    assert draft_key(keys, 8, 2) == (8, 2)
    assert draft_key(keys, 20, 5) == (32, 8)


def test_any_step_fits_a_pair() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    keys = draft_keys(sizes, 2)
    assert keys[-1] == (24, 24) and len(set(keys)) == len(keys)
    for rows in range(1, 25):
        for requests in range(1, rows + 1):
            size, chained = draft_key(keys, rows, requests)
            assert size == next(s for s in sizes if s >= rows) and chained >= requests
