"""LLMEngine: an engine core and an output processor in one process, for the offline API and the CLI.

`step()` returns vLLM's cumulative RequestOutputs (text, stop strings, logprobs). A server reads the core's deltas
instead (AsyncEngine in a thread, or the core in its own process) and processes them itself.
"""

from __future__ import annotations

from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.model_config import ModelConfig
from mlaserve.core.kv_cache_manager import KVCacheManager
from mlaserve.core.request import RequestStatus
from mlaserve.engine.core import EngineCore
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.output_processor import OutputProcessor
from mlaserve.engine.parallel_sampling import ParentRequests, child_params, child_request_id
from mlaserve.executor.executor import Executor
from mlaserve.outputs import RequestOutput
from mlaserve.runner.model_runner import ModelRunner
from mlaserve.sampling_params import SamplingParams

__all__ = ["EngineArgs", "LLMEngine", "PreparedRequest"]


class EngineArgs:
    """vLLM's EngineArgs: the engine's options (and the MLA guides' names) gathered before the engine is built;
    checked at once, so a misspelled option fails here, not at from_engine_args."""

    def __init__(self, model: str | None = None, **options: object) -> None:
        self.model = model
        self.options = options
        self.create_engine_config()

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(model=self.model, **self.options)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.outputs = OutputProcessor(self.core.tokenizer, decode_logprobs=True)
        self.parents = ParentRequests()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    # ---- what users and tests read of the engine ----------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def tokenizer(self) -> object | None:
        return self.core.tokenizer

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.core.kv_manager

    @property
    def runner(self) -> ModelRunner:
        return self.core.executor.runner

    # ---- requests -------------------------------------------------------------------------------------------
    def prepare(self, prompt: str | dict, params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize without side effects, so a bad request in a batch starts no work."""
        return self.core.prepare(prompt, params)

    def add_prepared(self, prepared: PreparedRequest, request_id: str | None = None) -> str:
        """Queue a request; with n > 1, its n children (one RequestOutput comes back for them all)."""
        if prepared.params.n == 1:
            request_id = self.core.add_request(prepared, request_id)
            self.outputs.add(request_id, prepared)
            return request_id
        parent_id = request_id or self.core.new_request_id()
        # One RequestOutput carries one prompt_logprobs, so the first child alone scores the prompt and the others
        # read its blocks from the prefix cache.
        children = child_params(prepared.params, score_prompt_once=True)
        child_ids = [child_request_id(parent_id, i) for i in range(len(children))]
        self.parents.add(parent_id, child_ids)
        for child_id, params in zip(child_ids, children):
            child = PreparedRequest(prepared.prompt, prepared.prompt_token_ids, params, prepared.grammar)
            self.outputs.add(self.core.add_request(child, child_id), child)
        return parent_id

    def add_request(self, prompt: str | dict, params: SamplingParams, request_id: str | None = None) -> str:
        return self.add_prepared(self.prepare(prompt, params), request_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        finals = self.core.abort_requests(self.parents.child_ids(request_id) or [request_id])
        if not finals:
            return None
        _, _, finished = self.outputs.process(finals)
        outputs = self.parents.merge([s.output(rid) for rid, s in finished.items()], finished_only=True)
        return next((out for out in outputs if out.request_id == request_id), None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One engine step. Returns one cumulative RequestOutput for every request that got a token (finished or
        not, as vLLM's engine does); stream=False returns the finished ones only (what LLM.generate keeps),
        skipping a copy of every running request's prompt and output ids per step."""
        deltas, stopped, finished = self.outputs.process(self.core.step())
        self.core.release_finished()
        if stopped:  # stop strings found in the text: those requests end now
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        outputs = [state.output(rid) for rid, state in finished.items()]
        if stream:
            progressed = [d.request_id for d in deltas if d.request_id not in finished]
            outputs = [self.outputs.states[rid].output(rid) for rid in progressed] + outputs
        return self.parents.merge(outputs, finished_only=not stream)

    # ---- lifetime and introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.core.stats()

    def capture_mla_graph(self, max_seq_len: int | None = None) -> int:
        return self.core.capture_mla_graph(max_seq_len)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (also done when the engine is collected, or at exit)."""
        self.core.close()
