"""What a step carries: the plan every tensor-parallel rank runs (sent by rank 0, pickled as numpy arrays), the step
queued on the device and not yet read (LaunchedStep), and what its collection gives the engine (StepResult)."""

from dataclasses import dataclass, field

import torch

from mlaserve.core.scheduler import ScheduledRequest, SchedulerOutput
from mlaserve.outputs import LogprobEntry
from mlaserve.runner.batch import HostBatch
from mlaserve.runner.mtp_graphs import QueuedDrafts
from mlaserve.runner.prompt_logprobs import PromptSpan, ScoredSpan
from mlaserve.sampling.sampler import LogprobTensors
from mlaserve.sampling_params import SamplingParams


@dataclass(slots=True)
class StepPlan:
    """What every rank needs to run a step's forward: rank 0 sends it to the others."""

    host: HostBatch  # order and sampled left empty: the ranks past 0 hold no requests
    spans: list[PromptSpan]
    # A lookahead step: each token's index among the previous step's sampled ids (-1 where known), else None.
    source_rows: list[int] | None
    # The rows of speculative drafts, whose logits every rank computes with the sampled rows': the head's
    # all-gather needs the same rows on every rank.
    verify_rows: list[int] = field(default_factory=list)
    # Rank 0 runs an MTP draft pass after the step: every rank runs it too, on the spans rank 0 sends next.
    draft_pass: bool = False

    def __reduce__(self) -> tuple:
        # The batch's tensors travel as numpy arrays: pickling a torch tensor has a fixed cost to write and a
        # larger one to read, whatever its size, on every step of a tensor-parallel engine.
        host = self.host
        arrays = [host.positions.numpy(), host.slots.numpy(), host.tables.numpy()]
        others = [(tables.numpy(), slots.numpy()) for tables, slots in host.other_groups]
        pooled = {
            g: (sources.numpy(), host.pooled_starts[g].numpy()) for g, sources in host.pooled_sources.items()
        }
        fields = (host.ids, host.query_lens, host.seq_lens, host.num_decodes, host.sample_rows)
        lists = (self.spans, self.source_rows, self.verify_rows, self.draft_pass)
        return _rebuild_plan, (arrays, others, pooled, fields, *lists)


def _rebuild_plan(
    arrays: list,
    others: list,
    pooled: dict,
    fields: tuple,
    spans: list,
    source_rows: list | None,
    verify_rows: list[int],
    draft_pass: bool,
) -> StepPlan:
    positions, slots, tables = (torch.from_numpy(a) for a in arrays)
    ids, query_lens, seq_lens, num_decodes, sample_rows = fields
    groups = [(torch.from_numpy(t), torch.from_numpy(s)) for t, s in others]
    sources = {g: torch.from_numpy(a) for g, (a, _) in pooled.items()}
    starts = {g: torch.from_numpy(s) for g, (_, s) in pooled.items()}
    host = HostBatch(
        ids, positions, slots, tables, query_lens, seq_lens, num_decodes, [], sample_rows, [], groups, sources,
        starts,
    )  # fmt: skip
    return StepPlan(host, spans, source_rows, verify_rows, draft_pass)


@dataclass(slots=True)
class StepResult:
    token_ids: dict[str, int]  # request id -> sampled token
    # request id -> logprobs of each token it keeps (when asked for): one, or with drafts one per kept token
    logprobs: dict[str, list[LogprobEntry]]
    # request id -> (prompt position of the first token scored, one logprobs dict per scored prompt token)
    prompt_logprobs: dict[str, tuple[int, list[LogprobEntry]]] = field(default_factory=dict)
    # request id -> drafts accepted, for requests that ran speculative drafts (their token_ids entry follows them)
    num_accepted: dict[str, int] = field(default_factory=dict)
    # Requests whose grammar stopped accepting tokens: they end with an error rather than go on unconstrained.
    grammar_failed: set[str] = field(default_factory=set)
    # request id -> (the token count they follow, drafts) from a draft model, for the next step (mtp_draft.py)
    drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device whose sampled tokens have not been read yet."""

    output: SchedulerOutput
    sampled: list[ScheduledRequest]  # requests that get a token, in row order of token_ids
    params: list[SamplingParams]
    logprobs: LogprobTensors | None  # the rows that asked, copied out with token_ids
    token_ids: torch.Tensor | None  # [num_sampled] on the device
    host_ids: torch.Tensor | None  # pinned copy of token_ids (CUDA), filled once `done` has fired
    done: torch.cuda.Event | None
    scored: list[ScoredSpan] = field(default_factory=list)  # prompt logprobs computed in this step
    drafted: list[ScheduledRequest] = field(
        default_factory=list
    )  # requests with speculative drafts, in batch order
    verified: torch.Tensor | None = None  # each draft's target token (spec_verify.draft_targets)
    # request id -> how many of its drafts its grammar takes (requests with a grammar)
    num_valid: dict[str, int] = field(default_factory=dict)
    # The draft rows' params and logprobs (of their targets), when a drafted request asks for logprobs.
    draft_logprobs: tuple[list[SamplingParams], LogprobTensors] | None = None
    host: HostBatch | None = None  # the batch, for an MTP drafter's pass after the step
    prenorm: torch.Tensor | None = None  # with an MTP drafter: every row's hidden state before the final norm
    queued_drafts: QueuedDrafts | None = None  # the MTP draft pass of a captured step, queued on the device
    # A draft model's drafts for the next step are read with this step's results, so a step queued behind it can
    # take them (and be placed as if its drafts all hold) once those are in (runner/queued_verify.py).
    drafts_follow: bool = False
    result: StepResult | None = None  # read early, to launch the step queued behind it; collect returns it
    queued_behind: SchedulerOutput | None = None  # a step queued behind it unsettled: settled when it is read

    @property
    def needs_host(self) -> bool:
        """Whether the next step must wait for this one's results on the host: a grammar needs the token
        sampled here. A request that takes speculative drafts needs them checked before its next row is placed,
        unless a draft model makes them (drafts_follow) and no row here is processed (penalties, min_tokens,
        logit_bias: a queued row counts one pending token, not the accepted drafts before it); prompt-lookup drafts
        are read from the tokens, so on such an engine only steps that sample nothing are followed by a queued
        step."""
        if any(p.needs_history for p in self.params):
            return True
        if not any(s.request.allow_drafts for s in self.sampled):
            return False
        return not self.drafts_follow or any(p.needs_processing for p in self.params)
