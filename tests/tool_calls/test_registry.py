from __future__ import annotations

import pytest

from mlaserve.tool_calls import TOOL_PARSERS, choose_tool_parser, get_tool_parser


def test_vllm_names() -> None:
    assert set(TOOL_PARSERS) == {
        "deepseek_v3",
        "deepseek_v31",
        "deepseek_v32",
        "deepseek_v4",
        "hermes",
        "llama3_json",
    }
    assert get_tool_parser("deepseek_v31").name == "deepseek_v31"
    with pytest.raises(ValueError, match="known: deepseek_v3"):
        get_tool_parser("deepseekv3")


# Fragments of the published chat templates, where each renders an assistant turn's calls.
V3_TEMPLATE = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}"
)
V31_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
    "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)
QWEN_TEMPLATE = '{{- "<tool_call>\\n{\\"name\\": \\"" }}{{- tool_call.name }}'
LLAMA_TEMPLATE = '{{- "<|python_tag|>" }} {{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'


@pytest.mark.parametrize(
    "model,template,expected",
    [
        ("deepseek_v3", V3_TEMPLATE, "deepseek_v3"),
        ("DeepseekV3ForCausalLM", V31_TEMPLATE, "deepseek_v31"),
        ("deepseek_v3", None, None),  # V3, R1 and V3.1 share the model_type: the template must decide
        ("deepseek_v32", None, "deepseek_v32"),
        ("DeepseekV32ForCausalLM", None, "deepseek_v32"),
        ("deepseek_v4", None, "deepseek_v4"),
        (None, "... <｜DSML｜tool_calls> ...", "deepseek_v4"),
        (None, "... <｜DSML｜function_calls> ...", "deepseek_v32"),
        ("qwen2", QWEN_TEMPLATE, "hermes"),
        ("llama", LLAMA_TEMPLATE, "llama3_json"),
        ("llama", "{{ messages }}", None),
        (None, None, None),
    ],
)
def test_choose_tool_parser(model, template, expected) -> None:
    assert choose_tool_parser(model, template) == expected
