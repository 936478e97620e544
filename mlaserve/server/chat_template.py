"""A chat request rendered by the model's chat template: messages, tools and the client's template variables.

Templates that never read `tools` (SmolLM2's, DeepSeek-V3's) would leave the model blind to them, so the tool list
is then added to the system message in the call format the template writes (tool_prompts.py).
"""

from __future__ import annotations

import json
import re

from mlaserve.server.errors import bad_request
from mlaserve.server.protocol import ChatCompletionRequest
from mlaserve.server.tool_prompts import reads_tools, tools_system_prompt
from mlaserve.server.tools import template_message

# apply_chat_template's own arguments: a client variable of the same name would clash with them.
_RESERVED = frozenset(
    {"messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt", "return_dict"}
)


# Arguments joined into a string with + or ~ (DeepSeek's templates: '```json' + '\n' + tool['function']['arguments']),
# where an object would fail; templates that write them with tojson get the object.
_ARGUMENTS = r"""\w[\w.]*(?:\[['"]\w+['"]\])*(?:\.arguments|\[['"]arguments['"]\])"""
_JOINS_ARGUMENTS = re.compile(rf"[+~]\s*{_ARGUMENTS}(?!\s*\|)|{_ARGUMENTS}\s*[+~]")


def template_kwargs(req: ChatCompletionRequest) -> dict:
    kwargs = req.chat_template_kwargs or {}
    clash = sorted(_RESERVED & set(kwargs))
    if clash:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(clash)}: the server sets it", "chat_template_kwargs"
        )
    return dict(kwargs)


def template_messages(req: ChatCompletionRequest, template: str) -> list[dict]:
    as_text = bool(_JOINS_ARGUMENTS.search(template))
    messages = [template_message(m, i, as_text) for i, m in enumerate(req.messages)]
    if req.tools and not reads_tools(template):
        prompt = tools_system_prompt(req.tools, template)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def render(tokenizer: object, req: ChatCompletionRequest, add_generation_prompt: bool) -> str:
    """The prompt text; ValueError (a 400 naming messages) where the template refuses these messages."""
    template = tokenizer.chat_template
    template_text = template if isinstance(template, str) else json.dumps(template)
    messages = template_messages(req, template_text)
    kwargs = template_kwargs(req)
    if req.tools:
        kwargs["tools"] = req.tools
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages (raise_exception, ...)
        raise ValueError(f"the chat template could not render these messages: {e}") from None
