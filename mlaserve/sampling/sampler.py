"""Turns one row of logits per request into its next token: greedy, or temperature + top-k + top-p sampling.

Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d. picks token t with probability
p_t, and unlike torch.multinomial it needs no per-row kernel launch, so every row samples in one argmax.
Seeded rows draw their q from their own generator, and always exactly vocab_size values in vocab order, so a
request's tokens depend only on its seed and logits, never on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.host_copy import copy_queued, queued_values
from mlaserve.outputs import Logprob, LogprobEntry
from mlaserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: token id -> Logprob (top `logprobs` tokens plus the sampled one), or None if not asked.
    logprobs: list[LogprobEntry | None]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        logits = self.prepare(logits, params)
        token_ids = self.sample(logits, params, generators)
        return self.finish(params, token_ids.tolist(), self.logprobs(logits, params, token_ids))

    def prepare(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Checks the shapes; widens 16-bit logits to float32 when any row samples, wants logprobs or has its
        logits processed."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [num_rows, vocab_size], got shape {tuple(logits.shape)}")
        if len(params) != logits.shape[0]:
            raise ValueError(f"params need one entry per logits row ({logits.shape[0]}), got {len(params)}")
        if any(not p.is_greedy or p.logprobs is not None or p.needs_processing for p in params):
            # bf16/fp16 logits have too few mantissa bits for a faithful softmax tail and cumulative top-p mass.
            # Greedy rows alone need no copy: widening is exact, so argmax picks the same token either way.
            return logits.float()
        return logits

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """One token id per row, left on the logits' device: nothing here waits for the device (the per-row
        settings go over as queued copies, host_copy), so a runner can queue the next step before reading these
        (see finish)."""
        num_rows = logits.shape[0]
        if len(generators) != num_rows:
            raise ValueError(f"generators need one entry per logits row ({num_rows}), got {len(generators)}")
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sample_rows:
            return logits.argmax(dim=-1)
        if len(sample_rows) == num_rows:
            return _sample(logits, params, generators)
        token_ids = logits.argmax(dim=-1)
        rows = queued_values(sample_rows, torch.long, logits.device)
        token_ids[rows] = _sample(
            logits[rows], [params[i] for i in sample_rows], [generators[i] for i in sample_rows]
        )
        return token_ids

    def logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor
    ) -> LogprobTensors | None:
        """The device half of the rows' logprobs, queued behind the sampling (None when no row asks): read by
        finish once copied to the host, so the logits (a graph's output, rewritten by the next replay) are not
        needed after this."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        row_index = queued_values(rows, torch.long, logits.device)
        # From the raw logits, before temperature / top-k / top-p (vLLM's default "raw_logprobs"): the numbers
        # describe the model, not the sampling settings.
        logprobs = logits[row_index].log_softmax(dim=-1)
        sampled = logprobs.gather(1, token_ids[row_index].unsqueeze(1)).squeeze(1)
        ranks = vocabulary_ranks(logprobs, sampled)
        num_top = min(max(params[i].logprobs for i in rows), logits.shape[1])
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)
        else:  # logprobs=0 everywhere: the sampled token's alone
            values = ids = sampled.new_empty(len(rows), 0)
        return LogprobTensors(rows, sampled, values, ids, ranks)

    def finish(
        self, params: list[SamplingParams], token_id_list: list[int], logprobs: LogprobTensors | None
    ) -> SamplerOutput:
        """The host side: the ids as a list and the logprobs of the rows that asked (LogprobTensors on the host,
        or on a device, where reading them waits for it)."""
        out: list[LogprobEntry | None] = [None] * len(params)
        if logprobs is not None:
            sampled, top_values, top_ids, ranks = (
                t.tolist() for t in (logprobs.sampled, logprobs.top_values, logprobs.top_ids, logprobs.ranks)
            )
            for j, i in enumerate(logprobs.rows):
                k = params[i].logprobs  # the columns hold the most any row asked for, at most the vocabulary
                out[i] = logprob_entry(
                    token_id_list[i], sampled[j], ranks[j], top_ids[j][:k], top_values[j][:k]
                )
        return SamplerOutput(token_id_list, out)


@dataclass(slots=True)
class LogprobTensors:
    """Logprobs of the rows that asked, before they become dicts: rows (their indices in the batch), the sampled
    token's logprob [len(rows)], the top `most logprobs asked` values and ids [len(rows), k], and the sampled
    token's rank in the vocabulary [len(rows)]."""

    rows: list[int]
    sampled: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    ranks: torch.Tensor

    def to_host(self) -> LogprobTensors:
        """Copies queued behind the work so far (into pinned memory, not waiting): valid once that work is done."""
        sampled, values, ids, ranks = (
            t.to("cpu", non_blocking=True) for t in (self.sampled, self.top_values, self.top_ids, self.ranks)
        )
        return LogprobTensors(self.rows, sampled, values, ids, ranks)


def vocabulary_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's chosen token's 1-based rank among the vocabulary, counted as vLLM counts it: the tokens at
    least as likely, itself included (so tied tokens share the lower rank). logprobs [rows, vocab], chosen [rows]."""
    return (logprobs >= chosen.unsqueeze(1)).sum(dim=1)


def logprob_entry(
    token: int, value: float, rank: int, top_ids: list[int], top_values: list[float]
) -> LogprobEntry:
    """vLLM's dict for one position: the chosen token first, then the top tokens ranked 1, 2, ... (a chosen token
    that is also a top token keeps the top token's entry, with the same value, as in vLLM)."""
    entry = {token: Logprob(value, rank)}
    for position, (top_id, top_value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
        entry[top_id] = Logprob(top_value, position)
    return entry


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    probs = target_probs(logits, params)
    noise = exponential_noise(probs, generators)
    return probs.div_(noise).argmax(dim=-1)


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws from: temperature, then min_p, top-k and top-p, softmaxed. Also
    what speculative drafts of sampled requests are accepted against, so both see the same distribution."""
    temperature = queued_values([p.temperature for p in params], torch.float32, logits.device)
    scaled = _apply_top_k_top_p(_apply_min_p(logits / temperature.unsqueeze(1), params), params)
    return scaled.softmax(dim=-1)


def _apply_min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drops tokens less likely than min_p times the most likely one (after temperature, as vLLM does)."""
    if all(p.min_p == 0 for p in params):
        return scaled
    min_p = queued_values([p.min_p for p in params], torch.float32, scaled.device)
    probs = scaled.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets every token outside a row's top-k and then its top-p nucleus to -inf (in place)."""
    vocab_size = scaled.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    # top_p == 1 keeps everything; an infinite threshold keeps float32 cumsum rounding (total mass summing
    # to 1.0000001 before the last tokens) from trimming the tail.
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    if all(k == vocab_size for k in top_k) and all(p == float("inf") for p in top_p):
        return scaled

    device = scaled.device
    # Stable so that among tied logits the lower token id is kept, matching argmax's tie rule.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=device)
    drop = ranks.unsqueeze(0) >= queued_values(top_k, torch.long, device).unsqueeze(1)
    if any(p != float("inf") for p in top_p):
        # Nucleus over the top-k survivors, renormalised: keep a token while the mass strictly above it is
        # still short of top_p, i.e. the smallest prefix whose mass reaches top_p. The top token always survives.
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= queued_values(top_p, torch.float32, device).unsqueeze(1)
        # A top_p below float32's range rounds to 0, and 0 >= 0 would drop the top token too (every row -inf).
        drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, sorted_ids, drop)
    return scaled.masked_fill_(mask, float("-inf"))


def exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like probs: row i from generators[i] where it has one (vocab_size values in vocab
    order), else from the global generator."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    else:
        if unseeded:
            rows = queued_values(unseeded, torch.long, probs.device)
            noise[rows] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        vocab_size = probs.shape[1]
        for i, generator in enumerate(generators):
            if generator is not None:
                # Drawn on the generator's own device (the runner's, for the engine's requests) and copied over.
                copy_queued(
                    noise[i],
                    torch.empty(vocab_size, device=generator.device).exponential_(generator=generator),
                )
    # Exp(1) can return exactly 0; p / 0 would be inf for a kept token but nan for a masked one, and argmax
    # ranks nan above everything.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)
