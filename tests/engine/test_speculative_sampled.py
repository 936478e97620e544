"""Prompt-lookup drafts for sampled requests (rejection sampling, runner/spec_verify.py) keep the plain engine's
distribution, with and without penalties and min_tokens (runner/draft_processing.py), and seeded requests stay
reproducible with drafts, on a tiny Llama."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mlaserve import LLM, SamplingParams

BASE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=2048)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NUM_REQUESTS = 1500
# Total false-failure rate of the distribution test, split evenly over its chi-square tests (Bonferroni).
ALPHA = 1e-3
# At temperature 0.1 a penalty of 0.1 moves a token's logit by a whole nat after scaling, so these change the
# distribution; 211 is a likely token at several positions, so min_tokens holds it back from the first 4, and
# some outputs stop at it after them. Drafts repeat the prompt, so the penalties' counts and the would-be length
# differ from row to row of one step.
PROCESSED = dict(frequency_penalty=0.1, presence_penalty=-0.1, repetition_penalty=0.97, min_tokens=4,
                 stop_token_ids=[211])  # fmt: skip


def repeating_prompt() -> list[int]:
    """Six tokens four times over. At temperature 0.1 the tiny model's next token is a near coin flip between two
    continuations here, so drafts are both often accepted and often rejected (the replacement draw matters)."""
    gen = torch.Generator().manual_seed(0)
    torch.randint(3, 250, (3,), generator=gen)
    return torch.randint(3, 250, (6,), generator=gen).tolist() * 4


def sample(path, seeds: range, extra: dict | None = None, **options) -> tuple[list[tuple[int, ...]], LLM]:
    fields = dict(
        temperature=0.1, top_k=8, top_p=0.97, min_p=0.01, max_tokens=6, ignore_eos=True, **(extra or {})
    )
    params = [SamplingParams(seed=s, **fields) for s in seeds]
    llm = LLM(str(path), **{**BASE, **options})
    outs = llm.generate([{"prompt_token_ids": repeating_prompt()}] * len(params), params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs], llm


def chi_square_p_value(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square test of homogeneity (2 x K table) and its degrees of freedom. Categories whose pooled
    count would give an expected cell under 5 are merged into one, so the chi-square approximation holds."""
    n_a, n_b = sum(a.values()), sum(b.values())
    # A pooled count below this gives some cell an expectation under 5.
    small = 5 * (n_a + n_b) / min(n_a, n_b)
    table: dict[object, list[int]] = {}
    for key in a.keys() | b.keys():
        cell = key if a[key] + b[key] >= small else "rest"
        row = table.setdefault(cell, [0, 0])
        row[0] += a[key]
        row[1] += b[key]
    stat = 0.0
    for count_a, count_b in table.values():
        total = count_a + count_b
        for observed, n in ((count_a, n_a), (count_b, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected if expected else 0.0
    df = len(table) - 1
    if df == 0:
        return 1.0, 0
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    p = torch.special.gammaincc(half[0], half[1])  # the chi-square survival function
    return float(p), df


@pytest.mark.parametrize("extra", [None, PROCESSED], ids=["plain", "penalties_min_tokens"])
def test_sampled_tokens_follow_the_plain_engines_distribution(llama, extra: dict | None) -> None:
    """The plain engine and the speculative one (other seeds, so the two samples are independent) give the same
    distribution of each of the 6 tokens (None past a stop) and of the last three together (drafts start once the
    output repeats itself, from about the third token). Seven two-sample chi-square tests, each at ALPHA / 7: under the null the
    chance that any fails is at most ALPHA (Bonferroni, whatever the tests' dependence). The seeds are fixed, so
    the outcome is the same every run.

    Power, checked by hand with the verification broken: replacements that may repeat the rejected draft, drafts
    always accepted, or accepted with probability sqrt(p(d)) each fail with p-values below 1e-11; with penalties and
    min_tokens, draft rows processed as if no draft came before them fail on tokens 3-5 with p near 1e-6."""
    plain, _ = sample(llama, range(NUM_REQUESTS), extra)
    drafted, llm = sample(llama, range(10_000, 10_000 + NUM_REQUESTS), extra, speculative_config=NGRAM)
    stats = llm.stats()
    # Drafts for sampled requests, many accepted and many rejected: both branches of the verification ran.
    assert stats["num_draft_tokens"] > NUM_REQUESTS
    assert 0.3 < stats["draft_acceptance_rate"] < 0.9 and stats["kv_blocks_used"] == 0
    views = {f"token {i}": lambda t, i=i: t[i] if i < len(t) else None for i in range(6)}
    views["tokens 3-5"] = lambda t: t[3:]
    for name, view in views.items():
        a, b = Counter(map(view, plain)), Counter(map(view, drafted))
        p, df = chi_square_p_value(a, b)
        tv = sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / (2 * NUM_REQUESTS)
        assert p > ALPHA / len(views), f"{name}: p={p:.2e} (df {df}), total variation {tv:.3f}"


def test_seeded_sampled_requests_repeat_with_drafts(llama) -> None:
    seeds = range(40)
    first, llm = sample(llama, seeds, speculative_config=NGRAM)
    second, again = sample(llama, seeds, speculative_config=NGRAM)
    assert first == second
    for engine in (llm, again):
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_accepted_tokens"] > 0
        assert stats["num_generated_tokens"] == 6 * len(seeds)
    # Same seed, other draws: the tokens after the first (which no draft precedes) differ from the plain engine's.
    plain, _ = sample(llama, seeds)
    assert [t[0] for t in plain] == [t[0] for t in first] and plain != first
