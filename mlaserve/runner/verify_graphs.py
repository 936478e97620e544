"""Speculative verify steps on the captured decode graphs: each token of the step replayed as its own decode row.

A request with d drafts runs d + 1 query rows (its last known token, then the drafts), causal among themselves. Row j
sees the context up to its own position, which is exactly what a decode row of a sequence position + 1 long sees
through the same block table: and every row's cache entry is written before any layer's attention reads the cache,
so the request's later rows see its earlier ones as a causal mask would let them. So a verify step of b requests is a
decode batch of b x (d + 1) rows, each with its request's table, and it replays the decode graph captured for that
many rows (DecodeGraphs captures up to max_num_seqs x (k + 1) of them). The graph's logits cover every row, which is
what verification needs: the drafts' rows and the sampled rows are all of them.

Pooled entries (compress_ratio, DeepSeek-V4's compressed entries) follow the rows: a row whose position completes
an entry writes it, from the rows the step cached before any layer reads them, as a decode row does; a rejected
draft's entry is rewritten by the step that computes its position again (engine/speculation.py).

Draft counts may differ between the requests of a step (a request without drafts, prompt-lookup drafts cut short,
a request near its max_tokens): nothing is padded to k, each row is a sequence of its own, and the batch is padded
only as every captured decode batch is, with rows at the null block. A step that also carries a prompt chunk, or
more rows than the largest graph, runs eagerly as before.

The cost of rows over sequences: each row reads its request's context again (k + 1 reads where a kernel taking
several query rows per sequence would read it once), small beside the weights at the contexts where decode is bound
by reading them, and growing with the context.

An MTP engine's graphs keep every row's hidden state before the final norm; its draft layer's pass is queued right
after the step, on the same rows at the same fixed shape, and replayed from graphs of its own (runner/mtp_graphs.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from mlaserve.host_copy import queued_values
from mlaserve.runner.batch import HostBatch


class CapturedDecode(Protocol):
    """What runs a decode-only batch from captured graphs (DecodeGraphs; a CPU stand-in in tests)."""

    def can_run(self, batch: HostBatch) -> bool: ...

    def run(
        self,
        batch: HostBatch,
        source: tuple[torch.Tensor, list[int]] | None = None,
        shift: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def run_with_prenorm(
        self,
        batch: HostBatch,
        source: tuple[torch.Tensor, list[int]] | None = None,
        shift: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


# (logits of the sampled rows, logits of the draft rows or None, hidden states before the final norm or None)
Captured = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def verify_as_decodes(batch: HostBatch) -> HostBatch | None:
    """The batch with one decode row per token, or None when a request is not a decode with or without drafts (a
    prompt chunk, a recomputed sequence). Tokens keep their order, so token rows, sample rows and draft rows keep
    their indices. A pooled group's entries are not carried: the captured step stages each row's own from its
    table and position (cuda_graphs.stage_group_inputs), so a draft row that completes an entry writes it."""
    if any(not s.needs_sample or s.num_new_tokens != len(s.spec_token_ids) + 1 for s in batch.order):
        return None
    index = torch.tensor([row for row, n in enumerate(batch.query_lens) for _ in range(n)], dtype=torch.long)
    n = len(batch.ids)
    others = [(tables[index], slots) for tables, slots in batch.other_groups]
    return HostBatch(
        batch.ids, batch.positions, batch.slots, batch.tables[index], [1] * n, (batch.positions + 1).tolist(), n,
        batch.order, batch.sample_rows, batch.sampled, others,
    )  # fmt: skip


def run_captured(
    graphs: CapturedDecode,
    batch: HostBatch,
    source: tuple[torch.Tensor, list[int]] | None,
    verify_rows: list[int] | None,
    keep_prenorm: bool,
    shift: torch.Tensor | None = None,
) -> Captured | None:
    """The step from the captured graphs, or None when it cannot run there. verify_rows: the rows whose logits check
    drafts (spec_verify.draft_rows); keep_prenorm: an MTP drafter reads every row's hidden state after the step."""
    rows = batch if not verify_rows else verify_as_decodes(batch)
    if rows is None or not graphs.can_run(rows):
        return None
    prenorm = None
    if keep_prenorm:
        logits, prenorm = graphs.run_with_prenorm(rows, source, shift)
    else:
        logits = graphs.run(rows, source, shift)
    if not verify_rows:  # every row samples, in row order
        return logits, None, prenorm
    picked = logits[queued_values(batch.sample_rows + verify_rows, torch.long, logits.device)]
    num_sampled = len(batch.sample_rows)
    return picked[:num_sampled], picked[num_sampled:], prenorm
