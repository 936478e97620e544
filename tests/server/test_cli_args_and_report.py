"""`mlaserve serve` flags -> ServerSettings + engine options; the start-up report (MLA saving included)."""

from __future__ import annotations

import argparse

import pytest

from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.llm_engine import LLMEngine
from mlaserve.server.auth import check_bearer
from mlaserve.server.cli_args import add_serve_args, settings_and_options_from_args
from mlaserve.server.report import format_report, startup_report
from mlaserve.testing.tiny_models import build_tiny, config_dict


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_flags_become_settings_and_engine_options(monkeypatch):
    monkeypatch.setenv("MY_KEYS", "k1, k2,")
    args = parse(
        "--model", "/m", "--dtype", "float32", "--device", "cpu", "--max-model-len", "512",
        "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "smol", "--api-keys-env", "MY_KEYS",
        "--max-concurrent-requests", "8", "--request-timeout-s", "30", "--shutdown-grace-s", "5",
        "--kv-cache-memory-bytes", "1000000", "--num-kv-blocks", "64", "--config", "deploy.yaml",
        "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    )  # fmt: skip
    settings, options = settings_and_options_from_args(args)
    assert settings == ServerSettings(
        host="0.0.0.0",
        port=9000,
        served_model_name="smol",
        api_keys=("k1", "k2"),
        max_concurrent_requests=8,
        request_timeout_s=30.0,
        shutdown_grace_s=5.0,
    )
    assert options == dict(
        model="/m",
        dtype="float32",
        device="cpu",
        max_model_len=512,
        kv_cache_memory_bytes=1000000,
        num_kv_blocks=64,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
    )
    assert args.config == "deploy.yaml"  # passed through for the YAML loader
    EngineConfig.from_kwargs(**options)  # every option is one the engine knows


def test_api_keys_file_and_body_limit(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# ops team\nsk-one\n\n  sk-two  \n")
    settings, _ = settings_and_options_from_args(
        parse("--api-keys-file", str(keys), "--max-body-bytes", "1024")
    )
    assert settings.api_keys == ("sk-one", "sk-two") and settings.max_body_bytes == 1024
    with pytest.raises(ValueError, match="--api-keys-file"):
        settings_and_options_from_args(parse("--api-keys-file", str(tmp_path / "missing.txt")))


def test_scheduler_flags_reach_the_deploy_config():
    from mlaserve.config.deploy import load_deploy_config
    from mlaserve.config.deploy_overrides import overrides_from_flags

    args = parse("--max-num-batched-tokens", "64", "--no-enable-prefix-caching", "--sliding-window", "256",
                 "--num-sink-tokens", "4", "--compress-ratio", "4")  # fmt: skip
    options = load_deploy_config(None, overrides_from_flags(vars(args))).engine_options()
    assert options["max_num_batched_tokens"] == 64 and options["enable_prefix_caching"] is False
    assert (options["sliding_window"], options["num_sink_tokens"], options["compress_ratio"]) == (256, 4, 4)
    assert options["enable_chunked_prefill"] is True
    args = parse("--index-topk", "8", "--enable-mla")
    options = load_deploy_config(None, overrides_from_flags(vars(args))).engine_options()
    assert (options["index_topk"], options["enable_mla"]) == (8, True)


def test_flag_names_are_the_ones_the_deploy_overrides_know():
    overrides = pytest.importorskip("mlaserve.config.deploy_overrides")
    flag_keys = {*overrides.FLAG_KEYS, *overrides.SECTION_FLAGS}

    given = {k for k in vars(parse()) if k not in ("config", "num_kv_blocks")}
    assert given <= flag_keys, given - flag_keys


def test_defaults_leave_everything_to_the_engine_and_settings():
    settings, options = settings_and_options_from_args(parse())
    assert settings == ServerSettings() and options == {}


@pytest.mark.parametrize(
    "argv,match",
    [
        (("--api-keys-env", "NOT_SET_ANYWHERE"), "NOT_SET_ANYWHERE"),
        (("--port", "70000"), "--port"),
        (("--max-concurrent-requests", "0"), "--max-concurrent-requests"),
        (("--request-timeout-s", "0"), "--request-timeout-s"),
    ],
)
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        settings_and_options_from_args(parse(*argv))


def test_bearer_check_is_exact():
    keys = ("alpha", "beta")
    assert check_bearer("Bearer beta", keys) and check_bearer("bearer alpha", keys)
    assert not check_bearer("Bearer alph", keys) and not check_bearer("alpha", keys)
    assert not check_bearer(None, keys) and not check_bearer("Bearer ", keys)
    assert check_bearer(None, ())


def test_startup_report_of_an_mla_model_shows_the_kv_saving(tmp_path):
    path = build_tiny("deepseek_v2", tmp_path / "ds2")
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(path), dtype="float32", device="cpu", num_kv_blocks=32)
    )
    report = startup_report(
        engine.core.build_info, engine.stats(), ServerSettings(port=8123, metrics_port=9123)
    )
    cfg = config_dict(path)
    kv = report["kv_cache"]
    assert (
        kv["bytes_per_token"]
        == cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    )
    assert kv["saving_ratio"] == round(kv["mha_bytes_per_token"] / kv["bytes_per_token"], 2) > 1
    assert report["weights"]["missing"] == [] and report["weights"]["num_tensors"] > 0
    assert report["parallel"]["tensor_parallel_size"] == 1
    lines = "\n".join(format_report(report))
    for needle in ("missing: none", "unexpected: none", "tensor parallel 1", "attention backend",
                   "per-head K/V", "http://127.0.0.1:8123", "http://127.0.0.1:9123"):  # fmt: skip
        assert needle in lines
    # both attention kernels the executor chose, as its own start-up line names them
    assert report["prefill_kernel"] == engine.stats()["prefill_kernel"] != ""
    assert f"prefill kernel: {report['prefill_kernel']}" in lines


def test_startup_report_of_a_pool_per_group_model_gives_each_pool_and_the_entry_capacity(tmp_path):
    """DeepSeek-V4: its window rows and each rate's entries in pools of their own; the capacity is what the entry
    pools hold (a block of a 1:r group spans block_size x r tokens), which no blocks x block_size product gives."""
    path = build_tiny("deepseek_v4", tmp_path / "v4")
    options = dict(
        model=str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22, max_model_len=512
    )
    engine = LLMEngine(EngineConfig.from_kwargs(**options))
    try:
        stats = engine.stats()
    finally:
        engine.close()
    report = startup_report(engine.core.build_info, stats, ServerSettings(port=8123))
    kv = report["kv_cache"]
    window, *entries = kv["pool_blocks"]
    assert len(entries) == 2 and sum(kv["pool_blocks"]) == kv["blocks"] == stats["kv_blocks_total"]
    rates = config_dict(path)["compress_rates"].values()
    assert kv["capacity_tokens"] == min(n * kv["block_size"] * r for n, r in zip(entries, sorted(rates)))
    assert kv["capacity_tokens"] != kv["blocks"] * kv["block_size"]
    lines = format_report(report)
    pools = ", ".join(str(n) for n in kv["pool_blocks"])
    assert (
        f"KV cache: pools of {pools} blocks x 16 slots (one per group) = {kv['capacity_tokens']} tokens"
        in lines[4]
    )
    assert lines[5].startswith("KV cache groups (a pool each): window")
