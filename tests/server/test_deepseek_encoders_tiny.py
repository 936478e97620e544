"""A tiny DeepSeek-V3.2 checkpoint, saved the way its release is (a tokenizer with no chat template): chat requests
are rendered by the V3.2 encoder on the server's own path (render_chat, as /v1/chat/completions, /v1/responses
and /tokenize use it), and the prompt is tokenized as text with no tokens added."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from mlaserve.config.model_config import ModelConfig
from mlaserve.engine.intake import RequestIntake
from mlaserve.loader.model_files import resolve_model
from mlaserve.loader.tokenizer import load_tokenizer
from mlaserve.server.protocol import ChatCompletionRequest
from mlaserve.server.sampling import render_chat
from mlaserve.testing.tiny_models import build_tiny
from tests.server.conftest import live_server, make_engine

CASES = {
    c["name"]: c
    for c in json.loads((Path(__file__).parent / "data" / "deepseek_encoder_cases.json").read_text())
}


@pytest.fixture(scope="module")
def v32_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny("deepseek_v32", tmp_path_factory.mktemp("tiny_v32"), tokenizer="bytes")


def intake_for(folder: Path) -> RequestIntake:
    files = resolve_model(folder)
    model_config = ModelConfig.from_hf(files.config_dict, "float32", torch.device("cpu"), 256)
    return RequestIntake(load_tokenizer(files, model_config.hf_config), model_config, lambda: None)


def test_v32_checkpoint_renders_through_the_encoder(v32_folder: Path) -> None:
    intake = intake_for(v32_folder)
    assert intake.model_config.architecture == "DeepseekV32ForCausalLM"
    assert not getattr(intake.tokenizer, "chat_template", None)
    case = CASES["v32_tool_loop_thinking"]
    req = ChatCompletionRequest(
        model="m",
        messages=case["messages"],
        tools=case["tools"],
        chat_template_kwargs=case["chat_template_kwargs"],
    )
    rendered = render_chat(intake, req)
    assert rendered["prompt"] == case["expected"]
    assert rendered["prompt_token_ids"] == intake.tokenizer.encode(case["expected"], add_special_tokens=False)


def test_v32_checkpoint_with_a_template_uses_the_template(v32_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "with_template"
    folder.mkdir()
    for item in v32_folder.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_file.write_text(json.dumps(config))
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert render_chat(intake_for(folder), req)["prompt"] == "[hi]"


def test_chat_completion_on_the_v32_checkpoint(v32_folder: Path) -> None:
    """/v1/chat/completions end to end: the prompt the model reads is the encoder's (its token count says so)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜><think>"
    engine = make_engine(v32_folder)
    try:
        for live, _ in live_server(engine, served_model_name="tiny"):
            body = {
                "model": "tiny",
                "messages": messages,
                "max_tokens": 2,
                "temperature": 0,
                "chat_template_kwargs": {"thinking": True},
            }
            r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            expected = intake_for(v32_folder).tokenizer.encode(prompt, add_special_tokens=False)
            assert r.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        engine.shutdown()
