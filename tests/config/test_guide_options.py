"""Every name of docs/guide-options.md on a tiny model: each does what the table says (in the engine's options,
stats(), the log or an error), and a misspelled name is still an error."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from mlaserve import LLM, EngineArgs, LLMEngine, ParallelConfig, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("llama")))  # 4 query heads, 2 KV heads of 16


def test_engine_args_and_from_engine_args_build_an_engine_that_generates(llama):
    args = EngineArgs(model=llama, **OPTIONS)
    engine = LLMEngine.from_engine_args(args)
    rid = engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [rid] and len(finished[0].outputs[0].token_ids) == 3
    with pytest.raises(TypeError, match="unknown engine option.*enable_mla_quantt"):
        EngineArgs(model=llama, enable_mla_quantt=True)  # misspelled: fails when the args are built


def test_trust_remote_code_and_tensor_cores_are_accepted_and_logged(llama, caplog):
    with caplog.at_level(logging.INFO, logger="mlaserve.config.guide_options"):
        llm = LLM(llama, **OPTIONS, trust_remote_code=True, enable_mla_tensor_core=True)
    assert "never runs code shipped with a checkpoint" in caplog.text
    assert "always run on tensor cores" in caplog.text
    assert llm.engine.config.model.trust_remote_code


def test_enable_mla_latent_dim_and_quant_reach_the_cache(llama):
    exact = LLM(llama, **OPTIONS, enable_mla=True).stats()
    assert exact["mha_kv_bytes_per_token"] == exact["kv_bytes_per_token"]  # exact: a latent of the same size
    reduced = LLM(llama, **OPTIONS, enable_mla=True, mla_latent_dim=12).stats()
    assert reduced["kv_bytes_per_token"] < exact["kv_bytes_per_token"]
    skipped = LLM(llama, **OPTIONS, enable_mla=True, mla_latent_dim=12, mla_skip_layers=[1]).stats()
    # layer 0: a latent of 12 + 2 KV heads x 16 rotary features; layer 1 keeps 2 x (16 + 16) per-head K/V
    assert skipped["kv_bytes_per_token"] == ((12 + 2 * 16) + 2 * 32) * 4
    quant = LLM(llama, **OPTIONS, enable_mla=True, enable_mla_quant=True).stats()
    assert quant["kv_cache_dtype"] == "float8_e4m3fn"
    plain = LLM(llama, **OPTIONS, enable_mla=True, disable_mla_quant=True).stats()
    assert plain["kv_cache_dtype"] == "float32"
    with pytest.raises(ValueError, match="both set"):
        LLM(llama, **OPTIONS, enable_mla=True, enable_mla_quant=True, disable_mla_quant=True)


def test_window_chunking_graphs_and_head_count(llama):
    windowed = LLM(llama, **OPTIONS, mla_window_size=32).engine
    assert windowed.config.cache.sliding_window == 32
    assert any("window" in g for g in windowed.stats()["kv_cache_groups"])
    assert LLM(llama, **OPTIONS, mla_window_size=0).engine.config.cache.sliding_window is None
    config = LLM(
        llama, **OPTIONS, enable_chunked_mla=False, chunk_size=512, capture_mla_graph=False
    ).engine.config
    scheduler = config.scheduler
    assert (
        scheduler.enable_chunked_prefill,
        scheduler.max_num_batched_tokens,
        config.model.enforce_eager,
    ) == (
        False,
        512,
        True,
    )
    with pytest.raises(ValueError, match="chunk_size sets max_num_batched_tokens=512"):
        LLM(llama, **OPTIONS, chunk_size=512, max_num_batched_tokens=1024)
    assert LLM(llama, **OPTIONS, mla_num_heads=4).engine.config.mla.mla_num_heads == 4
    with pytest.raises(ValueError, match="mla_num_heads=8, but LlamaForCausalLM has 4 attention heads"):
        LLM(llama, **OPTIONS, mla_num_heads=8)


def test_capture_mla_graph_needs_a_gpu(llama):
    engine = LLM(llama, **OPTIONS).engine
    with pytest.raises(RuntimeError, match="CUDA graphs need a GPU; this engine runs on cpu"):
        engine.capture_mla_graph(max_seq_len=128)
    with pytest.raises(ValueError, match="max_seq_len must be in 1..max_model_len"):
        engine.capture_mla_graph(max_seq_len=1024)


def test_kv_cache_ratio_is_a_share_of_the_devices_memory(llama):
    options = {k: v for k, v in OPTIONS.items() if k != "num_kv_blocks"}
    engine = LLM(llama, **options, mla_kv_cache_ratio=0.001).engine
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert engine.config.cache.kv_cache_memory_bytes == int(0.001 * ram)
    stats = engine.stats()
    held = stats["kv_capacity_tokens"] * stats["kv_bytes_per_token"]
    assert 0.9 * 0.001 * ram <= held <= 0.001 * ram
    with pytest.raises(ValueError, match="mla_kv_cache_ratio must be in"):
        LLM(llama, **options, mla_kv_cache_ratio=1.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(mla_latent_dim_fn=lambda n: 8), "rank chosen by context length is not built"),
        (dict(mla_ascend_mode=True), "no Ascend backend"),
        (dict(parallel_config=ParallelConfig(tensor_parallel_size=3)), "cannot be split over 3 ranks"),
    ],
)
def test_what_is_not_built_is_a_clear_error(llama, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama, **OPTIONS, **options)


def test_parallel_config():
    assert ParallelConfig(tensor_parallel_size=1, mla_parallel_mode="expert").mla_parallel_mode == "expert"
    with pytest.raises(ValueError, match="pipeline parallelism is not built"):
        ParallelConfig(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="mla_parallel_mode must be 'tensor' or 'expert'"):
        ParallelConfig(mla_parallel_mode="data")


def test_serve_takes_enable_mla():
    from mlaserve.config.deploy import load_deploy_config
    from mlaserve.config.deploy_overrides import overrides_from_flags
    from mlaserve.server.cli_args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--enable-mla", "--port", "0"])
    assert load_deploy_config(None, overrides_from_flags(vars(args))).engine_options()["enable_mla"] is True
