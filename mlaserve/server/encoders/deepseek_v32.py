"""DeepSeek-V3.2's prompt format, as DeepSeek's Python encoder (encoding/encoding_dsv32.py in the model's release)
writes it; the checkpoint ships that encoder instead of a chat template.

Shape of a conversation:

    BOS system text [blank line, tools section]
    <｜User｜>text<｜Assistant｜>  then <think> (thinking mode, last user turn) or </think>
    [reasoning</think>] text [blank line, DSML function_calls block] EOS
    tool results: <function_results> with one <result> per call, then <think> or </think>

Reasoning is written back only for assistant turns after the last user turn (the calls and results of the turn
in progress); earlier turns show their text and calls alone. The prompt always ends where the assistant writes
next, so there is no separate generation prompt.
"""

from __future__ import annotations

from mlaserve.server.encoders.shared import (
    ASSISTANT,
    BOS,
    EOS,
    THINK_END,
    THINK_START,
    USER,
    dsml_calls,
    last_user_index,
    tool_schemas,
)
from mlaserve.tool_calls.deepseek_tokens import DSML

# DeepSeek's wording, line for line: the model was trained on this text.
_TOOLS_SECTION = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""  # noqa: E501 - one line of the prompt per source line


def tools_section(tools: list[dict]) -> str:
    return _TOOLS_SECTION.replace("{schemas}", tool_schemas(tools))


def encode_v32(messages: list[dict], thinking: bool) -> str:
    """messages: OpenAI-style dicts (content a string; tool_calls with JSON-text or object arguments; tools on a
    system or developer message). ValueError for a conversation the format cannot hold."""
    if thinking:
        # DeepSeek's encoder means to drop developer turns before the last user turn here (it fails instead),
        # as V4's does.
        last = last_user_index(messages)
        messages = [m for i, m in enumerate(messages) if m.get("role") != "developer" or i >= last]
    last_user = last_user_index(messages)
    return BOS + "".join(_turn(i, messages, thinking, last_user) for i in range(len(messages)))


def _turn(i: int, messages: list[dict], thinking: bool, last_user: int) -> str:
    msg = messages[i]
    role = msg.get("role")
    content = msg.get("content") or ""
    tools = msg.get("tools")
    if role == "system":
        return content + (f"\n\n{tools_section(tools)}" if tools else "")
    if role in ("user", "developer"):
        if role == "developer":
            if not content:
                raise ValueError(f"messages[{i}]: a developer message needs content")
            section = f"\n\n{tools_section(tools)}" if tools else ""
            content = f"{section}\n\n# The user's message is: {content}"
        cue = THINK_START if thinking and i == last_user else THINK_END
        return f"{USER}{content}{ASSISTANT}{cue}"
    if role == "tool":
        return _tool_result(i, messages, thinking, last_user)
    if role == "assistant":
        # The turn in progress keeps its reasoning (an empty one still closes the think block); finished
        # turns before the last user message never show it.
        reasoning = ""
        if thinking and i > last_user:
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = msg.get("tool_calls")
        return reasoning + content + (dsml_calls(calls, "function_calls") if calls else "") + EOS
    raise ValueError(f"messages[{i}]: role {role!r} has no place in DeepSeek-V3.2's prompt format")


def _tool_result(i: int, messages: list[dict], thinking: bool, last_user: int) -> str:
    """Results of one assistant turn's calls share one <function_results> block, in message order."""
    owner = i - 1
    while owner >= 0 and messages[owner].get("role") == "tool":
        owner -= 1
    owner_msg = messages[owner] if owner >= 0 else {}
    calls = owner_msg.get("tool_calls") if owner_msg.get("role") == "assistant" else None
    if not calls:
        raise ValueError(f"messages[{i}]: a tool result must follow an assistant message with tool_calls")
    position = i - owner  # 1 for the first result of that turn
    if position > len(calls):
        raise ValueError(f"messages[{i}]: more tool results than the assistant's {len(calls)} tool_calls")
    text = "\n\n<function_results>" if position == 1 else ""
    text += f"\n<result>{messages[i].get('content') or ''}</result>"
    if position == len(calls):
        cue = THINK_START if thinking and i >= last_user else THINK_END
        text += f"\n</function_results>\n\n{cue}"
    return text
