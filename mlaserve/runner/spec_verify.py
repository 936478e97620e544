"""Verifying speculative drafts in the step that runs them: per draft, the token it is checked against.

A request with d drafts runs d + 1 tokens (its last known token, then the drafts). The logits at the first d of them
predict the tokens the drafts claim to be; the last one is the request's usual sampled row, whose token is the bonus
when every draft holds. Each draft row gets a target token, and accept_drafts keeps drafts while they equal their
targets, then takes the first target that differs (or the bonus):

- greedy requests: the argmax, the token the plain engine would have picked there;
- sampled requests, by rejection sampling (Leviathan et al.) with a prompt-lookup draft's distribution a point mass
  on the draft d: with p the row's distribution after temperature, min_p, top-k and top-p (the sampler's own
  target_probs), the target is d with probability p(d), else a token drawn from p with d removed and renormalised.
  Every token the step yields then follows the plain engine's distribution exactly. The draws (one uniform and one
  Exp(1) vector per draft row, after the sampler's draw for the bonus row) come from the request's generator when
  it has a seed, else from the global one: a seeded request repeats itself run to run with the same drafts, but
  its tokens differ from those it gets without drafts (other draws, same distribution), as in vLLM.

A draft row's distribution is the one the plain engine would sample from at that row: its logits are processed
(logit_bias, min_tokens, penalties, a grammar's mask) as if the drafts before it had been generated
(draft_processing.py), and the sampled row is processed after all of them.
"""

from __future__ import annotations

import torch

from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.host_copy import queued_values
from mlaserve.runner.draft_processing import DraftGrammar, process_draft_rows
from mlaserve.sampling.sampler import exponential_noise, target_probs
from mlaserve.spec_decode.accept import greedy_accept


def draft_rows(order: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[int]]:
    """The requests in batch order that run drafts, and the batch rows whose logits check them (d per request,
    in the same order)."""
    drafted: list[ScheduledRequest] = []
    rows: list[int] = []
    row = 0
    for s in order:
        d = len(s.spec_token_ids)
        if d:
            first = row + s.num_new_tokens - d - 1  # the last known token's row
            drafted.append(s)
            rows.extend(range(first, first + d))
        row += s.num_new_tokens
    return drafted, rows


def draft_targets(
    logits: torch.Tensor,
    drafted: list[ScheduledRequest],
    generators: dict[str, torch.Generator],
    walks: dict[str, DraftGrammar] | None = None,
) -> torch.Tensor:
    """The target token of each draft row (logits: draft_rows' rows, in order), on the logits' device: the argmax
    for a greedy request, rejection_targets for a sampled one, both after the row's processing as the plain engine
    would process it (draft_processing.py; walks: the grammar states of the requests that have a grammar)."""
    if any(s.request.sampling_params.needs_processing for s in drafted):
        # In float32, as the sampler processes logits; process_draft_rows edits a copy, never the raw logits.
        logits = process_draft_rows(logits.float(), drafted, walks or {})
    targets = logits.argmax(dim=-1)
    rows: list[int] = []
    drafts: list[int] = []
    params = []
    row_generators: list[torch.Generator | None] = []
    row = 0
    for s in drafted:
        d = len(s.spec_token_ids)
        if not s.request.sampling_params.is_greedy:
            rows.extend(range(row, row + d))
            drafts.extend(s.spec_token_ids)
            params.extend([s.request.sampling_params] * d)
            row_generators.extend([generators.get(s.request.request_id)] * d)
        row += d
    if not rows:
        return targets
    device = logits.device
    index = queued_values(rows, torch.long, device)
    # float32, as the sampler widens 16-bit logits before a softmax whose tail mass matters
    probs = target_probs(logits[index].float(), params)
    uniforms = _uniforms(row_generators, device)
    noise = exponential_noise(probs, row_generators)
    targets[index] = rejection_targets(probs, queued_values(drafts, torch.long, device), uniforms, noise)
    return targets


def rejection_targets(
    probs: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """Per row: the draft when uniforms < probs[draft] (accepted with probability p(d)), else the token of the
    exponential race argmax(residual / noise) over residual = p with the draft's entry zeroed, which picks t with
    probability p(t) / (1 - p(d)): the renormalised max(0, p - q) for q a point mass on d. The residual is only
    all zero when p(d) is 1, and then the draft is always accepted. probs, noise: [rows, vocab]; drafts,
    uniforms: [rows]."""
    column = drafts.unsqueeze(1)
    draft_prob = probs.gather(1, column).squeeze(1)
    residual = probs.scatter(1, column, 0.0)
    replacement = residual.div_(noise).argmax(dim=-1)
    return torch.where(uniforms < draft_prob, drafts, replacement)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row, from the row's generator when it has one (in row order), else the global one."""
    out = torch.rand(len(generators), device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    for i in seeded:
        generator = generators[i]
        out[i] = torch.rand(1, device=generator.device, generator=generator).to(device, non_blocking=True)[0]
    return out


def accept_drafts(
    drafted: list[ScheduledRequest],
    targets: list[int],
    token_ids: dict[str, int],
    num_valid: dict[str, int] | None = None,
) -> dict[str, int]:
    """Each drafted request's accepted draft count; its entry in token_ids (the token sampled after its last
    draft) becomes the target after the accepted ones. targets: draft_targets' ids, in order. num_valid: for a
    request with a grammar, how many of its drafts the grammar takes; none past them is accepted."""
    num_accepted: dict[str, int] = {}
    offset = 0
    for s in drafted:
        rid, drafts = s.request.request_id, s.spec_token_ids
        row_targets = targets[offset : offset + len(drafts)]
        offset += len(drafts)
        if rid not in token_ids:
            continue
        valid = (num_valid or {}).get(rid, len(drafts))
        after = row_targets[valid] if valid < len(drafts) else token_ids[rid]
        out = greedy_accept(drafts[:valid], [*row_targets[:valid], after])
        num_accepted[rid] = len(out) - 1
        token_ids[rid] = out[-1]
    return num_accepted
