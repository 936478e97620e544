"""What changes a row's logits before it is sampled: logit_bias, min_tokens, penalties, a grammar's mask.

The order is vLLM's: bias and min_tokens edit the model's logits, then the penalties read the token history,
then a grammar bans what it cannot continue with. Temperature, min_p, top-k and top-p follow in the sampler.
The raw logits are never edited in place: logprobs are reported from them (vLLM's default "raw" logprobs).
`process_logits_reference` is the slow per-row, per-token definition that the batched version is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mlaserve.core.request import Request
from mlaserve.host_copy import queued_values
from mlaserve.sampling_params import SamplingParams


class TokenMask(Protocol):
    """A grammar's view from the sampler: which tokens may come next (see sampling/structured_output.py)."""

    def allowed_bitmask(self, vocab_size: int) -> torch.Tensor:
        """int32 [ceil(vocab_size / 32)] on the CPU: bit t % 32 of word t // 32 is set if token t may come next."""
        ...


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [..., words] -> bool [..., vocab_size] (bit b of word w is token 32 w + b)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


@dataclass(frozen=True, slots=True)
class PendingTokens:
    """For a step queued ahead of the one still sampling: per row, whether the request has a token there (host),
    and that token's id on the device, -1 where none. min_tokens counts it; penalties count it in the history."""

    rows: list[bool]
    ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class FixedMask:
    """A grammar's mask computed ahead, for a speculative draft row: the matcher's state after the drafts before
    the row, which it no longer stands in once the masks are made (Grammar.draft_masks)."""

    bitmask: torch.Tensor

    def allowed_bitmask(self, vocab_size: int) -> torch.Tensor:
        return self.bitmask


def held_back_ids(request: Request) -> list[int]:
    """The ids min_tokens holds back: EOS (unless ignored) and the stop token ids."""
    ids = list(request.stop_token_ids)
    if request.eos_token_id is not None and not request.ignore_eos:
        ids.append(request.eos_token_id)
    return ids


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    requests: Sequence[Request],
    masks: Sequence[TokenMask | None],
    pending: PendingTokens | None = None,
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The logits to sample from: `logits` itself when no row asks for processing, else a processed copy.
    pending: the tokens still being sampled by the step before, for a step queued ahead of it. drafts: per row,
    the speculative drafts the step runs before it, which min_tokens and the penalties count as generated (the row
    is checked against the plain engine's row after them)."""
    rows = [i for i, p in enumerate(params) if p.needs_processing or masks[i] is not None]
    if not rows:
        return logits
    out = logits.clone()
    device, vocab_size = logits.device, logits.shape[1]
    add_bias(out, [(i, params[i].logit_bias) for i in rows if params[i].logit_bias], vocab_size)
    ahead = [len(d) for d in drafts] if drafts is not None else [0] * len(params)
    banned = [
        (i, held_back_ids(requests[i]))
        for i in rows
        if requests[i].num_output_tokens + bool(pending and pending.rows[i]) + ahead[i] < params[i].min_tokens
    ]
    _ban(out, banned, vocab_size)
    penalised = [i for i in rows if params[i].has_penalties]
    if penalised:
        index = queued_values(penalised, torch.long, device)
        out[index] = _penalise(
            out[index],
            [params[i] for i in penalised],
            [requests[i] for i in penalised],
            None if pending is None else pending.ids[index],
            None if drafts is None else [drafts[i] for i in penalised],
        )
    masked = [i for i in rows if masks[i] is not None]
    if masked:
        # Packed on the host, 32x fewer bytes to copy, unpacked on the device.
        packed = torch.stack([masks[i].allowed_bitmask(vocab_size) for i in masked]).to(device)
        allowed = unpack_bitmask(packed, vocab_size)
        index = torch.tensor(masked, device=device)
        out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def add_bias(out: torch.Tensor, rows: list[tuple[int, dict[int, float]]], vocab_size: int) -> None:
    """Adds each (row, {token: bias}) to out in place (also speculative draft rows: runner/spec_verify.py)."""
    entries = [(i, t, b) for i, bias in rows for t, b in bias.items() if t < vocab_size]
    if entries:
        r, t, b = zip(*entries, strict=True)
        # Queued copies: logit_bias alone leaves asynchronous scheduling on, so this runs behind the step in flight.
        index = (queued_values(r, torch.long, out.device), queued_values(t, torch.long, out.device))
        out.index_put_(index, queued_values(b, out.dtype, out.device), accumulate=True)


def _ban(out: torch.Tensor, rows: list[tuple[int, list[int]]], vocab_size: int) -> None:
    entries = [(i, t) for i, ids in rows for t in ids if t < vocab_size]
    if entries:
        r, t = zip(*entries, strict=True)
        rows_t, ids_t = (queued_values(v, torch.long, out.device) for v in (r, t))
        out[rows_t, ids_t] = float("-inf")


def _penalise(
    x: torch.Tensor,
    params: list[SamplingParams],
    requests: list[Request],
    pending: torch.Tensor | None,
    drafts: list[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output) penalties on the rows' logits x. pending:
    per row, an output token on the device not yet in the request (-1 where none), counted with its outputs;
    drafts: per row, output tokens on the host not yet in the request (speculative drafts before the row)."""
    device, (num_rows, vocab_size) = x.device, x.shape
    out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
    for row, request in enumerate(requests):
        ahead = drafts[row] if drafts is not None else ()
        out_rows += [row] * (request.num_output_tokens + len(ahead))
        out_ids += request.output_token_ids
        out_ids += ahead
        prompt_rows += [row] * len(request.prompt_token_ids)
        prompt_ids += request.prompt_token_ids
    counts = torch.zeros(num_rows, vocab_size, dtype=x.dtype, device=device)
    ones = torch.ones(len(out_ids), dtype=x.dtype, device=device)
    counts.index_put_(
        (queued_values(out_rows, torch.long, device), queued_values(out_ids, torch.long, device)),
        ones,
        accumulate=True,
    )
    if pending is not None:
        counts.scatter_add_(1, pending.clamp(min=0)[:, None], (pending >= 0).to(x.dtype)[:, None])
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    # a device tensor of values: a Python True would be copied from the host and wait for the device
    prompt_index = (
        queued_values(prompt_rows, torch.long, device),
        queued_values(prompt_ids, torch.long, device),
    )
    seen.index_put_(prompt_index, torch.ones(len(prompt_ids), dtype=torch.bool, device=device))

    def column(values: list[float]) -> torch.Tensor:
        return queued_values(values, x.dtype, device).unsqueeze(1)

    repetition = column([p.repetition_penalty for p in params])
    seen |= counts > 0
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - column([p.frequency_penalty for p in params]) * counts
    return x - column([p.presence_penalty for p in params]) * (counts > 0).to(x.dtype)


def process_logits_reference(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    requests: Sequence[Request],
    masks: Sequence[TokenMask | None],
    pending: PendingTokens | None = None,
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """One row and one token at a time, straight from the definitions (for tests)."""
    out = logits.clone()
    vocab_size = logits.shape[1]
    for i, (p, request) in enumerate(zip(params, requests, strict=True)):
        row = out[i]
        outputs = list(request.output_token_ids)
        if pending is not None and pending.rows[i]:
            outputs.append(int(pending.ids[i]))
        if drafts is not None:
            outputs += drafts[i]
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab_size:
                row[token] += bias
        if len(outputs) < p.min_tokens:
            for token in held_back_ids(request):
                if token < vocab_size:
                    row[token] = float("-inf")
        history = set(request.prompt_token_ids) | set(outputs)
        for token in range(vocab_size):
            value = row[token].item()
            if token in history:
                rp = p.repetition_penalty
                value = value / rp if value > 0 else value * rp
            count = outputs.count(token)
            value -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
            row[token] = value
        if masks[i] is not None:
            words = masks[i].allowed_bitmask(vocab_size).tolist()
            for token in range(vocab_size):
                if not (words[token // 32] >> (token % 32)) & 1:
                    row[token] = float("-inf")
    return out
