import pytest
import torch

from mlaserve.sampling.sampler import Sampler
from mlaserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _sample_row_reference(
    logits_row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One row, written for obviousness: sort in Python, grow the nucleus token by token, then race."""
    logits_row = logits_row.float()
    if params.is_greedy:
        return int(logits_row.argmax())
    scaled = logits_row / params.temperature
    values = scaled.tolist()
    order = sorted(range(len(values)), key=lambda t: (-values[t], t))
    kept = order[: params.top_k] if params.top_k > 0 else order
    if params.top_p < 1.0:
        probs = torch.tensor([values[t] for t in kept]).softmax(dim=0).tolist()
        nucleus, mass = [], 0.0
        for token, p in zip(kept, probs, strict=True):
            if mass >= params.top_p:
                break
            nucleus.append(token)
            mass += p
        kept = nucleus
    masked = torch.full_like(scaled, float("-inf"))
    masked[kept] = scaled[kept]
    noise = torch.empty(len(values)).exponential_(generator=generator)
    return int((masked.softmax(dim=0) / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_in_any_dtype() -> None:
    logits = torch.randn(6, 50, generator=_gen(0))
    logits[2, [3, 17]] = 10.0  # a tie: argmax keeps the lower id
    expected = logits.argmax(dim=-1).tolist()
    assert expected[2] == 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler()(logits.to(dtype), [GREEDY] * 6, [None] * 6)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6
    assert Sampler()(logits, [GREEDY] * 6, [None] * 6).token_ids == expected


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 5e-324, 1e-39])
def test_top_p_below_float32_range_still_keeps_the_top_token(top_p: float) -> None:
    logits = torch.randn(3, 64)
    gen = torch.Generator().manual_seed(0)
    out = Sampler()(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 3, [gen] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(64, 100, generator=_gen(1))
    params = [SamplingParams(temperature=5.0, top_k=1)] * 32 + [
        SamplingParams(temperature=5.0, top_p=1e-6)
    ] * 32
    out = Sampler()(logits, params, [None] * 32 + [_gen(i) for i in range(32)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_ties_and_exact_nucleus_boundary() -> None:
    # Four equal logits: each token has probability exactly 0.25. top_p=0.5 is reached by two tokens, and
    # among ties the lower ids win (as argmax does), so only tokens 0 and 1 may be drawn.
    num_rows = 400
    flat = torch.zeros(num_rows, 4)
    drawn = Sampler()(flat, [SamplingParams(top_p=0.5)] * num_rows, [None] * num_rows).token_ids
    assert set(drawn) == {0, 1}
    tied = torch.tensor([[0.0, 5.0, 5.0, 1.0]]).expand(num_rows, -1)
    drawn = Sampler()(tied, [SamplingParams(top_k=1)] * num_rows, [None] * num_rows).token_ids
    assert set(drawn) == {1}


def _seeded_sequence(position: int, batch_size: int, steps: int = 20) -> list[int]:
    """The seeded request's tokens when it sits at `position` among `batch_size - 1` unrelated rows."""
    seeded = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=123)
    generator = _gen(123)
    neighbours = [GREEDY, SamplingParams(temperature=1.3), SamplingParams(top_k=3, seed=7)]
    step_logits = _gen(99)  # the seeded request's own logits, the same in every layout
    other_logits = _gen(batch_size * 31 + position)  # neighbours' logits differ per layout
    tokens = []
    for _ in range(steps):
        logits = torch.randn(batch_size, 256, generator=other_logits)
        logits[position] = torch.randn(256, generator=step_logits)
        params = [neighbours[i % 3] for i in range(batch_size)]
        generators = [_gen(i) if p.seed is not None else None for i, p in enumerate(params)]
        params[position], generators[position] = seeded, generator
        tokens.append(Sampler()(logits, params, generators).token_ids[position])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = _seeded_sequence(0, 1)
    assert len(set(alone)) > 1  # it really samples
    for position, batch_size in [(0, 5), (2, 5), (4, 5), (7, 8)]:
        torch.manual_seed(position)  # moves the default RNG used by unseeded neighbours
        assert _seeded_sequence(position, batch_size) == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=0)]
    runs = []
    for seed in (0, 1, 2):
        generator = _gen(seed)
        runs.append([Sampler()(logits, params, [generator]).token_ids[0] for _ in range(20)])
    assert runs[0] != runs[1] and runs[1] != runs[2] and runs[0] != runs[2]


@pytest.mark.parametrize(
    "top_k, top_p",
    [(5, 1.0), (0, 0.6), (-1, 0.3), (10, 0.5)],
)
def test_never_samples_outside_top_k_top_p(top_k: int, top_p: float) -> None:
    torch.manual_seed(0)
    row = torch.randn(64, generator=_gen(2)) * 2
    temperature = 0.9
    order = row.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = (row[kept] / temperature).softmax(dim=0)
    num_nucleus = int(((probs.cumsum(dim=0) - probs) < top_p).sum())
    allowed = set(kept[:num_nucleus])

    num_rows = 4000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * num_rows
    drawn = Sampler()(row.expand(num_rows, -1), params, [None] * num_rows).token_ids
    assert set(drawn) == allowed  # never outside, and every allowed token shows up in 4000 draws
    # Seeded rows go through the per-row noise path; they must respect the mask too.
    seeded = Sampler()(row.expand(200, -1), params[:200], [_gen(i) for i in range(200)]).token_ids
    assert set(seeded) <= allowed


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 0), (1.0, 4)])
def test_frequencies_follow_softmax(temperature: float, top_k: int) -> None:
    torch.manual_seed(1234)
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    num_rows = 20000
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * num_rows
    drawn = torch.tensor(Sampler()(row.expand(num_rows, -1), params, [None] * num_rows).token_ids)
    observed = torch.bincount(drawn, minlength=8).double()
    scaled = row / temperature
    if top_k:
        scaled[top_k:] = float("-inf")  # row is sorted, so the top-k are the first k
    expected = scaled.double().softmax(dim=0) * num_rows
    support = expected > 0
    assert observed[~support].sum() == 0
    chi2 = ((observed[support] - expected[support]) ** 2 / expected[support]).sum().item()
    # df <= 7: the 0.999 quantile is 24.3; 40 leaves room while still catching a wrong temperature.
    assert chi2 < 40, (observed, expected)


def test_logprobs_hold_top_tokens_and_sampled_token_from_raw_logits() -> None:
    logits = torch.randn(4, 30, generator=_gen(3)).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=2.0, logprobs=3, seed=1),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=3.0, top_k=30, logprobs=5),
    ]
    generators = [_gen(1), None, None, _gen(4)]
    out = Sampler()(logits, params, generators)
    raw = logits.float().log_softmax(dim=-1)  # raw: no temperature, no top-k/top-p
    assert out.logprobs[2] is None
    greedy = out.token_ids[1]
    assert list(out.logprobs[1]) == [greedy]
    assert (
        out.logprobs[1][greedy].logprob == pytest.approx(raw[1, greedy].item())
        and out.logprobs[1][greedy].rank == 1
    )
    for i, k in [(0, 3), (3, 5)]:
        row = out.logprobs[i]
        top = raw[i].topk(k).indices.tolist()
        assert out.token_ids[i] in row
        assert set(top) <= set(row) and len(row) in (k, k + 1)
        for token, value in row.items():
            assert value.logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
            # vLLM's rank: the tokens at least as likely, itself included
            assert value.rank == int((raw[i] >= raw[i, token]).sum())


def test_logprobs_larger_than_vocab_is_capped() -> None:
    out = Sampler()(torch.randn(1, 4), [SamplingParams(temperature=0.0, logprobs=20)], [None])
    assert sorted(out.logprobs[0]) == [0, 1, 2, 3]


@pytest.mark.parametrize("trial", range(4))
def test_vectorised_matches_reference(trial: int) -> None:
    inputs = _gen(1000 + trial)
    vocab_size = 97
    choices = [
        GREEDY,
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3),
        SamplingParams(temperature=1.7, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.5),
        SamplingParams(temperature=1.2, top_k=-1, top_p=0.95),
        SamplingParams(temperature=2.0, top_k=200),  # top_k above the vocab size is no filter
    ]
    num_rows = 24
    picks = torch.randint(len(choices), (num_rows,), generator=inputs).tolist()
    params = [choices[c] for c in picks]
    logits = torch.randn(num_rows, vocab_size, generator=inputs) * 3
    seeds = torch.randint(2**31, (num_rows,), generator=inputs).tolist()

    got = Sampler()(logits, params, [_gen(s) for s in seeds]).token_ids
    want = [_sample_row_reference(logits[i], params[i], _gen(seeds[i])) for i in range(num_rows)]
    assert got == want


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one entry per logits row"):
        Sampler()(torch.randn(2, 8), [GREEDY], [None, None])
    with pytest.raises(ValueError, match="2-D"):
        Sampler()(torch.randn(8), [GREEDY], [None])
