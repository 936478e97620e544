"""SamplingParams.n: one prompt, n samples, as vLLM's ParentRequest makes them.

The engine core runs one sequence per request, so n samples are n child requests of the same prompt, queued
together: the first child's full prompt blocks enter the prefix cache when they are allocated, and the others,
scheduled behind it in the same step, find them there, so the prompt's KV is computed and held once. The offline
API (LLMEngine) and the server both fan out through `child_params`, so a seeded request draws the same samples in
either.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import SamplingParams


def child_params(params: SamplingParams, score_prompt_once: bool = False) -> list[SamplingParams]:
    """One SamplingParams of n=1 per sample. A seed becomes seed + index (vLLM's rule), so the samples differ
    and a rerun repeats them; without a seed each child draws its own randomness.

    score_prompt_once: only the first child asks for prompt logprobs. A request that scores its prompt cannot
    read the prefix cache (every position's hidden state is needed), so without this each child would compute,
    and hold, the prompt itself. A caller that returns one prompt_logprobs per prompt sets it."""
    if params.n == 1:
        return [params]
    children = []
    for index in range(params.n):
        # A shallow copy: the fields were validated once, and the lists they hold are only read.
        child = copy.copy(params)
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + index
        if score_prompt_once and index > 0:
            child.prompt_logprobs = None
        children.append(child)
    return children


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"  # vLLM's form, so logs and traces read the same


@dataclass(slots=True)
class ParentRequest:
    """The latest cumulative output of each child of one n > 1 request."""

    request_id: str
    child_ids: list[str]
    latest: list[RequestOutput | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.latest = [None] * len(self.child_ids)

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.latest)

    def output(self) -> RequestOutput:
        """vLLM's shape: one RequestOutput, one CompletionOutput per child that produced something, by index."""
        seen = [(i, out) for i, out in enumerate(self.latest) if out is not None]
        first = seen[0][1]
        completions = []
        for index, out in seen:
            completion = out.outputs[0]
            completion.index = index  # a fresh object per RequestState.output call, so this changes no state
            completions.append(completion)
        scored = next((out.prompt_logprobs for _, out in seen if out.prompt_logprobs is not None), None)
        return RequestOutput(
            self.request_id,
            first.prompt,
            first.prompt_token_ids,
            completions,
            self.finished,
            first.num_cached_tokens,
            first.metrics,
            scored,
        )


class ParentRequests:
    """The n > 1 requests in flight, so child outputs can be merged into their parent's."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, int]] = {}

    def add(self, parent_id: str, child_ids: list[str]) -> None:
        if parent_id in self._parents:
            raise ValueError(f"request id {parent_id!r} is already in flight")
        parent = ParentRequest(parent_id, list(child_ids))
        self._parents[parent_id] = parent
        for index, child_id in enumerate(child_ids):
            self._children[child_id] = (parent, index)

    def child_ids(self, request_id: str) -> list[str] | None:
        parent = self._parents.get(request_id)
        return None if parent is None else list(parent.child_ids)

    def merge(self, outputs: list[RequestOutput], finished_only: bool) -> list[RequestOutput]:
        """The outputs with each child's replaced by its parent's (once per parent); a parent is finished when its
        last child is, and leaves the registry then. finished_only drops unfinished parents."""
        merged: list[RequestOutput] = []
        touched: dict[str, ParentRequest] = {}
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                merged.append(out)
                continue
            parent, index = entry
            parent.latest[index] = out
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.finished:
                del self._parents[parent.request_id]
                for child_id in parent.child_ids:
                    self._children.pop(child_id, None)
                merged.append(parent.output())
            elif not finished_only:
                merged.append(parent.output())
        return merged
