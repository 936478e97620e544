"""From a validated OpenAI request to the engine's prepared requests: prompts, SamplingParams, n, limits.

Everything here raises a 400 naming the field, before any engine request is queued.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mlaserve.engine.intake import PreparedRequest, RequestIntake
from mlaserve.engine.parallel_sampling import child_params
from mlaserve.sampling.grammar_error import GrammarError
from mlaserve.sampling_params import SamplingParams, StructuredOutputsParams
from mlaserve.server.chat_template import can_render, render
from mlaserve.server.errors import OpenAIError, bad_request
from mlaserve.server.fields import check_unread_fields
from mlaserve.server.intake import ServerIntake
from mlaserve.server.protocol import ChatCompletionRequest, CompletionRequest

# One HTTP request may not fan out into more engine requests than this (prompts x n).
MAX_CHOICES = 128
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # what a torch.Generator seed can hold
_PARAM_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
)


def _or(value: object, default: object) -> object:
    return default if value is None else value


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's grammar, from OpenAI's response_format or vLLM's structured_outputs / guided_* fields."""
    found: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema", "response_format"
            )
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True)
        found.append(("structured_outputs", {"json" if k == "json_" else k: v for k, v in fields.items()}))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint may be set, got {names}", found[1][0])
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        # the message names SamplingParams' field (structured_outputs.json); the client set its own
        message = (
            str(e) if name == "structured_outputs" else re.sub(r"^structured_outputs\.\w+", name, str(e))
        )
        raise bad_request(message, name) from None


def build_params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    max_tokens_field: str = "max_tokens",
    prompt_logprobs: int | None = None,
    tool_grammar: StructuredOutputsParams | None = None,
    keep_special_tokens: bool = False,
) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them): seeds seed+i, so choices differ but runs repeat. tool_grammar
    enforces a forced tool_choice; keep_special_tokens is the default where a tool parser reads them."""
    check_unread_fields(req)
    n = _or(req.n, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {n}", "n")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX - (n - 1):
        raise bad_request(
            f"seed must be a 64-bit signed integer (seed + n - 1 included), got {req.seed}", "seed"
        )
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    grammar = structured_outputs(req)
    if tool_grammar is not None:
        if grammar is not None:
            raise bad_request(
                f"tool_choice {req.tool_choice!r} already constrains the output; it cannot be combined with "
                f"{constraint_field(req)}",
                "tool_choice",
            )
        grammar = tool_grammar
    skip_special = _or(req.skip_special_tokens, not keep_special_tokens)
    try:
        params = SamplingParams(
            n=n,
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=_or(req.top_k, 0),
            min_p=_or(req.min_p, 0.0),
            max_tokens=max_tokens,
            min_tokens=_or(req.min_tokens, 0),
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            seed=req.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=_or(req.ignore_eos, False),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            logit_bias=req.logit_bias,
            skip_special_tokens=skip_special,
            include_stop_str_in_output=_or(req.include_stop_str_in_output, False),
            structured_outputs=grammar,
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        if param == "min_tokens" and "max_tokens" in message and max_tokens_field != "max_tokens":
            message = message.replace("max_tokens", max_tokens_field)
        if param == "max_tokens" and max_tokens_field != param:  # chat's max_completion_tokens
            message, param = message.replace("max_tokens", max_tokens_field, 1), max_tokens_field
        raise bad_request(message, param if param in _PARAM_FIELDS else None) from None
    # The offline API's fan-out, so a seeded request samples the same choices here and in LLM.generate. Every
    # choice scores the prompt: an echoed choice shows its own prompt logprobs.
    return child_params(params)


def completion_prompts(req: CompletionRequest) -> list[str | dict]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if not req.logprobs:
        return None
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs")
    return top


def render_chat(
    intake: RequestIntake, req: ChatCompletionRequest, add_generation_prompt: bool = True
) -> dict:
    """The chat template applied to the messages, then tokenized (on an intake thread, never the engine's)."""
    tokenizer = intake.tokenizer
    if not can_render(tokenizer, intake.model_config):
        raise ValueError(
            "this model's tokenizer has no chat template; use /v1/completions with a plain prompt"
        )
    text = render(tokenizer, req, add_generation_prompt, intake.model_config)
    return {"prompt": text, "prompt_token_ids": intake.encode(text, add_special_tokens=False)}


def constraint_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field that set an output constraint (for errors found when the grammar is compiled):
    structured_outputs' own member where that is the one (structured_outputs.choice)."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True)
        member = next((k for k in fields if fields[k] is not False), None)
        return "structured_outputs" if member is None else f"structured_outputs.{member.removesuffix('_')}"
    return next(
        (f"guided_{k}" for k in ("json", "regex", "choice", "grammar") if getattr(req, f"guided_{k}")), None
    )


async def prepare_choices(
    intake: ServerIntake,
    prompts: Sequence[str | dict] | ChatCompletionRequest,
    params: list[SamplingParams],
    max_tokens_field: str | None,
    with_prompt_text: bool = False,
    grammar_field: str | None = None,
) -> tuple[list[PreparedRequest], int]:
    """Tokenize and validate every prompt once, on an intake thread; returns (choices, usage prompt tokens).

    `max_tokens_field` names the field the client set, or is None when max_tokens is a default: a default
    is quietly cut to the context left, an explicit value that does not fit is an error. `with_prompt_text`
    decodes prompts given as token ids (echo shows the prompt as text); `grammar_field` is the field to
    blame for a grammar that does not compile."""
    is_chat = isinstance(prompts, ChatCompletionRequest)
    n_prompts = 1 if is_chat else len(prompts)
    if n_prompts * len(params) > MAX_CHOICES:
        raise bad_request(
            f"{n_prompts} prompt(s) x n={len(params)} is more than {MAX_CHOICES} choices in one request", "n"
        )

    def prepare(intake: RequestIntake) -> list[PreparedRequest]:
        if is_chat:
            return [intake.prepare(render_chat(intake, prompts), params[0])]
        bases = [intake.prepare(p, params[0]) for p in prompts]
        if with_prompt_text and intake.tokenizer is not None:
            for base in bases:
                if base.prompt is None:
                    base.prompt = intake.tokenizer.decode(base.prompt_token_ids)
        return bases

    try:
        bases = await intake.run(prepare)
    except GrammarError as e:
        field = grammar_field or f"structured_outputs.{e.kind}"
        raise OpenAIError(400, f"{field}: {e.reason}", field) from None
    except (ValueError, TypeError) as e:
        message = str(e)
        param = "messages" if is_chat else "prompt"
        if message.startswith("structured output"):
            param = grammar_field
        elif message.startswith("logit_bias"):
            param = "logit_bias"
        code = "context_length_exceeded" if "max_model_len" in message else None
        raise OpenAIError(400, message, param, code) from None
    limit = intake.max_model_len
    choices = []
    for base in bases:
        if max_tokens_field is not None:
            _check_room(len(base.prompt_token_ids), params[0].max_tokens, limit, max_tokens_field)
        choices += [PreparedRequest(base.prompt, base.prompt_token_ids, p, base.grammar) for p in params]
    return choices, sum(len(b.prompt_token_ids) for b in bases)


def _check_room(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str) -> None:
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise OpenAIError(
            400,
            f"{field}={max_tokens} is more than this request can generate: max_model_len is {max_model_len} "
            f"and the prompt has {prompt_len} tokens, so at most {room} tokens are left",
            field,
            "context_length_exceeded",
        )
