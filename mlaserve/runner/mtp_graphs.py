"""The MTP draft pass of a captured decode or verify step, queued on the device right behind the step and replayed
from a CUDA graph per padded row and request count (draft_keys), with no host sync until the drafts are read.

The eager drafter (runner/mtp_draft.py) runs after the step is collected, since its first pass has one row per
token the step kept, known only on the host then. Here the first pass runs over every row of the step at its fixed
shape instead: row j of a request (its last known token, then its drafts) takes the token after it as the step
leaves it, which for every kept row is the row's own target (spec_verify.draft_targets: an accepted draft equals its
target; the first rejected draft's target replaces it) and, on the last row, the sampled bonus token. Both are on
the device once the step is sampled, so the row's next token is read from there. Rows past the accepted ones take
a wrong token and write wrong cache rows, in slots past the verified tokens, which the next step writes over
before reading them (as chained drafts do, mtp_draft's docstring). Each request's accepted end is its first row
whose draft differs from its target (or that has no draft), found on the device by a minimum over its rows; the
chained drafts then run one row a request from that row's output, at the step's padded request count, each draft
the layer's argmax. A chained row past the request's blocks writes to slot 0 of the null block; its draft is
dropped on the host, where the accepted counts are known, as the eager drafter never makes it. Slots the scheduler
frees after the step (rejected drafts', finished requests') are written before any later step is queued.

Rows are each their own decode sequence, as a verify step's rows are (runner/verify_graphs.py), so the first pass
reads the step's own static inputs: positions, slots, lengths and tables of the decode graph just replayed, and its
hidden states before the final norm. The eager drafter stays the reference, and runs what this does not cover:
prompt chunks, steps run eagerly, tensor-parallel engines, models with several cache groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.core.scheduler import ScheduledRequest
from mlaserve.host_copy import copy_queued, queued_values
from mlaserve.runner.batch import HostBatch

if TYPE_CHECKING:
    from mlaserve.runner.cuda_graphs import DecodeGraphs
    from mlaserve.runner.mtp_draft import MtpDrafter

# Rows of the staged per-row inputs (one i64 buffer, one copy a step).
KNOWN, TARGET, SAMPLE, REQUEST, DRAFT, ROOM = range(6)

logger = logging.getLogger(__name__)


class DraftSource(Protocol):
    """The captured decode step the draft pass reads (DecodeGraphs; a CPU stand-in in tests)."""

    sizes: list[int]

    def step_rows(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(positions, block tables, metadata, hidden states before the final norm) of the step's `size` rows."""
        ...

    def decode_meta(
        self, size: int, slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor
    ) -> AttentionMetadata:
        """The metadata of a decode batch of `size` rows read from these static inputs."""
        ...


@dataclass(slots=True)
class QueuedDrafts:
    """A captured draft pass queued on the device: each request's drafts, read when its step is collected."""

    drafts: torch.Tensor  # [requests (padded), num_drafts] on the device, or its pinned copy
    done: torch.cuda.Event | None  # fires once `drafts` has been copied out (CUDA)
    # per request in batch order: (request, its block count x block size); its last known token's position is read
    # at collection, once a row queued behind a verify step is settled
    requests: list[tuple[ScheduledRequest, int]]
    on_device: torch.Tensor | None = None  # `drafts` on the device (a step queued behind reads them there)


class MtpDraftGraphs:
    def __init__(
        self, drafter: MtpDrafter, source: DraftSource, max_model_len: int, device: torch.device
    ) -> None:
        """drafter: the eager drafter, whose layer, caches and draft count this pass shares."""
        self.model, self.kv_caches, self.block_size = drafter.model, drafter.kv_caches, drafter.block_size
        self.num_drafts, self.source, self.device = drafter.num_drafts, source, device
        self.max_model_len = max_model_len
        block_size, num_drafts = self.block_size, self.num_drafts
        size = source.sizes[-1]
        self.inputs = torch.zeros(6, size, dtype=torch.long, device=device)
        self.targets = torch.zeros(size, dtype=torch.long, device=device)  # the step's draft targets
        self.sampled = torch.zeros(size, dtype=torch.long, device=device)  # the step's sampled tokens
        # the chained passes' inputs, computed on the device from each request's accepted end
        self.ends = torch.zeros(size, dtype=torch.long, device=device)
        self.chain_slots = torch.zeros(size, dtype=torch.long, device=device)
        self.chain_seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        blocks = -(-max_model_len // block_size)
        self.chain_tables = torch.zeros(size, blocks, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        # Two sets in turn: a step queued behind this one stages its pass before this one's drafts are read.
        self.staging = [torch.zeros(6, size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.host_drafts = [
            torch.zeros(size, num_drafts, dtype=torch.long, pin_memory=cuda) for _ in range(2)
        ]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self._turn = 0
        self.keys = draft_keys(source.sizes, num_drafts)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def capture(self) -> None:
        from mlaserve.runner.cuda_graphs import capture_by_size

        self.graphs, self.outputs = capture_by_size(self.keys, lambda key: self.forward(*key))

    def launch(
        self,
        host: HostBatch,
        drafted: list[ScheduledRequest],
        targets: torch.Tensor | None,
        sampled: torch.Tensor,
        num_valid: dict[str, int],
        draft_ids: tuple[torch.Tensor, list[int]] | None = None,
    ) -> QueuedDrafts:
        """Queues the pass for a step just replayed from the decode graphs (one row per token) and sampled:
        targets, sampled: the step's draft targets and sampled tokens on the device; num_valid: for a request
        with a grammar, how many of its drafts the grammar takes. draft_ids: for a step whose drafts are still
        placeholders on the host (queued behind a verify step), the drafts on the device and their rows."""
        key = draft_key(self.keys, len(host.ids), len(host.order))
        size, num_requests = key
        self._turn ^= 1
        staging = self.staging[self._turn]
        if self._copied is not None:  # this set's last step has left the staging buffer and been read
            self._copied[self._turn].synchronize()
        requests = stage_rows(staging, host, drafted, num_valid, size, self.block_size, self.max_model_len)
        copy_queued(self.inputs, staging)
        if draft_ids is not None:
            values, rows = draft_ids
            self.inputs[DRAFT].index_copy_(0, queued_values(rows, torch.long, self.device), values)
        if targets is not None:
            self.targets[: targets.shape[0]].copy_(targets)
        self.sampled[: sampled.shape[0]].copy_(sampled)
        if self.graphs:
            self.graphs[key].replay()
            drafts = self.outputs[key]
        else:
            drafts = self.forward(size, num_requests)
        if self._copied is None:
            return QueuedDrafts(drafts, None, requests, drafts)
        host_drafts, copied = self.host_drafts[self._turn], self._copied[self._turn]
        host_drafts[:num_requests].copy_(drafts, non_blocking=True)
        copied.record()
        return QueuedDrafts(host_drafts, copied, requests, drafts)

    @torch.inference_mode()
    def forward(self, size: int, num_requests: int) -> torch.Tensor:
        """The pass over a step of `size` rows and at most `num_requests` requests (the chained rows' count),
        from the static inputs alone: drafts [num_requests, num_drafts], row i the i-th request's (rows past the
        step's requests are padding)."""
        positions, tables, meta, prenorm = self.source.step_rows(size)
        known, target_row, sample_row, request, draft, room = self.inputs[:, :size]
        target = self.targets[target_row.clamp(min=0)]
        next_ids = torch.where(target_row >= 0, target, self.sampled[sample_row])
        next_ids = torch.where(known >= 0, known, next_ids)
        hidden = self.model.mtp_forward(0, next_ids, positions, prenorm, self.kv_caches, meta)
        # a request's accepted end: its first row whose draft is not its target (each request's last row has none)
        rows = torch.arange(size, device=positions.device)
        stops = torch.where((target != draft) | (target_row < 0), rows, size - 1)
        ends = self.ends[:size].fill_(size - 1).scatter_reduce_(0, request, stops, "amin")
        ends, room, size = ends[:num_requests], room[:num_requests], num_requests
        last = hidden[ends]
        token = self.model.mtp_logits(0, last).argmax(dim=-1)
        out = [token]
        chain_tables = self.chain_tables[:size]
        if self.num_drafts > 1:
            torch.index_select(tables, 0, ends, out=chain_tables)
            start = positions[ends]
        for j in range(1, self.num_drafts):
            position = start + j
            fits = position < room
            column = (position // self.block_size).clamp(max=chain_tables.shape[1] - 1)
            block = chain_tables.gather(1, column.unsqueeze(1)).squeeze(1).long()
            slots = self.chain_slots[:size]
            slots.copy_(torch.where(fits, block * self.block_size + position % self.block_size, 0))
            seq_lens = self.chain_seq_lens[:size]
            seq_lens.copy_(torch.where(fits, position + 1, 1))
            chain_meta = self.source.decode_meta(size, slots, seq_lens, chain_tables)
            last = self.model.mtp_forward(0, token, position, last, self.kv_caches, chain_meta)
            token = self.model.mtp_logits(0, last).argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)


def draft_keys(sizes: list[int], num_drafts: int) -> list[tuple[int, int]]:
    """The captured (rows, requests) pairs: for each row count, the requests of a step whose requests all carry
    every draft (the usual MTP step), and as many requests as rows (any step), smallest first. The chained passes
    run one row a request, so a step of b x (k + 1) rows chains at b rows, not b x (k + 1)."""
    keys = []
    for size in sizes:
        full = next(s for s in sizes if s >= -(-size // (num_drafts + 1)))
        keys += [(size, full)] if full == size else [(size, full), (size, size)]
    return keys


def draft_key(keys: list[tuple[int, int]], num_rows: int, num_requests: int) -> tuple[int, int]:
    """The smallest captured (rows, requests) pair that a step of num_rows rows and num_requests requests fits."""
    return min(key for key in keys if key[0] >= num_rows and key[1] >= num_requests)


def stage_rows(
    staging: torch.Tensor,
    host: HostBatch,
    drafted: list[ScheduledRequest],
    num_valid: dict[str, int],
    size: int,
    block_size: int,
    max_model_len: int,
) -> list[tuple[ScheduledRequest, int, int]]:
    """Writes the pass's per-row inputs for a step of one row per token, padded to `size` rows, into staging
    [6, >= size]: per row the token after it where the host knows it (a prompt token) else -1, the index of its
    target among the step's draft targets (-1 on a request's last row), its request's index among the sampled
    tokens, its request's index in the batch, and its draft where it may be accepted (-1 past a grammar's valid
    drafts, and on rows without one); per request the rows its blocks hold, at most max_model_len (the static
    tables' width, and the longest sequence the attention's fixed splits cover). Padding rows are requests of their
    own without targets. Returns each request's (request, rows its blocks hold)."""
    sample_index = {s.request.request_id: i for i, s in enumerate(host.sampled)}
    first_target = {}
    offset = 0
    for s in drafted:
        first_target[s.request.request_id] = offset
        offset += len(s.spec_token_ids)
    # Python lists, one tensor write at the end: per-request tensor writes cost more host time than the pass
    known, target, request, draft = ([-1] * size for _ in range(4))
    sample, room = [0] * size, [0] * size
    requests = []
    row = 0
    for i, s in enumerate(host.order):
        rid, d, n = s.request.request_id, len(s.spec_token_ids), s.num_new_tokens
        room[i] = min(len(s.block_ids[0]) * block_size, max_model_len)
        requests.append((s, room[i]))
        request[row : row + n] = [i] * n
        if not s.needs_sample:  # a one-token prompt chunk: the prompt's next token follows it
            known[row] = s.request.all_token_ids[s.num_computed_tokens + 1]
        else:
            sample[row : row + n] = [sample_index[rid]] * n
            if d:
                first = first_target[rid]
                target[row : row + d] = range(first, first + d)
                valid = num_valid.get(rid, d)
                draft[row : row + valid] = s.spec_token_ids[:valid]
        row += n
    request[row:size] = range(len(host.order), len(host.order) + size - row)
    columns = [known, target, sample, request, draft, room]  # in the order KNOWN .. ROOM
    staging[:, :size] = torch.tensor(columns, dtype=torch.long)
    return requests


def collect_drafts(
    queued: QueuedDrafts, token_ids: dict[str, int], num_accepted: dict[str, int]
) -> dict[str, tuple[int, list[int]]]:
    """request id -> (the token count its drafts follow, its drafts) as MtpDrafter.propose gives them (none at or
    past max_model_len, where no request goes), from a queued pass and the step's results (accept_drafts'
    token_ids and num_accepted)."""
    if queued.done is not None:
        queued.done.synchronize()
    rows = queued.drafts.tolist()
    out = {}
    for i, (s, room) in enumerate(queued.requests):
        last = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) - 1
        rid = s.request.request_id
        if not (s.needs_sample and s.request.allow_drafts) or rid not in token_ids or s.request.is_finished:
            continue
        end = last + num_accepted.get(rid, 0)  # the accepted end's position; draft j + 1 sits at end + 1 + j
        count = next((j for j in range(1, len(rows[i])) if end + j >= room), len(rows[i]))
        out[rid] = (end + 2, rows[i][:count])
    return out


def capture_draft_graphs(
    drafter: MtpDrafter, graphs: DecodeGraphs, max_model_len: int, eager_only: bool
) -> MtpDraftGraphs | None:
    """The captured draft pass over the decode graphs, or None where the eager drafter runs every pass: eager_only
    for what this does not cover (tensor parallelism, several cache groups), and a backend that plans its decode
    on the host per graph."""
    if eager_only or graphs.decode_plans:
        return None
    draft_graphs = MtpDraftGraphs(drafter, graphs, max_model_len, graphs.positions.device)
    try:
        draft_graphs.capture()
    except Exception as error:  # noqa: BLE001 - drafts only propose: the eager pass gives the same ones, slower
        logger.warning("MTP draft pass not captured (%s: %s); it runs eagerly", type(error).__name__, error)
        return None
    return draft_graphs
