"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info (and GET /version).

Clients that count tokens or build prompts from token ids (lm-evaluation-harness's remote tokenizer, guidellm,
RAG pipelines) use them instead of loading the model's tokenizer themselves. Bodies and answers have vLLM's
shapes; they run on the server's intake threads, never the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from mlaserve import __version__
from mlaserve.engine.intake import RequestIntake
from mlaserve.server.body import validate
from mlaserve.server.errors import bad_request
from mlaserve.server.protocol import ChatCompletionRequest, ChatMessage
from mlaserve.server.sampling import render_chat
from mlaserve.server.state import ServerState

T = TypeVar("T")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # None: True, as vLLM
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None  # None: True
    add_special_tokens: bool | None = None  # None: False (the template writes them)
    return_token_strs: bool | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


async def _on_intake(state: ServerState, fn: Callable[[RequestIntake], T]) -> T:
    def checked(intake: RequestIntake) -> T:
        if intake.tokenizer is None:
            raise ValueError("this server runs without a tokenizer (skip_tokenizer_init)")
        return fn(intake)

    try:
        return await state.intake.run(checked)
    except (ValueError, TypeError, OverflowError) as e:
        raise bad_request(str(e)) from None


async def tokenize(state: ServerState, request: Request) -> dict:
    body = await state.read_json(request)
    req = validate(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
    state.check_model(req.model)

    def run(intake: RequestIntake) -> tuple[list[int], list[str] | None]:
        if isinstance(req, TokenizeChatRequest):
            chat = ChatCompletionRequest(messages=req.messages)
            text = render_chat(intake, chat, req.add_generation_prompt is not False)["prompt"]
            ids = intake.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = intake.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        strs = intake.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return ids, strs

    ids, strs = await _on_intake(state, run)
    limit = state.intake.max_model_len
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}


async def detokenize(state: ServerState, request: Request) -> dict:
    req = validate(DetokenizeRequest, await state.read_json(request))
    state.check_model(req.model)
    vocab = state.intake.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    text = await _on_intake(state, lambda intake: intake.tokenizer.decode(req.tokens))
    return {"prompt": text}


async def tokenizer_info(state: ServerState) -> dict:
    """The tokenizer's configuration (special tokens, chat template), as vLLM's /tokenizer_info gives it."""

    def run(intake: RequestIntake) -> dict:
        tokenizer = intake.tokenizer
        info = {
            "tokenizer_class": type(tokenizer).__name__,
            "model_max_length": intake.model_config.max_model_len,
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            info[name] = getattr(tokenizer, name, None)
        return info

    return await _on_intake(state, run)


def version() -> dict[Literal["version"], str]:
    return {"version": __version__}
