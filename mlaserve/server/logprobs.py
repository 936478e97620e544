"""Engine logprobs (one {token_id: Logprob} dict per token) in the two OpenAI shapes.

Token strings come from a table of the whole vocabulary decoded once, on an intake thread, the first time a
request asks for logprobs; after that formatting never touches the tokenizer.
"""

from __future__ import annotations

import math

from mlaserve.engine.intake import RequestIntake
from mlaserve.outputs import LogprobEntry
from mlaserve.server.intake import ServerIntake
from mlaserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def _decode_vocabulary(intake: RequestIntake) -> list[str]:
    tokenizer = intake.tokenizer
    vocab_size = intake.model_config.vocab_size
    if tokenizer is None:  # skip_tokenizer_init: name tokens by id, as vLLM does
        return [f"token_id:{i}" for i in range(vocab_size)]
    known = len(tokenizer)
    # One batch call (it releases the GIL, see engine/intake.py); ids past the tokenizer are padded rows.
    texts = list(tokenizer.batch_decode([[i] for i in range(known)]))
    return texts + [""] * max(0, vocab_size - known)


class TokenTexts:
    def __init__(self, intake: ServerIntake) -> None:
        self._intake = intake
        self._table: list[str] | None = None

    async def table(self) -> list[str]:
        if self._table is None:  # two first callers may both build it; same result, no harm
            self._table = await self._intake.run(_decode_vocabulary)
        return self._table


def _text(table: list[str], token_id: int) -> str:
    return table[token_id] if 0 <= token_id < len(table) else ""


def _finite(value: float) -> float:
    # JSON has no -inf; a token with zero probability under top-p/top-k still needs a number.
    return value if math.isfinite(value) else -9999.0


def _ranked(entry: LogprobEntry) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda item: -item[1])


def _value(entry: LogprobEntry, token_id: int) -> float:
    found = entry.get(token_id)
    return -math.inf if found is None else found.logprob


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[LogprobEntry | None],
    table: list[str],
    text_offset: int,
    out: CompletionLogprobs | None = None,
) -> CompletionLogprobs:
    """Legacy completions shape; `text_offset` is where these tokens start in the choice's text. An entry of
    None (an echoed prompt's first token) is a null logprob and null top_logprobs, as in OpenAI's API.
    Appends to `out` when given (echo: the prompt's tokens, then the generated ones)."""
    out = CompletionLogprobs() if out is None else out
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = _text(table, token_id)
        out.tokens.append(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_finite(_value(entry, token_id)))
            out.top_logprobs.append({_text(table, t): _finite(lp) for t, lp in _ranked(entry)})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[LogprobEntry], table: list[str], top_logprobs: int
) -> ChatLogprobs:
    out = ChatLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        text = _text(table, token_id)
        top = [
            TopLogprob(token=_text(table, t), logprob=_finite(lp), bytes=list(_text(table, t).encode()))
            for t, lp in _ranked(entry)[:top_logprobs]
        ]
        out.content.append(
            TokenLogprob(
                token=text,
                logprob=_finite(_value(entry, token_id)),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return out
