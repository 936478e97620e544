"""DeepSeek-V4's prompt format, as DeepSeek's Python encoder (encoding/encoding_dsv4.py in the model's release)
writes it; the checkpoint ships no chat template.

What changed from V3.2 (deepseek_v32.py): there is no tool role. Tool results become <tool_result> blocks of a
user turn (one turn for a run of results, a following user message joining it), put in the order of the calls
they answer. The call block is <｜DSML｜tool_calls>. The assistant cue follows a user turn only where the assistant
speaks next, and whether earlier turns keep their reasoning depends on tools: with tools anywhere in the
conversation every assistant turn shows its reasoning, without them only the turns after the last user turn do.
Thinking mode can open with a reasoning-effort preamble.

DeepSeek's internal roles and fields (latest_reminder, task, wo_eos) are not OpenAI message fields and are left
out.
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

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 - one line of the prompt per source line

# Put before everything in thinking mode when the client asks for reasoning_effort "max"; DeepSeek's encoder
# has no text for the other levels.
_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


def tools_section(tools: list[dict]) -> str:
    return _TOOLS_SECTION.replace("{schemas}", tool_schemas(tools))


def encode_v4(
    messages: list[dict], thinking: bool, drop_thinking: bool = True, reasoning_effort: str | None = None
) -> str:
    """messages: OpenAI-style dicts (content a string; tool_calls with JSON-text or object arguments; tools on a
    system or developer message). drop_thinking: hide the reasoning of turns before the last user turn (only
    without tools). ValueError for a conversation the format cannot hold."""
    turns = _sort_results(_merge_results(messages))
    drop = drop_thinking and not any(m.get("tools") for m in turns)
    if thinking and drop:
        # Earlier developer turns go too (their instructions were for turns already answered).
        last = last_user_index(turns)
        turns = [m for i, m in enumerate(turns) if m["role"] != "developer" or i >= last]
    last_user = last_user_index(turns)
    prompt = BOS + (_MAX_EFFORT if thinking and reasoning_effort == "max" else "")
    for i, msg in enumerate(turns):
        prompt += _turn(i, msg, thinking, drop, last_user)
        follows = turns[i + 1]["role"] if i + 1 < len(turns) else "assistant"
        if follows == "assistant" and msg["role"] in ("user", "developer"):
            open_think = thinking and (not drop or i >= last_user)
            prompt += ASSISTANT + (THINK_START if open_think else THINK_END)
    return prompt


def _turn(i: int, msg: dict, thinking: bool, drop: bool, last_user: int) -> str:
    role = msg["role"]
    content = msg.get("content") or ""
    tools = msg.get("tools")
    section = f"\n\n{tools_section(tools)}" if tools else ""
    if role == "system":
        return content + section
    if role == "developer":
        if not content:
            raise ValueError("a developer message needs content")
        return USER + content + section
    if role == "user":
        return USER + "\n\n".join(msg["parts"])
    if role == "assistant":
        reasoning = ""
        if thinking and (not drop or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = msg.get("tool_calls")
        return reasoning + content + (dsml_calls(calls, "tool_calls") if calls else "") + EOS
    raise ValueError(f"role {role!r} has no place in DeepSeek-V4's prompt format")


def _merge_results(messages: list[dict]) -> list[dict]:
    """Tool results and user text as user turns of parts: a result joins the user turn before it if that turn
    was itself built from results or text, and so does user text (so back-to-back user messages are one turn)."""
    turns: list[dict] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            part = (msg.get("tool_call_id") or "", f"<tool_result>{msg.get('content') or ''}</tool_result>")
        elif role == "user":
            part = (None, msg.get("content") or "")
        else:
            turns.append(msg)
            continue
        if turns and turns[-1]["role"] == "user" and "parts" in turns[-1]:
            turns[-1]["parts"].append(part)
        else:
            turns.append({"role": "user", "parts": [part]})
    return turns


def _sort_results(turns: list[dict]) -> list[dict]:
    """Results in a turn are put in the order of the latest assistant calls they answer (unknown ids first, as
    if first, keeping their own order); text parts keep their places. Parts end up as plain strings."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            call_order = {c["id"]: j for j, c in enumerate(turn["tool_calls"]) if c.get("id")}
        if "parts" not in turn:
            continue
        results = [p for p in turn["parts"] if p[0] is not None]
        if len(results) > 1 and call_order:
            results.sort(key=lambda p: call_order.get(p[0], 0))
        ordered = iter(results)
        turn["parts"] = [next(ordered)[1] if p[0] is not None else p[1] for p in turn["parts"]]
    return turns
