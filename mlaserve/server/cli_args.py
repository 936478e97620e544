"""Flags of `mlaserve serve`, and how they become ServerSettings + engine options when no YAML file is given.

`--config deploy.yaml` is only accepted and passed through here: the deploy-config loader merges the file
with these flags (flags win). Every flag defaults to None so that loader can tell "not given" from a value,
and flag names (argparse dests) are the ones `mlaserve.config.deploy_overrides.FLAG_KEYS` maps.
"""

from __future__ import annotations

import argparse
import json
import os

from mlaserve.config.server_settings import ServerSettings
from mlaserve.tool_calls import REASONING_PARSERS, TOOL_PARSERS


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated ints (layer numbers, per-layer ranks)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# (flag, type, help); every default is None
_MODEL_FLAGS = [
    ("--model", str, "HF model folder or .gguf file (default: SmolLM2-135M-Instruct)"),
    ("--dtype", str, "auto, float32, bfloat16, float16 (default auto)"),
    ("--device", str, "auto, cpu, cuda (default auto)"),
    ("--load-format", str, "auto, or dummy: random weights from config.json alone (benchmarks)"),
    ("--quantization", str, "fp8: quantize an unquantized checkpoint to block FP8 on load"),
    ("--max-model-len", int, "longest prompt + output (default: the model's)"),
    ("--enable-mla", bool, "serve a Llama/Qwen2/Mistral model from an MLA latent cache (exact conversion)"),
    ("--mla-latent-dim", int, "with --enable-mla: lossy conversion to this latent width per layer"),
    ("--qk-rope-head-dim", int, "with --enable-mla: rotary features each KV head keeps (lossy)"),
    ("--mla-skip-layers", int_list, "with --enable-mla: layers that keep per-head K/V, e.g. 0,1,27"),
    (
        "--mla-rank-allocation",
        str,
        "uniform (default), or error: the mla-latent-dim budget split by each layer's measured residual",
    ),
    (
        "--served-model-name",
        str,
        "the model name clients send (default: the model folder's name, or mlaserve)",
    ),
]
_ENGINE_FLAGS = [
    ("--tensor-parallel-size", int, "ranks (GPUs) the model is split over (default 1)"),
    (
        "--enable-expert-parallel",
        bool,
        "MoE experts split whole across the ranks instead of each expert split",
    ),
    ("--pipeline-parallel-size", int, "accepted for vLLM compatibility: only 1"),
    ("--distributed-executor-backend", str, "mp: one process per rank, even at size 1; uni: one process"),
    ("--max-num-seqs", int, "requests stepped together (default 256)"),
    ("--block-size", int, "KV block size in tokens (default 16)"),
    ("--kv-cache-dtype", str, "auto, fp8_e4m3, int8 (MLA latent caches)"),
    ("--kv-cache-memory-bytes", int, "KV cache budget (CPU default 1 GiB)"),
    ("--num-kv-blocks", int, "exact KV block count (overrides the budget)"),
    (
        "--gpu-memory-utilization",
        float,
        "share of GPU memory the engine may use, KV cache included (default 0.9)",
    ),
    ("--max-num-batched-tokens", int, "tokens per step, prompt chunks included (default: 8192)"),
    ("--enable-chunked-prefill", bool, "split long prompts across steps (default on)"),
    ("--prefill-first", bool, "while prompts wait, steps run prompt chunks only (default off)"),
    ("--sliding-window", int, "lossy, training-free: full-attention layers see only the last N tokens"),
    ("--num-sink-tokens", int, "with --sliding-window: the first N tokens stay visible (attention sinks)"),
    (
        "--compress-ratio",
        int,
        "with --sliding-window: tokens before the window are seen as one mean-pooled entry per N, kept in a "
        "cache group of their own (lossy)",
    ),
    (
        "--index-topk",
        int,
        "lossy, training-free: each query reads its N best cache blocks + first/local blocks",
    ),
    ("--enable-prefix-caching", bool, "reuse the KV of shared prompt prefixes (default on)"),
    (
        "--speculative-config",
        json_object,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (greedy requests)',
    ),
]
_SERVER_FLAGS = [
    ("--host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", int, "default 8000; 0 picks a free port"),
    ("--metrics-port", int, "also serve /health and /metrics on this port"),
    ("--api-keys-env", str, "environment variable holding comma-separated API keys"),
    ("--api-keys-file", str, "file with one API key per line"),
    ("--max-concurrent-requests", int, "past this many sequences in flight, server-wide: 429 (default 64)"),
    ("--request-timeout-s", float, "abort a request running longer (default 600)"),
    ("--shutdown-grace-s", float, "on SIGTERM, time running requests get to finish (default 30)"),
    ("--max-body-bytes", int, "larger request bodies get 413 (default 4 MiB)"),
    ("--header-timeout-s", float, "time to send the request line and headers (default 10)"),
    ("--body-timeout-s", float, "time to send the whole body (default 30)"),
    ("--keep-alive-timeout-s", float, "idle keep-alive connections close after this (default 5)"),
    ("--max-connections", int, "open connections past this, server-wide, get a 503 (default 1024)"),
    ("--grammar-max-choices", int, "longer choice lists get 400 (default 10000)"),
    ("--grammar-max-choice-bytes", int, "choice lists holding more bytes get 400 (default 256 KiB)"),
    ("--grammar-max-bytes", int, "larger schemas, regexes and grammars get 400 (default 256 KiB)"),
    ("--grammar-compile-timeout-s", float, "constraints compiling longer get 400 (default 5)"),
    ("--api-server-count", int, "HTTP processes in front of the engine core (default 1; vLLM's flag)"),
    (
        "--tool-call-parser",
        str,
        "how tool calls are read from replies: deepseek_v3/v31/v32/v4, hermes, llama3_json",
    ),
    (
        "--enable-auto-tool-choice",
        bool,
        "serve tool_choice 'auto' (the parser: --tool-call-parser or the model's)",
    ),
    ("--reasoning-parser", str, "split <think> reasoning into reasoning_content: deepseek_r1"),
]
_METAVARS = {"--api-keys-env": "NAME", "--api-keys-file": "PATH", "--speculative-config": "JSON"}
_METAVARS |= {"--tool-call-parser": "NAME", "--reasoning-parser": "NAME"}
_ENGINE_OPTIONS = (
    "model",
    "load_format",
    "quantization",
    "enable_mla",
    "mla_latent_dim",
    "qk_rope_head_dim",
    "mla_skip_layers",
    "mla_rank_allocation",
    "dtype",
    "device",
    "max_model_len",
    "max_num_seqs",
    "block_size",
    "kv_cache_dtype",
)
_ENGINE_OPTIONS += ("kv_cache_memory_bytes", "num_kv_blocks", "max_num_batched_tokens")
_ENGINE_OPTIONS += ("enable_chunked_prefill", "prefill_first", "enable_prefix_caching")
_ENGINE_OPTIONS += ("gpu_memory_utilization", "tensor_parallel_size", "enable_expert_parallel")
_ENGINE_OPTIONS += ("pipeline_parallel_size", "distributed_executor_backend")
_ENGINE_OPTIONS += ("sliding_window", "num_sink_tokens", "compress_ratio", "index_topk", "speculative_config")
_SETTINGS = ("host", "port", "metrics_port", "served_model_name", "max_concurrent_requests")
_SETTINGS += ("request_timeout_s", "shutdown_grace_s", "max_body_bytes")
_SETTINGS += ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "max_connections")
_SETTINGS += ("grammar_max_choices", "grammar_max_choice_bytes", "grammar_max_bytes")
_SETTINGS += ("grammar_compile_timeout_s",)
_SETTINGS += ("api_server_count", "tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="deployment YAML file; flags override its values")
    for title, flags in (("model", _MODEL_FLAGS), ("engine", _ENGINE_FLAGS), ("server", _SERVER_FLAGS)):
        group = parser.add_argument_group(title)
        for flag, kind, text in flags:
            if kind is bool:  # --flag / --no-flag, as vLLM spells them; None when neither is given
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
                continue
            metavar = _METAVARS.get(flag)
            group.add_argument(flag, type=kind, default=None, help=text, metavar=metavar)


def api_keys_from_env(name: str) -> tuple[str, ...]:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"--api-keys-env {name}: the environment variable {name} is not set")
    keys = tuple(k.strip() for k in value.split(",") if k.strip())
    if not keys:
        raise ValueError(f"--api-keys-env {name}: the environment variable {name} holds no key")
    return keys


def api_keys_from_file(path: str) -> tuple[str, ...]:
    """One key per line; blank lines and '#' comments are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            keys = tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
    if not keys:
        raise ValueError(f"--api-keys-file {path}: the file holds no key")
    return keys


def settings_and_options_from_args(args: argparse.Namespace) -> tuple[ServerSettings, dict]:
    """ServerSettings and LLMEngine options from the flags alone (the no-YAML case)."""
    options = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
    fields = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name, None) is not None}
    checks = [
        ("port", lambda v: 0 <= v <= 65535, "in 0..65535"),
        ("metrics_port", lambda v: 0 <= v <= 65535, "in 0..65535"),
        ("max_concurrent_requests", lambda v: v >= 1, ">= 1"),
        ("max_body_bytes", lambda v: v >= 1, ">= 1"),
        ("request_timeout_s", lambda v: v > 0, "> 0"),
        ("shutdown_grace_s", lambda v: v > 0, "> 0"),
        ("header_timeout_s", lambda v: v > 0, "> 0"),
        ("body_timeout_s", lambda v: v > 0, "> 0"),
        ("keep_alive_timeout_s", lambda v: v > 0, "> 0"),
        ("max_connections", lambda v: v >= 1, ">= 1"),
        ("grammar_max_choices", lambda v: v >= 1, ">= 1"),
        ("grammar_max_choice_bytes", lambda v: v >= 1, ">= 1"),
        ("grammar_max_bytes", lambda v: v >= 1, ">= 1"),
        ("grammar_compile_timeout_s", lambda v: v > 0, "> 0"),
        ("api_server_count", lambda v: 1 <= v <= 64, "in 1..64"),
        ("tool_call_parser", lambda v: v in TOOL_PARSERS, f"one of {', '.join(TOOL_PARSERS)}"),
        ("reasoning_parser", lambda v: v in REASONING_PARSERS, f"one of {', '.join(REASONING_PARSERS)}"),
    ]
    for name, ok, allowed in checks:
        if name in fields and not ok(fields[name]):
            raise ValueError(f"--{name.replace('_', '-')} must be {allowed}, got {fields[name]}")
    keys: tuple[str, ...] = ()
    if getattr(args, "api_keys_env", None):
        keys += api_keys_from_env(args.api_keys_env)
    if getattr(args, "api_keys_file", None):
        keys += api_keys_from_file(args.api_keys_file)
    if keys:
        fields["api_keys"] = keys
    return ServerSettings(**fields), options
