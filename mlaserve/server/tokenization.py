"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info (and GET /version).

Clients that count tokens or build prompts from token ids (lm-evaluation-harness's remote tokenizer, guidellm,
RAG pipelines) use them instead of loading the model's tokenizer themselves. Bodies and answers have vLLM's
shapes; the tokenizer is the engine's, so it runs on the engine thread like every other tokenizer call.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from mlaserve import __version__
from mlaserve.engine.async_engine import EngineDeadError
from mlaserve.engine.llm_engine import LLMEngine
from mlaserve.server.body import parse_json_object, read_body, validate
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.protocol import ChatCompletionRequest, ChatMessage
from mlaserve.server.sampling import render_chat
from mlaserve.server.state import ServerState


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


async def _on_engine(state: ServerState, fn: object) -> object:
    def checked(engine: LLMEngine) -> object:
        if engine.tokenizer is None:
            raise ValueError("this server runs without a tokenizer (skip_tokenizer_init)")
        return fn(engine)

    try:
        return await state.engine.run(checked)
    except EngineDeadError as e:
        raise OpenAIError(503, str(e), code="engine_dead", status="error") from None
    except (ValueError, TypeError, OverflowError) as e:
        raise bad_request(str(e)) from None


async def tokenize(state: ServerState, request: Request) -> dict:
    body = parse_json_object(await read_body(request, state.settings.max_body_bytes))
    req = validate(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
    state.check_model(req.model)

    def run(engine: LLMEngine) -> tuple[list[int], list[str] | None]:
        tokenizer = engine.tokenizer
        if isinstance(req, TokenizeChatRequest):
            chat = ChatCompletionRequest(messages=req.messages)
            text = render_chat(engine, chat, req.add_generation_prompt is not False)["prompt"]
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return ids, strs

    ids, strs = await _on_engine(state, run)
    limit = state.engine.engine.model_config.max_model_len
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}


async def detokenize(state: ServerState, request: Request) -> dict:
    req = validate(
        DetokenizeRequest, parse_json_object(await read_body(request, state.settings.max_body_bytes))
    )
    state.check_model(req.model)
    vocab = state.engine.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
    text = await _on_engine(state, lambda engine: engine.tokenizer.decode(req.tokens))
    return {"prompt": text}


async def tokenizer_info(state: ServerState) -> dict:
    """The tokenizer's configuration (special tokens, chat template), as vLLM's /tokenizer_info gives it."""

    def run(engine: LLMEngine) -> dict:
        tokenizer = engine.tokenizer
        info = {
            "tokenizer_class": type(tokenizer).__name__,
            "model_max_length": engine.model_config.max_model_len,
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            info[name] = getattr(tokenizer, name, None)
        return info

    return await _on_engine(state, run)


def version() -> dict[Literal["version"], str]:
    return {"version": __version__}
