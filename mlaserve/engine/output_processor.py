"""OutputProcessor: the engine core's token deltas -> text deltas, stop strings, and (offline) whole outputs.

It runs wherever the deltas are read: beside the core in LLMEngine (the offline API), or in the server's process
when the core runs in its own (so detokenization is off the core's critical path). A stop string is found here;
the caller then finishes that request in the core (it may already have sampled another token, which is dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.detokenizer import RequestText
from mlaserve.engine.intake import PreparedRequest
from mlaserve.outputs import CompletionOutput, LogprobEntry, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestDelta:
    """What one request gained since its last delta."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry] | None
    text: str  # new visible text (a stop string's possible start and half a UTF-8 character are held back)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestState:
    prepared: PreparedRequest
    text: RequestText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry | None] | None = None
    sent_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: dict | None = None

    def output(self, request_id: str) -> RequestOutput:
        """The request so far as vLLM's cumulative RequestOutput (copies: for the offline API)."""
        finished = self.finish_reason is not None
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        cumulative = None
        if logprobs is not None:
            cumulative = sum(lp[t].logprob for lp, t in zip(logprobs, self.token_ids))
        completion = CompletionOutput(
            0,
            self.text.visible_text(finished),
            list(self.token_ids),
            cumulative,
            logprobs,
            self.finish_reason,
            self.stop_reason,
        )
        prepared = self.prepared
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(
            request_id,
            prepared.prompt,
            list(prepared.prompt_token_ids),
            [completion],
            finished,
            self.num_cached_tokens,
            self.metrics,
            prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer: object | None, decode_logprobs: bool = False) -> None:
        """decode_logprobs: fill each Logprob's decoded_token (the offline API returns them; the server names
        tokens from its own table of the vocabulary and skips this)."""
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._decode = decode_logprobs and tokenizer is not None
        self._token_text: dict[int, str] = {}

    def add(self, request_id: str, prepared: PreparedRequest) -> None:
        params = prepared.params
        text = RequestText(params.stop, params.include_stop_str_in_output, params.skip_special_tokens)
        state = RequestState(prepared, text, logprobs=[] if params.logprobs is not None else None)
        self.states[request_id] = state

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(
        self, outputs: list[CoreOutput]
    ) -> tuple[list[RequestDelta], list[str], dict[str, RequestState]]:
        """(one delta per request that changed, the ids a stop string ended, the states that finished).

        The caller finishes the stop-string ids in the core; their later core outputs find no state and are
        dropped. Finished states leave the processor (the third value hands them over)."""
        deltas: list[RequestDelta] = []
        stopped: list[str] = []
        finished: dict[str, RequestState] = {}
        tokenizer = self.tokenizer
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
                if self._decode:
                    self._name_tokens(e for e in out.prompt_logprobs if e is not None)
            finish, stop_reason = out.finish_reason, out.stop_reason
            new_ids = out.new_token_ids
            # Several tokens at once (speculative decoding) are read one at a time, so a stop string ends the
            # output at the token that completes it, as without speculation; the tokens after it are dropped.
            for count in range(1, len(new_ids) + 1):
                state.token_ids.append(new_ids[count - 1])
                if tokenizer is None:
                    continue
                # min_tokens holds back stop strings too (vLLM): the text still grows, nothing is searched.
                check = len(state.token_ids) >= state.prepared.params.min_tokens
                if state.text.update(tokenizer, state.token_ids, check) and finish in (
                    None,
                    "length",
                    "stop",
                ):
                    if finish is None or count < len(new_ids):
                        if finish is None:
                            stopped.append(out.request_id)
                        new_ids = new_ids[:count]
                    finish, stop_reason = "stop", state.text.stop_reason
                    break
            new_logprobs = out.new_logprobs
            if new_logprobs is not None:
                new_logprobs = new_logprobs[: len(new_ids)]
                if self._decode:
                    self._name_tokens(new_logprobs)
                if state.logprobs is not None:
                    state.logprobs.extend(new_logprobs)
            if finish is not None:
                state.finish_reason, state.stop_reason = finish, stop_reason
                state.num_cached_tokens, state.metrics = out.num_cached_tokens, out.metrics
                if tokenizer is not None:
                    state.text.flush(tokenizer, state.token_ids)
                finished[out.request_id] = self.states.pop(out.request_id)
            deltas.append(
                RequestDelta(
                    out.request_id,
                    list(new_ids),
                    new_logprobs if state.logprobs is not None else None,
                    self._text_delta(out.request_id, state, finish is not None),
                    finish,
                    stop_reason,
                    out.prompt_logprobs,
                )
            )
        return deltas, stopped, finished

    def _name_tokens(self, entries: Iterable[LogprobEntry]) -> None:
        """Set decoded_token as vLLM does: the token decoded alone (a piece of a UTF-8 character shows as U+FFFD)."""
        texts, tokenizer = self._token_text, self.tokenizer
        for entry in entries:
            for token_id, logprob in entry.items():
                text = texts.get(token_id)
                if text is None:
                    text = texts[token_id] = tokenizer.decode([token_id])
                logprob.decoded_token = text

    @staticmethod
    def _text_delta(request_id: str, state: RequestState, finished: bool) -> str:
        text = state.text.visible_text(finished)
        if not finished:
            # A token that ends inside a UTF-8 character decodes to U+FFFD until the next one completes it.
            text = text.rstrip("\ufffd")
        sent = state.sent_text
        if text.startswith(sent):
            delta = text[len(sent) :]
        else:  # the decoder revised text already sent; it cannot be taken back, so send what follows
            common = 0
            while common < min(len(text), len(sent)) and text[common] == sent[common]:
                common += 1
            logger.warning("request %s: detokenized text changed after it was streamed", request_id)
            delta = text[max(common, len(sent)) :]
        state.sent_text += delta
        return delta
