"""Chat prompts written by Python encoders instead of Jinja chat templates.

DeepSeek-V3.2 and V4 publish an encoder script rather than a chat template, so their tokenizers carry no template
that knows their tool markup or thinking mode. For these architectures the server writes the prompt itself, as
vLLM's deepseek_v32 / deepseek_v4 tokenizer modes do. A chat template in the tokenizer (one an operator added)
still wins: it is the operator's choice of prompt.

Request options, in chat_template_kwargs as vLLM reads them: "thinking" or "enable_thinking" (default off);
for V4 also "reasoning_effort" ("max" adds DeepSeek's preamble; other levels add nothing) and "drop_thinking"
(default on).
"""

from __future__ import annotations

from collections.abc import Callable

from mlaserve.server.encoders.deepseek_v4 import encode_v4
from mlaserve.server.encoders.deepseek_v32 import encode_v32

ChatEncoder = Callable[[list[dict], list[dict] | None, dict], str]


def _with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tools belong to the leading system message (DeepSeek's own examples put them there), or to an empty one
    put first where the conversation has none."""
    if not tools:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def _thinking(options: dict) -> bool:
    return bool(options.get("thinking") or options.get("enable_thinking"))


def _v32(messages: list[dict], tools: list[dict] | None, options: dict) -> str:
    return encode_v32(_with_tools(messages, tools), _thinking(options))


def _v4(messages: list[dict], tools: list[dict] | None, options: dict) -> str:
    return encode_v4(
        _with_tools(messages, tools),
        _thinking(options),
        drop_thinking=options.get("drop_thinking", True) is not False,
        reasoning_effort=options.get("reasoning_effort"),
    )


_BY_ARCHITECTURE: dict[str, ChatEncoder] = {"DeepseekV32ForCausalLM": _v32, "DeepseekV4ForCausalLM": _v4}
_BY_MODEL_TYPE: dict[str, ChatEncoder] = {"deepseek_v32": _v32, "deepseek_v4": _v4}


def chat_encoder(tokenizer: object, model_config: object | None) -> ChatEncoder | None:
    """The encoder for this model, or None where the tokenizer's chat template renders its prompts."""
    if model_config is None or getattr(tokenizer, "chat_template", None):
        return None
    encoder = _BY_ARCHITECTURE.get(getattr(model_config, "architecture", None) or "")
    if encoder is None:
        model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
        encoder = _BY_MODEL_TYPE.get(model_type or "")
    return encoder
