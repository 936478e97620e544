"""Rejection sampling of prompt-lookup drafts (runner/spec_verify.py) on hand-made distributions."""

from __future__ import annotations

import torch

from mlaserve.core.request import Request
from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.runner.spec_verify import accept_drafts, draft_targets, rejection_targets
from mlaserve.sampling_params import SamplingParams

ROWS = 40_000
# Binomial counts over ROWS rows stay within 6 standard deviations of their mean but with probability about 2e-9.
SIGMAS = 6


def within(count: int, p: float, n: int = ROWS) -> bool:
    return abs(count - n * p) <= SIGMAS * (n * p * (1 - p)) ** 0.5 + 1e-9


def test_a_draft_the_target_gives_0_3_is_accepted_30_percent_of_the_time() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.3, 0.5, 0.2, 0.0])
    probs = p.expand(ROWS, -1)
    drafts = torch.zeros(ROWS, dtype=torch.long)
    uniforms = torch.rand(ROWS, generator=gen)
    noise = torch.empty(ROWS, 4).exponential_(generator=gen)
    out = rejection_targets(probs, drafts, uniforms, noise)
    accepted = out == drafts
    assert within(int(accepted.sum()), 0.3)
    # The replacement is never the draft: it follows p without it, renormalised (0.5 / 0.7, 0.2 / 0.7), never
    # a token p rules out.
    replaced = out[~accepted]
    counts = torch.bincount(replaced, minlength=4).tolist()
    assert counts[0] == 0 and counts[3] == 0
    assert within(counts[1], 5 / 7, len(replaced)) and within(counts[2], 2 / 7, len(replaced))
    # Altogether each token comes with its probability under p.
    total = torch.bincount(out, minlength=4).tolist()
    assert all(within(c, q) for c, q in zip(total, p.tolist(), strict=True))


def test_certain_and_impossible_drafts() -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.0, 0.4]])
    drafts = torch.tensor([1, 0, 1])
    uniforms = torch.tensor([0.999999, 0.0, 0.0])  # the lowest draw still rejects a draft of probability 0
    noise = torch.ones(3, 3)
    assert rejection_targets(probs, drafts, uniforms, noise).tolist() == [1, 1, 0]


def scheduled(rid: str, params: SamplingParams, drafts: list[int]) -> ScheduledRequest:
    request = Request(rid, [5, 6, 7], max_tokens=8, arrival_index=0, sampling_params=params)
    return ScheduledRequest(request, len(drafts) + 1, 3, [], spec_token_ids=drafts)


def test_draft_targets_greedy_rows_take_the_argmax_and_seeded_rows_repeat() -> None:
    greedy = scheduled("g", SamplingParams(temperature=0), [3, 1])
    sampled = scheduled("s", SamplingParams(temperature=1.0, top_k=2, seed=3), [2, 0, 1])
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(2):
        generators = {"s": torch.Generator().manual_seed(3)}
        runs.append(draft_targets(logits, [greedy, sampled], generators).tolist())
    assert runs[0] == runs[1]
    assert runs[0][:2] == logits[:2].argmax(dim=-1).tolist()
    # top_k=2: every target of the sampled request is among its row's two likeliest tokens, or the draft itself.
    for row, draft in zip(range(2, 5), sampled.spec_token_ids, strict=True):
        assert runs[0][row] == draft or runs[0][row] in logits[row].topk(2).indices.tolist()
    # accept_drafts keeps drafts while they equal their targets, then takes the first target that differs.
    token_ids = {"g": 9, "s": 9}
    num_accepted = accept_drafts([greedy, sampled], runs[0], token_ids)
    for s, targets in ((greedy, runs[0][:2]), (sampled, runs[0][2:])):
        n = num_accepted[s.request.request_id]
        assert s.spec_token_ids[:n] == targets[:n]
        assert token_ids[s.request.request_id] == (targets[n] if n < len(targets) else 9)


def test_draft_targets_add_logit_bias() -> None:
    """A bias that leaves a token a probability near e^-50: a sampled request's drafts of it are rejected and it is
    never a target; a bias that makes a token the argmax: a greedy request's targets are all it."""
    sampled = scheduled("s", SamplingParams(temperature=1.0, seed=0, logit_bias={4: -100.0}), [4, 4, 4])
    greedy = scheduled("g", SamplingParams(temperature=0, logit_bias={2: 100.0}), [2, 1])
    logits = torch.zeros(5, 6)
    logits[:, 4] = 50.0  # the sampled request's likeliest token but for its bias
    raw = logits.clone()
    targets = draft_targets(logits, [sampled, greedy], {"s": torch.Generator().manual_seed(0)}).tolist()
    assert 4 not in targets[:3] and targets[3:] == [2, 2]
    assert torch.equal(logits, raw)  # the raw logits are not edited
