"""The batched logits processing (bias, min_tokens, penalties, grammar masks) against its per-token definition."""

import pytest
import torch

from mlaserve.core.request import Request
from mlaserve.sampling.logits_processors import (
    PendingTokens,
    process_logits,
    process_logits_reference,
    unpack_bitmask,
)
from mlaserve.sampling.sampler import Sampler
from mlaserve.sampling_params import SamplingParams

VOCAB = 50


class FixedMask:
    """A grammar stand-in that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def allowed_bitmask(self, vocab_size: int) -> torch.Tensor:
        words = [0] * (-(-vocab_size // 32))
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def request(prompt: list[int], output: list[int], eos: int = 1, stop: tuple[int, ...] = ()) -> Request:
    r = Request("r", prompt, max_tokens=100, arrival_index=0, eos_token_id=eos, stop_token_ids=stop)
    for t in output:
        r.append_output_token(t)
    return r


def random_case(seed: int) -> tuple[torch.Tensor, list[SamplingParams], list[Request], list]:
    gen = torch.Generator().manual_seed(seed)

    def ints(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    def real(lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=gen).item()

    rows = 6
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    params, requests, masks = [], [], []
    for i in range(rows):
        kind = i % 6
        kwargs: dict = {}
        if kind in (0, 5):
            kwargs.update(presence_penalty=real(-2, 2), frequency_penalty=real(-2, 2))
        if kind in (1, 5):
            kwargs.update(repetition_penalty=real(0.5, 2))
        if kind in (2, 5):
            kwargs.update(logit_bias={t: real(-100, 100) for t in ints(4)})
        if kind == 3:
            kwargs.update(min_tokens=10)
        params.append(SamplingParams(**kwargs))
        requests.append(request(ints(7), ints(i * 2), eos=3, stop=(5, 7)))
        masks.append(FixedMask(ints(5)) if kind in (4, 5) else None)
    return logits, params, requests, masks


@pytest.mark.parametrize("seed", range(4))
def test_batched_processing_equals_the_definition(seed):
    logits, params, requests, masks = random_case(seed)
    # A step queued ahead: some rows' requests have a token still being sampled (on the device), which min_tokens
    # and the penalties count.
    pending = None
    if seed % 2:
        rows = [i % 3 == 0 for i in range(len(params))]
        ids = torch.randint(0, VOCAB, (len(params),), generator=torch.Generator().manual_seed(seed))
        pending = PendingTokens(rows, torch.where(torch.tensor(rows), ids, -1))
    got = process_logits(logits, params, requests, masks, pending)
    want = process_logits_reference(logits, params, requests, masks, pending)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, logits)  # something changed, and the raw logits did not
    torch.testing.assert_close(logits, random_case(seed)[0])


def test_rows_that_ask_nothing_are_returned_untouched():
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0)]
    assert process_logits(logits, params, [request([1], []), request([2], [])], [None, None]) is logits


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10  # EOS is the favourite
    params = [SamplingParams(min_tokens=2), SamplingParams(min_tokens=2)]
    out = process_logits(
        logits, params, [request([9], [4], eos=3, stop=(5,)), request([9], [4, 4], eos=3)], [None] * 2
    )
    assert out[0, 3] == float("-inf") and out[0, 5] == float("-inf")
    assert out[1, 3] == 10  # two tokens out: no longer held back


def test_bitmask_unpacks_bit_b_of_word_w_as_token_32w_plus_b():
    mask = FixedMask([0, 31, 32, 49])
    allowed = unpack_bitmask(mask.allowed_bitmask(VOCAB), VOCAB)
    assert allowed.nonzero().flatten().tolist() == [0, 31, 32, 49]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(200):
        out = Sampler()(logits, [SamplingParams(min_p=0.5)], [gen])
        seen.add(out.token_ids[0])
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5


def test_greedy_rows_are_processed_too():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 5
    out = Sampler()(logits, [SamplingParams(temperature=0)], [None])
    assert out.token_ids == [7]
    # The sampler itself does not process: the runner does, between prepare and sample.
    processed = process_logits(
        logits, [SamplingParams(temperature=0, logit_bias={8: 100})], [request([1], [])], [None]
    )
    assert processed.argmax().item() == 8


def test_min_tokens_counts_the_token_a_step_queued_ahead_waits_for():
    """Two tokens out, min_tokens 3: EOS and the stop tokens stay banned for the third token, but a row queued
    ahead samples the fourth (the third is still being sampled), where they are allowed again."""
    logits = torch.zeros(2, VOCAB)
    params = [SamplingParams(min_tokens=3)] * 2
    requests = [request([4, 5], [6, 7], eos=1, stop=(9,))] * 2
    for pending in (PendingTokens([False, True], torch.tensor([-1, 8])), None):
        got = process_logits(logits, params, requests, [None, None], pending)
        assert got[0, [1, 9]].eq(float("-inf")).all()
        assert got[1, [1, 9]].eq(float("-inf")).all() == (pending is None)
        torch.testing.assert_close(
            got, process_logits_reference(logits, params, requests, [None, None], pending)
        )
