"""Log-probabilities of a prompt's own tokens, scored from the hidden states of the step's prefill rows.

The hidden state at prompt position p gives the distribution of token p + 1, so a chunk covering positions
[start, end) scores prompt tokens start + 1 .. min(end, num_prompt_tokens - 1); the last position's
distribution is the first output token's, which the sampler reports. Chunked prefill therefore needs nothing
special: each chunk scores its own positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.host_copy import queued_values
from mlaserve.models.base import CausalLM
from mlaserve.outputs import LogprobEntry
from mlaserve.sampling.sampler import logprob_entry, vocabulary_ranks

# Rows of logits materialised at once: a 2,048-token prompt over a 129k vocabulary would be 1 GB in float32.
_CHUNK_ROWS = 256


@dataclass(slots=True)
class PromptSpan:
    """The prompt tokens one request scores in this step."""

    request_id: str
    first_row: int  # row in the flat batch of the position scoring `first_position`
    first_position: int  # prompt position of the first token scored (>= 1)
    targets: list[int]  # the prompt tokens scored, in order
    num_top: int


@dataclass(slots=True)
class ScoredSpan:
    span: PromptSpan
    target_logprobs: torch.Tensor  # [len(targets)] float32
    top_ids: torch.Tensor  # [len(targets), num_top]
    top_logprobs: torch.Tensor  # [len(targets), num_top]
    target_ranks: torch.Tensor  # [len(targets)] each prompt token's rank in the vocabulary

    def entries(self) -> list[LogprobEntry]:
        """One dict per scored token: the prompt's own token first, then the top tokens (vLLM's shape)."""
        targets = self.span.targets
        values, ranks = self.target_logprobs.tolist(), self.target_ranks.tolist()
        top_ids, top_values = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            logprob_entry(token, values[i], ranks[i], top_ids[i], top_values[i])
            for i, token in enumerate(targets)
        ]


def prompt_spans(order: list[ScheduledRequest]) -> list[PromptSpan]:
    """The spans of the requests in batch order that asked for prompt logprobs (empty when none did)."""
    spans: list[PromptSpan] = []
    row = 0
    for s in order:
        params = s.request.sampling_params
        wanted = getattr(params, "prompt_logprobs", None)
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        last = min(end, s.request.num_prompt_tokens - 1)  # positions < last score a prompt token
        if wanted is not None and start < last and not s.lookahead:
            prompt = s.request.prompt_token_ids
            spans.append(
                PromptSpan(s.request.request_id, row, start + 1, prompt[start + 1 : last + 1], wanted)
            )
        row += s.num_new_tokens
    return spans


def score_prompt_spans(model: CausalLM, hidden: torch.Tensor, spans: list[PromptSpan]) -> list[ScoredSpan]:
    """Logprobs of each span's tokens (and its top tokens) from the step's hidden states [num_tokens, hidden]."""
    scored = []
    for span in spans:
        n = len(span.targets)
        targets = queued_values(span.targets, torch.long, hidden.device)
        chosen, top_ids, top_values, ranks = [], [], [], []
        for lo in range(0, n, _CHUNK_ROWS):
            hi = min(n, lo + _CHUNK_ROWS)
            logits = model.compute_logits(hidden[span.first_row + lo : span.first_row + hi]).float()
            logprobs = logits.log_softmax(dim=-1)
            chosen.append(logprobs.gather(1, targets[lo:hi, None]).squeeze(1))
            ranks.append(vocabulary_ranks(logprobs, chosen[-1]))
            k = min(span.num_top, logprobs.shape[1])
            values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[lo:hi, None][:, :0])
            top_ids.append(ids)
            top_values.append(values)
        scored.append(
            ScoredSpan(span, torch.cat(chosen), torch.cat(top_ids), torch.cat(top_values), torch.cat(ranks))
        )
    return scored
