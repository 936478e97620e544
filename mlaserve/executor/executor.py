"""Executor: the device, the tensor-parallel ranks, the model (converted to MLA where asked), its KV cache and the
model runner, built in that order; it launches and collects the steps the engine core schedules.

Rank 0's executor belongs to the engine core; a rank past 0 builds one alone (executor/worker.py) and runs each
step's forward as rank 0 sends it.
"""

from __future__ import annotations

import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.attention.selector import attention_kernel, prefill_kernel, select_backend_and_reason
from mlaserve.config.engine_config import EngineConfig, SchedulerOptions
from mlaserve.config.model_config import ModelConfig
from mlaserve.conversion.folder import saved_conversion
from mlaserve.core.kv_cache_manager import KVCacheManager
from mlaserve.core.scheduler import SchedulerOutput
from mlaserve.executor.build_info import BuildInfo
from mlaserve.executor.device import resolve_device
from mlaserve.executor.graph_policy import decode_graphs_apply, prefill_graph_tokens
from mlaserve.executor.kv_cache import KVCache, build_kv_cache
from mlaserve.executor.model_build import load_model, with_saved_conversion
from mlaserve.executor.option_checks import check_engine_options
from mlaserve.executor.ranks import Ranks, launched_rank
from mlaserve.executor.workers import WorkerDied, Workers
from mlaserve.loader.model_files import ModelFiles, resolve_model
from mlaserve.loader.tokenizer import load_tokenizer
from mlaserve.parallel import ParallelContext
from mlaserve.runner.model_runner import ModelRunner
from mlaserve.runner.step import LaunchedStep, StepResult
from mlaserve.sampling.structured_output import Grammar

logger = logging.getLogger(__name__)


def step_token_budget(config: SchedulerOptions, max_model_len: int) -> int:
    """Tokens one step may carry. With chunked prefill the budget is vLLM's for large GPUs, whatever
    max_model_len: tying it to a short max_model_len (2,048) ran a burst of 256 prompts through 65 mixed steps
    instead of 17, at half the offline tokens/s. Without chunking a whole prompt must fit in one step."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens
    return 8192 if config.enable_chunked_prefill else max(8192, max_model_len)


class Executor:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, init_method: str | None = None) -> None:
        """tp_rank and init_method: a tensor-parallel rank past 0 (executor/worker.py); rank 0 starts those."""
        self.config = config
        self.device = resolve_device(config.model.device)
        self.ranks = Ranks()
        torch.manual_seed(config.model.seed)
        files = resolve_model(config.model.path, need_weights=config.model.load_format != "dummy")
        saved = saved_conversion(
            files.config_dict
        )  # a folder `mlaserve convert` wrote: MLA without calibrating
        if saved is not None:
            self.config = config = with_saved_conversion(config, saved)
        self.model_config = ModelConfig.from_hf(
            files.config_dict,
            config.model.dtype,
            self.device,
            config.model.max_model_len,
            config.model.quantization,
        )
        check_engine_options(config, self.model_config)  # what the model's cache cannot take, before any load
        parallel = config.parallel
        external = parallel.distributed_executor_backend == "external_launcher"
        if external:
            tp_rank, init_method = launched_rank(parallel.tensor_parallel_size), "env://"
        try:
            if parallel.distributed:
                self.device = self.ranks.join(self, config, self.device, tp_rank, init_method, external)
            self._build(config, files, saved, tp_rank)
        except BaseException as error:
            died = self.ranks.start_up_failed(error)
            if died is not None:
                raise died from error
            raise
        if external and tp_rank:
            # A launched rank past 0 serves rank 0's steps inside LLM(...) and ends when rank 0's engine closes: the
            # rest of the script is rank 0's.
            from mlaserve.parallel.group import exit_rank

            self.serve_plans()
            exit_rank()

    def _build(self, config: EngineConfig, files: ModelFiles, saved: dict | None, tp_rank: int) -> None:
        # skip_tokenizer_init (as vLLM): token ids in, token ids out; for speed runs on configs with no tokenizer.
        self.tokenizer = (
            None
            if config.model.skip_tokenizer_init or tp_rank
            else load_tokenizer(files, self.model_config.hf_config)
        )
        self.backend: AttentionBackend
        self.backend, backend_reason = select_backend_and_reason(self.device, config.model.attention_backend)
        self.model, self.load_report = load_model(
            config, self.model_config, files, saved, self.backend, self.device, self.parallel, self.tokenizer
        )
        max_len, dtype = self.model_config.max_model_len, self.model_config.dtype
        self.max_num_batched_tokens = step_token_budget(config.scheduler, max_len)
        block_size = config.cache.block_size
        self.kv_cache: KVCache = build_kv_cache(
            config.cache,
            self.model,
            dtype,
            max_len,
            self.max_num_batched_tokens,
            self.device,
            self.parallel,
            config.scheduler.max_num_seqs,
        )
        self.attention_kernel = attention_kernel(
            self.backend, self.model, self.kv_cache.dtype, block_size, self.device, dtype
        )
        sinks = max((layer.sinks for layer in self.kv_cache.spec.layers), default=0)
        self.prefill_kernel = prefill_kernel(self.backend, self.model, sinks, self.device, dtype)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache.tensors,
            block_size,
            self.device,
            self.kv_cache.group_rules,
            self.parallel,
            self.backend,
        )
        if getattr(self.model, "mtp", None):  # built for speculative method "mtp" (models/mtp.py)
            from mlaserve.runner.mtp_draft import MtpDrafter

            k = config.speculative.num_speculative_tokens
            # the first MTP layer's cache group: the layer after the main model's
            group = self.kv_cache.spec.layer_groups()[self.model_config.hf_config.num_hidden_layers]
            rule = self.kv_cache.group_rules[group]
            self.runner.drafter = MtpDrafter(self.model, self.kv_cache.tensors, block_size, k, group, rule)
        if self.device.type == "cuda":
            self.runner.warm_up(self.max_num_batched_tokens, max_len)
        graphable = decode_graphs_apply(self.model, self.backend, self.kv_cache.spec)
        if self.device.type == "cuda" and not config.model.enforce_eager and graphable:
            # An MTP drafter reads every prompt row's hidden state before the final norm, which prefill graphs
            # do not keep: its prompts run eagerly (its decode and verify graphs keep them).
            prefill = (
                0
                if self.runner.drafter
                else prefill_graph_tokens(self.model, dtype, self.max_num_batched_tokens)
            )
            self.runner.enable_cuda_graphs(max_len, config.scheduler.max_num_seqs, prefill, self.rows_per_seq)
        self.build_info = BuildInfo(
            config.model.path,
            self.model_config.architecture,
            self.load_report,
            self.backend.name,
            backend_reason,
            self.attention_kernel,
            str(self.device),
            max_len,
            config.parallel.tensor_parallel_size,
            config.parallel.enable_expert_parallel,
            config.parallel.distributed,
            tuple(self.ranks.pids),
            self.prefill_kernel,
        )

    # ---- what the engine core reads ---------------------------------------------------------------------------
    @property
    def rows_per_seq(self) -> int:
        """Query rows a sequence may run in one step of its decode: 1 + its drafts when speculation is asked for.
        Captured for that many whether or not the engine core turns speculation off later (its reasons are its
        own, engine/speculation.py): larger graphs cost capture time, not correctness."""
        spec = self.config.speculative
        return 1 + spec.num_speculative_tokens if spec.enabled and not self.parallel.distributed else 1

    @property
    def parallel(self) -> ParallelContext:
        return self.ranks.parallel

    @property
    def workers(self) -> Workers | None:
        return self.ranks.workers

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.kv_cache.manager

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv_cache.tensors

    def describe_kv_cache(self) -> str:
        """The start-up line: the KV cache's layout and the attention that reads it."""
        line = self.kv_cache.describe(self.model_config.dtype)
        return (
            line + f"; attention {self.backend.name}, decode kernel {self.attention_kernel}, "
            f"prefill kernel {self.prefill_kernel}"
        )

    # ---- per-request state on the device side ---------------------------------------------------------------
    def add_request(self, request_id: str, seed: int | None, grammar: Grammar | None) -> None:
        """A seeded request gets its own generator; a structured-output request its grammar's matcher."""
        if seed is not None:
            self.runner.add_generator(request_id, seed)
        if grammar is not None:
            self.runner.add_grammar(request_id, grammar)

    def drop_request(self, request_id: str) -> None:
        self.runner.drop_request(request_id)

    # ---- steps ------------------------------------------------------------------------------------------------
    def check_ranks(self) -> None:
        """Raises WorkerDied once a rank this process started has exited."""
        self.ranks.check()

    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        return self.runner.launch(output, previous)

    def collect(self, launched: LaunchedStep) -> StepResult:
        return self.runner.collect(launched)

    def rank_death(self, error: BaseException) -> WorkerDied | None:
        """After a step raised: a WorkerDied to raise instead, when a rank's death is what broke it."""
        dead = self.ranks.death(error)
        return WorkerDied(dead) if dead is not None else None

    def serve_plans(self) -> None:
        """A rank past 0: run each step rank 0 sends, until it sends the stop."""
        self.ranks.serve_plans(self.runner.run_plan)

    def close(self) -> None:
        """Rank 0 of a tensor-parallel engine: stop the other ranks and leave the process group; idempotent (also
        run when the executor is collected, or at exit)."""
        self.ranks.close()

    # ---- introspection ---------------------------------------------------------------------------------------
    def capture_mla_graph(self, max_seq_len: int | None = None) -> int:
        """(Re)capture the decode CUDA graphs for sequences up to max_seq_len tokens (default max_model_len); their
        attention splits are sized for that length. Returns how many batch sizes were captured."""
        limit = self.model_config.max_model_len
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not 0 < max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be in 1..max_model_len ({limit}), got {max_seq_len}")
        if self.device.type != "cuda":
            raise RuntimeError(
                f"capture_mla_graph: CUDA graphs need a GPU; this engine runs on {self.device}"
            )
        if self.parallel.distributed:
            raise RuntimeError(
                "capture_mla_graph: not with tensor parallelism (every rank would capture again)"
            )
        if self.runner.graphs is None:
            raise RuntimeError(
                "capture_mla_graph: this engine runs its decode steps eagerly (enforce_eager, or a model or "
                "attention backend that cannot be captured; the start-up log says which)"
            )
        self.runner.enable_cuda_graphs(max_seq_len, self.config.scheduler.max_num_seqs, 0, self.rows_per_seq)
        return len(self.runner.graphs.sizes)

    def stats(self) -> dict:
        """The executor's part of the engine's stats: the cache's layout, the attention, the device."""
        cache, dtype = self.kv_cache, self.model_config.dtype
        stats = {
            "kv_cache_groups": cache.group_descriptions(),
            "kv_bytes_per_token": cache.bytes_per_token,
            "kv_capacity_tokens": cache.capacity_tokens,
            "block_size": cache.block_size,
            "attention_backend": self.backend.name,
            "attention_kernel": self.attention_kernel,
            "prefill_kernel": self.prefill_kernel,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_dtype": str(cache.dtype).removeprefix("torch."),
            "device": str(self.device),
            "tensor_parallel_size": self.config.parallel.tensor_parallel_size,
            # this rank's weights, by kind: FP8 weights and their scales apart from the model's dtype
            "weight_bytes": self.load_report.weight_bytes,
            "weight_bytes_by_kind": dict(self.load_report.bytes_by_kind),
            "quantization": self.model_config.quant.name if self.model_config.quant else None,
        }
        if cache.spec.mha_elements_per_layer:
            stats["mha_kv_bytes_per_token"] = cache.spec.mha_bytes_per_token(dtype)
        if cache.spec.pool_per_group:  # each group's usable blocks: the capacity is not blocks x block_size
            stats["kv_pool_blocks"] = [pool.num_blocks - 1 for pool in cache.manager.pools]
        return stats
