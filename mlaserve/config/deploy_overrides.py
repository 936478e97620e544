"""Command-line values laid over a deploy file: dotted keys such as "server.port" replace the file's value."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from mlaserve.config.deploy_errors import DeployConfigError

# argparse dest (or engine option) name -> deploy key, so `serve --port 9000 --config x.yaml` can be written
# as one overrides dict. engine option names appear too (max_num_seqs), so flags may use either spelling.
FLAG_KEYS: dict[str, str] = {
    "model": "model.path",
    "dtype": "model.dtype",
    "device": "model.device",
    "load_format": "model.load_format",
    "quantization": "model.quantization",
    "enable_mla": "model.enable_mla",
    "mla_latent_dim": "model.mla_latent_dim",
    "qk_rope_head_dim": "model.qk_rope_head_dim",
    "mla_skip_layers": "model.mla_skip_layers",
    "mla_rank_allocation": "model.mla_rank_allocation",
    "max_model_len": "model.max_model_len",
    "served_model_name": "model.served_model_name",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "enable_expert_parallel": "parallel.enable_expert_parallel",
    "distributed_executor_backend": "parallel.distributed_executor_backend",
    "block_size": "cache.block_size",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "kv_cache_memory_bytes": "cache.kv_cache_memory_bytes",
    "sliding_window": "cache.sliding_window",
    "num_sink_tokens": "cache.num_sink_tokens",
    "compress_ratio": "cache.compress_ratio",
    "index_topk": "cache.index_topk",
    "max_batch_size": "scheduler.max_batch_size",
    "max_num_seqs": "scheduler.max_batch_size",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "prefill_first": "scheduler.prefill_first",
    "async_scheduling": "scheduler.async_scheduling",
    "host": "server.host",
    "port": "server.port",
    "metrics_port": "server.metrics_port",
    "api_keys_file": "server.api_keys_file",
    "api_keys_env": "server.api_keys_env",
    "max_concurrent_requests": "server.max_concurrent_requests",
    "request_timeout_s": "server.request_timeout_s",
    "shutdown_grace_s": "server.shutdown_grace_s",
    "max_body_bytes": "server.max_body_bytes",
    "header_timeout_s": "server.header_timeout_s",
    "body_timeout_s": "server.body_timeout_s",
    "keep_alive_timeout_s": "server.keep_alive_timeout_s",
    "max_connections": "server.max_connections",
    "grammar_max_choices": "server.grammar_max_choices",
    "grammar_max_choice_bytes": "server.grammar_max_choice_bytes",
    "grammar_max_bytes": "server.grammar_max_bytes",
    "grammar_compile_timeout_s": "server.grammar_compile_timeout_s",
    "api_server_count": "server.api_server_count",
    "tool_call_parser": "server.tool_call_parser",
    "enable_auto_tool_choice": "server.enable_auto_tool_choice",
    "reasoning_parser": "server.reasoning_parser",
}


# Flags that give a whole section as one JSON object (vLLM's --speculative-config): each of its keys overrides
# that key of the section.
SECTION_FLAGS: dict[str, str] = {"speculative_config": "speculative"}


def overrides_from_flags(values: Mapping[str, object]) -> dict[str, object]:
    """Dotted overrides from flat flag values (e.g. `vars(args)`): names without a deploy key and values
    left at None (flag not given) are skipped, so only what the operator typed replaces the file."""
    out = {
        FLAG_KEYS[name]: value for name, value in values.items() if name in FLAG_KEYS and value is not None
    }
    for name, section in SECTION_FLAGS.items():
        value = values.get(name)
        if isinstance(value, Mapping):
            out.update({f"{section}.{key}": item for key, item in value.items()})
    return out


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, object]) -> tuple[dict[str, Any], set[str]]:
    """A copy of the parsed file with each "section.key" override set; also the keys that were overridden.

    None values are skipped: a flag that was not given must not erase the file's value.
    """
    merged = copy.deepcopy(raw)
    applied: set[str] = set()
    for dotted, value in overrides.items():
        if value is None:
            continue
        parts = dotted.split(".") if isinstance(dotted, str) else []
        if len(parts) != 2 or not all(parts):
            raise DeployConfigError(
                [(str(dotted), "override keys must look like 'section.key', for example 'server.port'")]
            )
        section, key = parts
        target = merged.setdefault(section, {})
        if target is None:  # an empty section in YAML (`cache:`) parses as None
            target = merged[section] = {}
        if not isinstance(target, dict):
            raise DeployConfigError(
                [(section, f"is not a mapping in the file, so override {dotted!r} cannot be applied")]
            )
        target[key] = value
        applied.add(dotted)
    return merged, applied
