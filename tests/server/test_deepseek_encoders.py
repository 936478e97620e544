"""DeepSeek-V3.2 and V4 prompts written by mlaserve's encoders, checked byte for byte against DeepSeek's own.

data/deepseek_encoder_cases.json holds each case's request (messages, tools, chat_template_kwargs) and the prompt
DeepSeek's published encoders write for it. How the expected prompts were made: each request was turned into the
encoders' input the way this server does (tools on the leading system message, or on an empty system message put
first; thinking_mode from "thinking"/"enable_thinking"; V4's drop_thinking and reasoning_effort from the same
kwargs) and given to DeepSeek's encode_messages, run in a scratch script outside this repository:
encoding/encoding_dsv32.py of DeepSeek-V3.2's release and encoding/encoding_dsv4.py of DeepSeek-V4's. Before
that, the same scripts were checked against DeepSeek's golden files (V3.2's test_input.json / test_output.txt, V4's
tests/test_input_1..4.json / test_output_1..4.txt): they reproduce them exactly, and the "official" cases here are
those conversations. Cases named *_developer_thinking exist for V4 only: V3.2's encoder fails on a developer turn
before the last user turn in thinking mode.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlaserve.server.chat_template import can_render, render
from mlaserve.server.encoders import chat_encoder
from mlaserve.server.protocol import ChatCompletionRequest

CASES = json.loads((Path(__file__).parent / "data" / "deepseek_encoder_cases.json").read_text())
ARCHITECTURE = {"v32": "DeepseekV32ForCausalLM", "v4": "DeepseekV4ForCausalLM"}
NO_TEMPLATE = SimpleNamespace(chat_template=None)


def model(architecture: str, model_type: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(architecture=architecture, hf_config=SimpleNamespace(model_type=model_type))


def request(case: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m",
        messages=case["messages"],
        tools=case["tools"],
        chat_template_kwargs=case["chat_template_kwargs"],
    )


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_prompt_matches_deepseeks_encoder(case: dict) -> None:
    got = render(NO_TEMPLATE, request(case), True, model(ARCHITECTURE[case["encoder"]]))
    assert got == case["expected"]


def test_cases_cover_the_format() -> None:
    """The data holds what the brief of these encoders asks for: several calls in one turn, results, both modes."""
    names = {c["name"] for c in CASES}
    for enc in ("v32", "v4"):
        assert {f"{enc}_tool_loop_thinking", f"{enc}_tool_loop_chat", f"{enc}_plain_thinking"} <= names
    loop = next(c for c in CASES if c["name"] == "v4_tool_loop_thinking")
    assert len(loop["messages"][2]["tool_calls"]) == 3
    # V4 puts results in the order of the calls, whatever order the client sent them in.
    assert loop["expected"].index("Paris: 12C") < loop["expected"].index("Oslo: 3C")


def test_encoder_is_chosen_by_architecture_or_model_type() -> None:
    assert chat_encoder(NO_TEMPLATE, model("DeepseekV32ForCausalLM")) is not None
    assert chat_encoder(NO_TEMPLATE, model("DeepseekV4ForCausalLM")) is not None
    assert chat_encoder(NO_TEMPLATE, model("Other", "deepseek_v4")) is not None
    assert chat_encoder(NO_TEMPLATE, model("DeepseekV3ForCausalLM", "deepseek_v3")) is None
    assert chat_encoder(NO_TEMPLATE, None) is None
    assert not can_render(NO_TEMPLATE, model("LlamaForCausalLM"))
    assert can_render(NO_TEMPLATE, model("DeepseekV32ForCausalLM"))


def test_a_chat_template_in_the_tokenizer_wins() -> None:
    """An operator who put a template in the tokenizer chose that prompt: the encoder stands aside."""
    tokenizer = SimpleNamespace(chat_template="{{ messages[0]['content'] }}")
    assert chat_encoder(tokenizer, model("DeepseekV32ForCausalLM")) is None


@pytest.mark.parametrize("encoder", ["v32", "v4"])
def test_thinking_is_off_unless_asked(encoder: str) -> None:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert render(NO_TEMPLATE, req, True, model(ARCHITECTURE[encoder])).endswith("<｜Assistant｜></think>")
    req.chat_template_kwargs = {"thinking": True}
    assert render(NO_TEMPLATE, req, True, model(ARCHITECTURE[encoder])).endswith("<｜Assistant｜><think>")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "tool", "tool_call_id": "x", "content": "r"}],
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "a", "content": "r1"},
            {"role": "tool", "tool_call_id": "b", "content": "r2"},
        ],
    ],
    ids=["result_without_call", "more_results_than_calls"],
)
def test_v32_refuses_results_without_their_calls(messages: list[dict]) -> None:
    req = ChatCompletionRequest(model="m", messages=messages)
    with pytest.raises(ValueError, match="prompt format"):
        render(NO_TEMPLATE, req, True, model("DeepseekV32ForCausalLM"))
