"""Deploy config: every bad value names its key; overrides win; secrets only from env or file; examples load."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from mlaserve.config.deploy import DeployConfig, DeployConfigError, load_deploy_config
from mlaserve.config.deploy_overrides import FLAG_KEYS, overrides_from_flags
from mlaserve.config.engine_config import CacheOptions, EngineConfig, SchedulerOptions
from mlaserve.config.server_settings import ServerSettings

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str, overrides: dict | None = None, **checks: bool) -> DeployConfig:
    checks.setdefault("check_model_files", False)
    checks.setdefault("check_ports", False)
    return load_deploy_config(str(write(tmp_path, text)), overrides, **checks)


def error(tmp_path: Path, text: str, overrides: dict | None = None, **checks: bool) -> DeployConfigError:
    with pytest.raises(DeployConfigError) as info:
        load(tmp_path, text, overrides, **checks)
    return info.value


def keys(err: DeployConfigError) -> list[str]:
    return [key for key, _ in err.problems]


def hf_folder(tmp_path: Path, heads: int, **config: object) -> Path:
    """Just enough of an HF folder for resolve_model: config.json and a (never read) safetensors file."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "num_attention_heads": heads, **config}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("config_file", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLASERVE_API_KEYS", "example-key-1,example-key-2")
    raw_path = load_deploy_config(str(config_file), check_model_files=False, check_ports=False).model.path
    # the model check runs wherever the model exists here (the SmolLM2 default does; the DeepSeek folder not)
    check_model = raw_path is None or Path(raw_path).exists()
    config = load_deploy_config(str(config_file), check_model_files=check_model, check_ports=False)
    EngineConfig.from_kwargs(**config.engine_options())
    assert isinstance(config.server_settings(), ServerSettings)


def test_empty_file_and_no_file_give_engine_defaults(tmp_path: Path) -> None:
    from_file = load(tmp_path, "# nothing but a comment\ncache:\n")
    assert from_file == load_deploy_config(None, check_model_files=False, check_ports=False)
    options = from_file.engine_options()
    assert "model" not in options and "max_model_len" not in options  # None values are left out
    engine = from_file.engine_config()
    assert engine == EngineConfig()
    assert (engine.cache.block_size, engine.scheduler.max_num_seqs) == (
        CacheOptions.block_size,
        SchedulerOptions.max_num_seqs,
    )
    assert from_file.server_settings() == ServerSettings()


def test_engine_options_are_accepted_by_engine_config(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
model: {path: /m/DeepSeek-V2-Lite, dtype: bfloat16, max_model_len: 4096, device: "cuda:1"}
cache: {block_size: 64, gpu_memory_utilization: 0.8, enable_prefix_caching: false, kv_cache_memory_bytes: 512MiB,
        sliding_window: 1024, num_sink_tokens: 4}
scheduler: {max_batch_size: 8, max_num_batched_tokens: 1024, enable_chunked_prefill: true, async_scheduling: false}
""",
    )
    options = config.engine_options()
    assert options["max_num_seqs"] == 8 and options["kv_cache_memory_bytes"] == 512 * 2**20
    engine = config.engine_config()
    assert engine == EngineConfig.from_kwargs(**options)
    assert (engine.model.path, engine.model.device, engine.cache.block_size) == (
        "/m/DeepSeek-V2-Lite",
        "cuda:1",
        64,
    )
    assert engine.scheduler.async_scheduling is False and engine.scheduler.max_num_seqs == 8
    assert (engine.cache.sliding_window, engine.cache.num_sink_tokens) == (1024, 4)
    other = load(tmp_path, "model: {enable_mla: true}\ncache: {index_topk: 8}").engine_options()
    assert EngineConfig.from_kwargs(**other).mla.enable_mla and other["index_topk"] == 8
    assert (
        "async_scheduling" not in load(tmp_path, "scheduler: {}").engine_options()
    )  # null: the engine decides
    assert config.server_settings().served_model_name == "DeepSeek-V2-Lite"


@pytest.mark.parametrize(
    "text, key, allowed",
    [
        ("cache: {blocksize: 16}", "cache.blocksize", "block_size"),
        ("caches: {}", "caches", "scheduler"),
        ("server: {port: '8000'}", "server.port", "integer"),
        ("cache: {enable_prefix_caching: 1}", "cache.enable_prefix_caching", "boolean"),
        ("scheduler: {async_scheduling: 'yes'}", "scheduler.async_scheduling", "boolean"),
        ("model: 5", "model", "mapping"),
        ("cache: {block_size: 24}", "cache.block_size", "power of two"),
        ("cache: {block_size: 0}", "cache.block_size", "greater than 0"),
        ("cache: {gpu_memory_utilization: 0}", "cache.gpu_memory_utilization", "(0, 1]"),
        ("cache: {gpu_memory_utilization: 1.5}", "cache.gpu_memory_utilization", "(0, 1]"),
        ("cache: {strategy: contiguous}", "cache.strategy", "'paged'"),
        ("cache: {kv_cache_dtype: fp8}", "cache.kv_cache_dtype", "fp8_e4m3"),
        ("cache: {kv_cache_memory_bytes: lots}", "cache.kv_cache_memory_bytes", "'4GiB'"),
        ("model: {dtype: fp64}", "model.dtype", "'bfloat16'"),
        ("model: {device: tpu}", "model.device", "'cuda:N'"),
        ("model: {max_model_len: -1}", "model.max_model_len", "greater than 0"),
        ("parallel: {pipeline_parallel_size: 2}", "parallel.pipeline_parallel_size", "not supported yet"),
        ("server: {port: 70000}", "server.port", "65535"),
        ("server: {port: 8000, metrics_port: 8000}", "server.metrics_port", "differ"),
        ("server: {request_timeout_s: 0}", "server.request_timeout_s", "greater than 0"),
        ("scheduler: {max_batch_size: 0}", "scheduler.max_batch_size", "greater than 0"),
        ("cache: {num_sink_tokens: -1}", "cache.num_sink_tokens", "greater than or equal to 0"),
        ("cache: {num_sink_tokens: 4}", "cache.num_sink_tokens", "unless cache.sliding_window is set"),
        ("cache: {compress_ratio: 4}", "cache.compress_ratio", "unless cache.sliding_window is set"),
        ("cache: {sliding_window: 0}", "cache.sliding_window", "greater than 0"),
        ("cache: {index_topk: 0}", "cache.index_topk", "greater than 0"),
        ("cache: {index_topk: 8, sliding_window: 64}", "cache.index_topk", "cannot be combined"),
        (
            "model: {max_model_len: 4096}\nscheduler: {enable_chunked_prefill: false, max_num_batched_tokens: 1024}",
            "scheduler.max_num_batched_tokens",
            ">= model.max_model_len",
        ),
    ],
)
def test_bad_value_names_key_and_what_is_allowed(tmp_path: Path, text: str, key: str, allowed: str) -> None:
    err = error(tmp_path, text)
    assert keys(err) == [key]
    assert f"{key}: " in str(err) and allowed in str(err)


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    err = error(tmp_path, "cache: {block_size: 3, strategy: flat}\nserver: {port: x}\nfoo: 1")
    assert sorted(keys(err)) == ["cache.block_size", "cache.strategy", "foo", "server.port"]


def test_unreadable_files_are_deploy_errors(tmp_path: Path) -> None:
    with pytest.raises(DeployConfigError, match="does not exist"):
        load_deploy_config(str(tmp_path / "missing.yaml"))
    assert "duplicate key 'block_size'" in str(
        error(tmp_path, "cache:\n  block_size: 16\n  block_size: 32\n")
    )
    assert "not valid YAML at line 3" in str(error(tmp_path, "cache:\n  - [unclosed\n"))
    assert "must be a mapping with sections model" in str(error(tmp_path, "- a list\n"))


def test_tensor_parallel_must_divide_heads(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, heads=4)

    def text(tp: int, extra: str = "") -> str:  # built per size: the tmp path itself may contain digits
        return f"model: {{path: {folder}}}\nparallel: {{tensor_parallel_size: {tp}{extra}}}"

    err = error(tmp_path, text(3), check_model_files=True)
    assert keys(err) == ["parallel.tensor_parallel_size"]
    assert "num_attention_heads (4)" in str(err) and "sizes that do: 1, 2, 4" in str(err)
    config = load(tmp_path, text(2, ", distributed_executor_backend: mp"), check_model_files=True)
    options = config.engine_options()
    assert options["tensor_parallel_size"] == 2 and options["distributed_executor_backend"] == "mp"
    err = error(tmp_path, text(2, ", enable_expert_parallel: true"), check_model_files=True)
    assert "no routed experts" in str(err)  # a dense model
    err = error(tmp_path, "parallel: {pipeline_parallel_size: 2}")
    assert keys(err) == ["parallel.pipeline_parallel_size"] and "not supported" in str(err)


def test_mxfp4_experts_split_by_width_must_keep_scale_groups_whole(tmp_path: Path) -> None:
    quant = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    v4 = dict(n_routed_experts=8, moe_intermediate_size=96, quantization_config=quant, expert_dtype="fp4")
    folder = hf_folder(tmp_path, heads=4, **v4)
    err = error(
        tmp_path, f"model: {{path: {folder}}}\nparallel: {{tensor_parallel_size: 2}}", check_model_files=True
    )
    assert keys(err) == ["parallel.tensor_parallel_size"]
    assert "moe_intermediate_size (96) split over 2 ranks gives 48 columns" in str(err)
    assert "32-column e8m0 scale groups" in str(err)


def test_max_model_len_beyond_the_model_names_the_key(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path, heads=4, max_position_embeddings=2048)
    err = error(tmp_path, f"model: {{path: {folder}, max_model_len: 4096}}", check_model_files=True)
    assert keys(err) == ["model.max_model_len"] and "max_position_embeddings (2048)" in str(err)
    assert load(tmp_path, f"model: {{path: {folder}, max_model_len: 2048}}", check_model_files=True)


def test_missing_model_path_names_model_path(tmp_path: Path) -> None:
    err = error(tmp_path, f"model: {{path: {tmp_path / 'nope'}}}", check_model_files=True)
    assert keys(err) == ["model.path"] and "does not exist" in str(err)


def test_port_in_use_names_the_port_key(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        err = error(tmp_path, f"server: {{host: 127.0.0.1, port: {busy}}}", check_ports=True)
        assert keys(err) == ["server.port"] and "already in use" in str(err)
        err = error(tmp_path, f"server: {{host: 127.0.0.1, port: 0, metrics_port: {busy}}}", check_ports=True)
        assert keys(err) == ["server.metrics_port"]
    free = load(tmp_path, f"server: {{host: 127.0.0.1, port: {busy}}}", check_ports=True)
    assert free.server.port == busy


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    text = "server: {port: 8000, host: 127.0.0.1}\ncache: {block_size: 16}"
    config = load(tmp_path, text, {"server.port": 9001, "cache.block_size": 32, "model.max_model_len": None})
    assert (config.server.port, config.cache.block_size, config.server.host) == (9001, 32, "127.0.0.1")
    assert config.model.max_model_len is None  # a None override (flag not given) leaves the file's value
    assert load(tmp_path, "", {"scheduler.max_batch_size": 4}).scheduler.max_batch_size == 4
    err = error(tmp_path, text, {"server.port": "x"})
    assert keys(err) == ["server.port"] and "command-line override" in str(err)
    err = error(tmp_path, text, {"port": 9000})
    assert keys(err) == ["port"] and "section.key" in str(err)


def test_overrides_from_flags_map_flag_names_and_skip_unset() -> None:
    flags = {"port": 9000, "model": None, "max_num_seqs": 4, "verbose": True, "command": "serve"}
    assert overrides_from_flags(flags) == {"server.port": 9000, "scheduler.max_batch_size": 4}
    sections = set(DeployConfig.model_fields)
    for dotted in FLAG_KEYS.values():  # every mapped key exists in the schema
        section, key = dotted.split(".")
        assert section in sections and key in DeployConfig.model_fields[section].annotation.model_fields


def test_api_keys_in_yaml_are_rejected(tmp_path: Path) -> None:
    err = error(tmp_path, "server: {api_keys: [sk-secret]}")
    assert keys(err) == ["server.api_keys"]
    assert "api_keys_env" in str(err) and "api_keys_file" in str(err) and "sk-secret" not in str(err)


def test_api_keys_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_MLASERVE_KEYS", " key-a, key-b ,,")
    config = load(tmp_path, "server: {api_keys_env: TEST_MLASERVE_KEYS}")
    assert config.server_settings().api_keys == ("key-a", "key-b")
    assert "key-a" not in repr(config) and "key-a" not in str(config.model_dump())
    monkeypatch.setenv("TEST_MLASERVE_KEYS", " , ")
    err = error(tmp_path, "server: {api_keys_env: TEST_MLASERVE_KEYS}")
    assert keys(err) == ["server.api_keys_env"] and "empty" in str(err)
    monkeypatch.delenv("TEST_MLASERVE_KEYS")
    err = error(tmp_path, "server: {api_keys_env: TEST_MLASERVE_KEYS}")
    assert keys(err) == ["server.api_keys_env"] and "not set" in str(err)


def test_api_keys_from_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# ops team\nkey-one\n\n  key-two  # rotated 2026-11\n")
    config = load(tmp_path, f"server: {{api_keys_file: {key_file}}}")
    assert config.server_settings().api_keys == ("key-one", "key-two")
    key_file.write_text("# no keys yet\n\n")
    err = error(tmp_path, f"server: {{api_keys_file: {key_file}}}")
    assert keys(err) == ["server.api_keys_file"] and "holds no keys" in str(err)
    err = error(tmp_path, f"server: {{api_keys_file: {tmp_path / 'absent'}}}")
    assert keys(err) == ["server.api_keys_file"] and "does not exist" in str(err)
    err = error(tmp_path, f"server: {{api_keys_file: {key_file}, api_keys_env: X}}")
    assert keys(err) == ["server.api_keys_file"] and "not both" in str(err)


def test_served_model_name_defaults(tmp_path: Path) -> None:
    assert (
        load(tmp_path, "model: {path: /models/qwen2-7b/}").server_settings().served_model_name == "qwen2-7b"
    )
    assert load(tmp_path, "").server_settings().served_model_name == "mlaserve"
    named = load(tmp_path, "model: {path: /m/x.gguf, served_model_name: prod-chat}")
    assert named.server_settings().served_model_name == "prod-chat"


def test_asynchronous_scheduling_defaults_off_when_speculation_is_asked_for():
    """Drafts are checked before the next step is queued: the CUDA default gives way to speculation, an explicit
    setting does not (speculation then turns itself off, engine/speculation.py)."""
    assert SchedulerOptions().async_on("cuda") and not SchedulerOptions().async_on("cpu")
    assert not SchedulerOptions().async_on("cuda", speculative=True)
    assert SchedulerOptions(async_scheduling=True).async_on("cuda", speculative=True)
    assert not SchedulerOptions(async_scheduling=False).async_on("cuda")
