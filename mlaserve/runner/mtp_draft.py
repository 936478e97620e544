"""DeepSeek multi-token-prediction (MTP) drafts, made at the end of each step for the next one.

The MTP layer's row at position p is made from the embedding of token p + 1 and the main model's hidden state at p
(before its final norm); its output predicts token p + 2. So once a step's tokens are known, the layer runs over
every position the step computed and kept (a prompt chunk's, or a decode's last known token and the drafts it
accepted), each with the token after it: its rows join its own cache layer (kv_cache_spec's layer after the main
model's, in the same blocks), and the last row of a request gives the first draft after the token just sampled.
Draft j + 1 runs the same layer again, one row a request, on draft j and the layer's own output for draft j, at the
next position (as vLLM chains it); those rows sit past the verified tokens, in the slots the scheduler adds for
them (Scheduler._lookahead), and the next step's pass writes over them with the verified ones.

Drafts are the layer's argmax: a point mass, which runner/spec_verify.py's rejection sampling takes as it takes
prompt-lookup drafts. The plain reference is mlaserve/testing/mtp_reference.py. After a step replayed from the decode
graphs, the same pass runs on the device from graphs of its own (runner/mtp_graphs.py), checked against this one;
this one runs after prompt chunks and eager steps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.host_copy import queued_values
from mlaserve.kvcache.spec import FULL, AttentionRule
from mlaserve.runner.batch import HostBatch


@dataclass(slots=True)
class DraftSpan:
    """One request's rows of the layer's first pass: the positions start.. of its main-batch rows from `row`,
    each with the token after it."""

    request_id: str
    row: int  # its first row in the main batch
    start: int  # position of its first row
    next_ids: list[int]
    block_ids: list[int]
    drafts: bool  # it asks for drafts (its rows are still written when it does not: a later prefix hit reads them)

    @property
    def end(self) -> int:
        """One past its last position."""
        return self.start + len(self.next_ids)


def draft_spans(
    host: HostBatch, token_ids: dict[str, int], num_accepted: dict[str, int], group: int = 0
) -> list[DraftSpan]:
    """The first pass's rows, from a collected step: token_ids and num_accepted as accept_drafts leaves them (the
    token after the accepted drafts, and how many were accepted); group: the draft layer's cache group, whose block
    tables its rows use. A sampling request that got no token (aborted) is left out."""
    spans = []
    row = 0
    for s in host.order:
        request, first = s.request, row
        row += s.num_new_tokens
        rid, start, d = request.request_id, s.num_computed_tokens, len(s.spec_token_ids)
        known = request.all_token_ids
        if not s.needs_sample:  # a prompt chunk: the token after each is the prompt's own
            next_ids = known[start + 1 : start + s.num_new_tokens + 1]
        elif rid in token_ids and not request.is_finished:
            accepted = s.spec_token_ids[: num_accepted.get(rid, 0)]
            next_ids = [*known[start + 1 : start + s.num_new_tokens - d], *accepted, token_ids[rid]]
        else:
            continue
        drafts = s.needs_sample and request.allow_drafts
        spans.append(DraftSpan(rid, first, start, next_ids, s.block_ids[group], drafts))
    return spans


class MtpDrafter:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        num_drafts: int,
        group: int = 0,
        rule: AttentionRule = FULL,
    ) -> None:
        """group, rule: the draft layer's cache group and its attention rule. Under a window the layer reads what
        the target's layers of that group read (the last `window` rows and the sinks), not blocks the window gave
        back: its table holds the null block there."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_drafts = num_drafts
        self.group = group
        self.rule = rule

    @torch.inference_mode()
    def propose(self, spans: list[DraftSpan], prenorm: torch.Tensor) -> dict[str, tuple[int, list[int]]]:
        """request id -> (the token count its drafts follow, up to num_drafts drafts) for each span that asks;
        prenorm: the main model's hidden states before the final norm, one per main-batch row."""
        if not spans:
            return {}
        # Single-row spans first: the attention layers take the batch's decodes before its prefills.
        spans = sorted(spans, key=lambda span: len(span.next_ids) != 1)
        device = prenorm.device
        rows = [span.row + i for span in spans for i in range(len(span.next_ids))]
        ids = [t for span in spans for t in span.next_ids]
        positions = [p for span in spans for p in range(span.start, span.end)]
        hidden = self._run(spans, ids, positions, prenorm[queued_values(rows, torch.long, device)], False)
        ends = [n - 1 for n in itertools.accumulate(len(span.next_ids) for span in spans)]
        asking = [i for i, span in enumerate(spans) if span.drafts]
        out: dict[str, tuple[int, list[int]]] = {spans[i].request_id: (spans[i].end + 1, []) for i in asking}
        last = hidden[queued_values([ends[i] for i in asking], torch.long, device)]
        live = [spans[i] for i in asking]
        for j in range(self.num_drafts):
            if not live:
                break
            tokens = self.model.mtp_logits(0, last).argmax(dim=-1).tolist()
            for span, token in zip(live, tokens, strict=True):
                out[span.request_id][1].append(token)
            if j + 1 == self.num_drafts:
                break
            # The next draft's row sits at end - 1 + j + 1: only spans with a slot there go on.
            position = [span.end + j for span in live]
            room = [len(span.block_ids) * self.block_size for span in live]
            keep = [i for i, (p, r) in enumerate(zip(position, room, strict=True)) if p < r]
            live = [live[i] for i in keep]
            if not live:
                break
            index = queued_values(keep, torch.long, device)
            chain = [DraftSpan(s.request_id, 0, s.end + j, [0], s.block_ids, True) for s in live]
            last = self._run(chain, [tokens[i] for i in keep], [s.start for s in chain], last[index], True)
        return out

    def _run(
        self,
        spans: list[DraftSpan],
        ids: list[int],
        positions: list[int],
        previous: torch.Tensor,
        decodes_only: bool,
    ) -> torch.Tensor:
        """The layer over rows at `positions` (each span's rows in order, single-row spans first), its cache rows
        written in the spans' blocks."""
        device, size = previous.device, self.block_size
        widest = max(len(span.block_ids) for span in spans)
        tables = torch.tensor([span.block_ids + [0] * (widest - len(span.block_ids)) for span in spans],
                              dtype=torch.int32)  # fmt: skip
        slots = [
            span.block_ids[p // size] * size + p % size for span in spans for p in range(span.start, span.end)
        ]
        query_lens = [len(span.next_ids) for span in spans]
        num_decodes = len(spans) if decodes_only else sum(1 for n in query_lens if n == 1)
        meta = build_metadata(
            size,
            tables.to(device),
            query_lens,
            [span.end for span in spans],
            num_decodes,
            queued_values(slots, torch.long, device),
            window=self.rule.window,
            sinks=self.rule.sinks,
        )
        return self.model.mtp_forward(
            0,
            queued_values(ids, torch.long, device),
            queued_values(positions, torch.long, device),
            previous,
            self.kv_caches,
            meta,
        )
