"""The n-gram proposer and greedy acceptance, alone."""

from __future__ import annotations

import pytest

from mlaserve.spec_decode.accept import greedy_accept
from mlaserve.spec_decode.ngram import NgramProposer, find_earlier


def proposer(k: int = 3, lo: int = 1, hi: int = 4) -> NgramProposer:
    return NgramProposer(k, lo, hi)


def test_most_recent_occurrence_of_the_suffix() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert find_earlier(tokens, 3) == 4  # [1, 2, 3] at 4 is more recent than at 0
    assert proposer().propose(tokens) == [7, 8, 1]


def test_longest_n_first() -> None:
    # The last 2 tokens [5, 6] recur at 0 (followed by 7); the last token alone recurs later (followed by 1).
    tokens = [5, 6, 7, 6, 1, 5, 6]
    assert proposer(k=1, lo=1, hi=2).propose(tokens) == [7]
    assert proposer(k=1, lo=1, hi=1).propose(tokens) == [1]


def test_no_match_and_min_bound() -> None:
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer(lo=2, hi=3).propose([1, 2, 1]) == []  # only a 1-gram recurs
    assert proposer().propose([7]) == []


def test_drafts_stop_at_the_end_and_at_the_cap() -> None:
    assert proposer(k=5).propose([4, 4, 4]) == [4]  # the match ending at 2 leaves one token after it
    assert proposer(k=5).propose([1, 2, 3, 1]) == [2, 3, 1]
    assert proposer(k=5).propose([1, 2, 3, 1], max_tokens=2) == [2, 3]
    assert proposer(k=5).propose([1, 2, 3, 1], max_tokens=0) == []


def test_bad_bounds() -> None:
    with pytest.raises(ValueError):
        NgramProposer(1, 3, 2)


@pytest.mark.parametrize(
    "drafts,targets,out",
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, plus the bonus
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the target's token at the first mismatch
        ([5, 6, 7], [4, 6, 7, 8], [4]),
        ([], [3], [3]),
    ],
)
def test_greedy_accept(drafts: list[int], targets: list[int], out: list[int]) -> None:
    assert greedy_accept(drafts, targets) == out
