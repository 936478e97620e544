"""A chat request rendered by the model's chat template: messages, tools and the client's template variables.
Models that publish a Python encoder instead of a template (DeepSeek-V3.2, V4) are rendered by it (encoders/).

Templates that never read `tools` (SmolLM2's, DeepSeek-V3's) would leave the model blind to them, so the tool list
is then added to the system message in the call format the template writes (tool_prompts.py).
"""

from __future__ import annotations

import json
import re

from mlaserve.server.encoders import chat_encoder
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
# DeepSeek-R1's template (and its distills') writes an assistant turn's calls only when its content is None.
_CONTENT_IS_NONE = re.compile(r"content['\"]?\]?\s+is\s+none")


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
    if _CONTENT_IS_NONE.search(template):
        messages = [
            {**m, "content": None} if m.get("tool_calls") and not m["content"] else m for m in messages
        ]
    if req.tools and not reads_tools(template):
        prompt = tools_system_prompt(req.tools, template)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def can_render(tokenizer: object, model_config: object | None = None) -> bool:
    """Whether chat requests have a prompt writer: a chat template, or an encoder for this model."""
    return (
        bool(getattr(tokenizer, "chat_template", None)) or chat_encoder(tokenizer, model_config) is not None
    )


def render(
    tokenizer: object,
    req: ChatCompletionRequest,
    add_generation_prompt: bool,
    model_config: object | None = None,
) -> str:
    """The prompt text; ValueError (a 400 naming messages) where the template refuses these messages.
    model_config: the served model's, which picks an encoder for models without a template."""
    encoder = chat_encoder(tokenizer, model_config)
    if encoder is not None:
        # The encoders end every prompt where the assistant writes next: add_generation_prompt has no part there.
        messages = [template_message(m, i, True) for i, m in enumerate(req.messages)]
        try:
            return encoder(messages, req.tools, template_kwargs(req))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"these messages do not fit the model's prompt format: {e}") from None
    template = tokenizer.chat_template
    template_text = template if isinstance(template, str) else json.dumps(template)
    messages = template_messages(req, template_text)
    kwargs = template_kwargs(req)
    if req.tools:
        kwargs["tools"] = req.tools
    try:
        if any(m["content"] is None for m in messages):
            return _render_keeping_none(tokenizer, messages, add_generation_prompt, kwargs)
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages (raise_exception, ...)
        raise ValueError(f"the chat template could not render these messages: {e}") from None


def _render_keeping_none(
    tokenizer: object, messages: list[dict], add_generation_prompt: bool, kwargs: dict
) -> str:
    """apply_chat_template without its first step, which drops every None value: a template that tests
    `content is none` then never sees None. The rest is what apply_chat_template does for tokenize=False (the
    template chosen for these tools, the special tokens as variables)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = kwargs.pop("tools", None)
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=tokenizer.get_chat_template(None, tools),
        add_generation_prompt=add_generation_prompt,
        **{**tokenizer.special_tokens_map, **kwargs},
    )
    return rendered[0]
