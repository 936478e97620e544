"""A quantized checkpoint whose method the engine does not serve is refused by name, before any weight is read.

Each checkpoint is a tiny transformers Llama whose config.json then gains a quantization_config, and whose
safetensors file is overwritten with bytes no reader accepts: a start-up that read a weight would fail with the
reader's error, not the one naming the method.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlaserve import LLM
from mlaserve.config.deploy import DeployConfigError, load_deploy_config
from mlaserve.config.quantization import BlockFP8Config, check_quantization, quant_config, quant_method
from mlaserve.executor import load_model as model_loader
from mlaserve.testing.tiny_models import build_tiny

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)

# (id, quantization_config, the method the message must name)
SECTIONS = [
    (
        "awq",
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        "'awq'",
    ),
    (
        "gptq",
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
        "'gptq'",
    ),
    ("unknown-method", {"quant_method": "hqq-next", "bits": 3}, "'hqq-next'"),
    ("missing-method", {"bits": 4, "group_size": 64}, "unknown"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("quant_source"))


def quantized_copy(source: Path, folder: Path, section: dict, with_weights: bool = True) -> Path:
    """The tiny checkpoint's config and tokenizer with `section` as its quantization_config; its weight file
    (when kept) holds bytes that fail any safetensors read."""
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = section
    (folder / "config.json").write_text(json.dumps(config))
    if with_weights:
        (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    return folder


@pytest.fixture()
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a checkpoint tensor, or building the model at all, fails the test outright."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built or its weights read for a checkpoint that is not served")

    monkeypatch.setattr(model_loader, "checkpoint_tensors", forbidden)
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", forbidden)


@pytest.mark.parametrize("name,section,named", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_unserved_method_fails_before_weights_are_read(
    tiny_llama: Path, tmp_path: Path, no_weight_reads: None, name: str, section: dict, named: str
) -> None:
    folder = quantized_copy(tiny_llama, tmp_path / name, section)
    with pytest.raises(ValueError) as info:
        LLM(str(folder), **OPTIONS)
    message = str(info.value)
    assert f"quantization_config.quant_method {named}" in message, message
    assert "is not served; served methods: 'fp8' (and unquantized bf16/fp16/fp32 checkpoints)" in message


@pytest.mark.parametrize("name,section,named", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_dummy_weights_are_refused_the_same_way(
    tiny_llama: Path, tmp_path: Path, no_weight_reads: None, name: str, section: dict, named: str
) -> None:
    folder = quantized_copy(tiny_llama, tmp_path / name, section, with_weights=False)
    with pytest.raises(ValueError, match=f"quant_method {named}.*is not served"):
        LLM(str(folder), load_format="dummy", **OPTIONS)


def test_the_message_names_the_method_and_the_served_ones() -> None:
    with pytest.raises(ValueError) as info:
        check_quantization({"quantization_config": {"quant_method": "awq"}})
    assert str(info.value) == (
        "model config quantization_config.quant_method 'awq' is not served; "
        "served methods: 'fp8' (and unquantized bf16/fp16/fp32 checkpoints)"
    )


@pytest.mark.parametrize("config", [{}, {"quantization_config": None}], ids=["absent", "null"])
def test_unquantized_configs_pass(config: dict) -> None:
    assert quant_method(config) is None
    check_quantization(config)


@pytest.mark.parametrize("section", [{}, "awq", {"quant_method": ""}, {"quant_method": 4}])
def test_a_section_without_a_method_name_is_unknown(section: object) -> None:
    assert quant_method({"quantization_config": section}) == "unknown"
    with pytest.raises(ValueError, match="unknown"):
        check_quantization({"quantization_config": section})


DEEPSEEK_V3_SECTION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def test_deepseek_block_fp8_is_served_as_published() -> None:
    assert quant_config({"quantization_config": DEEPSEEK_V3_SECTION}) == BlockFP8Config(128, 128, True, False)
    v31 = {**DEEPSEEK_V3_SECTION, "scale_fmt": "ue8m0"}
    assert quant_config({"quantization_config": v31}).pow2_scales
    # quantization="fp8" on a checkpoint published in FP8 reads it as it is
    assert quant_config({"quantization_config": DEEPSEEK_V3_SECTION}, "fp8").from_checkpoint


def test_online_fp8_applies_to_unquantized_checkpoints_only() -> None:
    assert quant_config({}, "fp8") == BlockFP8Config(from_checkpoint=False)
    assert quant_config({}) is None
    with pytest.raises(ValueError, match=r"quantization='int4' is not served; use one of \['fp8'\] or None"):
        quant_config({}, "int4")


@pytest.mark.parametrize(
    "change, key",
    [
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"weight_block_size": None}, "weight_block_size=None"),
        ({"weight_block_size": [128, 64]}, "weight_block_size=[128, 64]"),
        ({"weight_block_size": [128]}, "weight_block_size=[128]"),
        ({"weight_block_size": [0, 128]}, "weight_block_size=[0, 128]"),
        ({"scale_fmt": "e8m0fnu"}, "scale_fmt='e8m0fnu'"),
    ],
)
def test_fp8_settings_the_kernels_cannot_run_are_refused_by_key(change: dict, key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"quantization_config.{key} is not served")):
        check_quantization({"quantization_config": {**DEEPSEEK_V3_SECTION, **change}})


def test_a_deploy_config_names_the_model_path(tiny_llama: Path, tmp_path: Path) -> None:
    folder = quantized_copy(tiny_llama, tmp_path / "awq", SECTIONS[0][1])
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"model: {{path: {folder}}}\n")
    with pytest.raises(DeployConfigError) as info:
        load_deploy_config(str(deploy), check_model_files=True, check_ports=False)
    assert [key for key, _ in info.value.problems] == ["model.path"]
    assert "quant_method 'awq' is not served" in str(info.value)


@pytest.mark.slow
def test_the_engine_core_process_reports_it_to_its_parent(tiny_llama: Path, tmp_path: Path) -> None:
    """The server's core runs in a child process: its start-up failure reaches the parent as the same error."""
    from mlaserve.engine.core_client import CoreProcessClient

    folder = quantized_copy(tiny_llama, tmp_path / "gptq", SECTIONS[1][1])
    with pytest.raises(ValueError, match="the engine could not start: .*quant_method 'gptq' is not served"):
        CoreProcessClient({"model": str(folder), **OPTIONS}, start_timeout_s=120)


@pytest.mark.slow
def test_serve_exits_with_the_message(tiny_llama: Path, tmp_path: Path) -> None:
    folder = quantized_copy(tiny_llama, tmp_path / "awq", SECTIONS[0][1])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "mlaserve.cli", "serve", "--model", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert "quant_method 'awq' is not served; served methods: 'fp8'" in done.stderr
    assert "Traceback" not in done.stderr


V4_SECTION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}


@pytest.mark.parametrize(
    "config, want",
    [
        ({"quantization_config": V4_SECTION}, "fp8"),
        ({"quantization_config": V4_SECTION, "expert_dtype": "fp4"}, "fp4"),  # V4-Flash: at the top level
        ({"quantization_config": {**V4_SECTION, "expert_dtype": "fp4"}}, "fp4"),  # inside the section
        ({"quantization_config": {**V4_SECTION, "expert_dtype": "fp8"}, "expert_dtype": "fp4"}, "fp8"),
    ],
    ids=["default", "top-level", "in-section", "section-wins"],
)
def test_deepseek_v4_expert_dtype(config, want):
    quant = quant_config(config)
    assert quant == BlockFP8Config(128, 128, True, True, want)


def test_expert_dtype_names_its_key():
    with pytest.raises(ValueError, match=r"quantization_config.expert_dtype='int4' is not served"):
        quant_config({"quantization_config": {**V4_SECTION, "expert_dtype": "int4"}})
    with pytest.raises(ValueError, match=r"model config expert_dtype='mxfp8' is not served"):
        quant_config({"quantization_config": V4_SECTION, "expert_dtype": "mxfp8"})
    with pytest.raises(ValueError, match=r"expert_dtype='fp4' without a quantization_config"):
        quant_config({"expert_dtype": "fp4"})
