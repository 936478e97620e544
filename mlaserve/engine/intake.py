"""Request intake: validate and tokenize a prompt with no engine state, so it can run off the engine's thread.

The offline engine calls it in line; the server calls it on worker threads with a tokenizer of its own, so a
large prompt never delays a step. Hugging Face's fast tokenizers hold Python's GIL in `encode` but release it in
their batch call, so text is tokenized as a batch of one: a 1 MB prompt then stalls no other thread (measured on
SmolLM2's tokenizer: a Python loop in another thread waited 0.70 s with `encode`, 0.02 s with the batch call).
A prompt whose UTF-8 length alone proves it is too long is refused before it is tokenized at all; a long one that
passes that check is counted piece by piece (prompt_bound.py) and refused once the count reaches max_model_len, so
a prompt of a megabyte costs about max_model_len tokens of work, not all of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlaserve.config.model_config import ModelConfig
from mlaserve.engine.prompt_bound import PromptBound
from mlaserve.sampling.grammar_limits import GrammarLimits
from mlaserve.sampling.structured_output import CompiledGrammar, GrammarCompiler
from mlaserve.sampling_params import SamplingParams


def _plain_encodes() -> tuple:
    """transformers' own encode of fast tokenizers, which is the Rust encode plus bookkeeping; a tokenizer class
    that overrides encode keeps its own (and holds the GIL)."""
    from transformers import PreTrainedTokenizerBase

    return (PreTrainedTokenizerBase.encode,)


_PLAIN_ENCODES = _plain_encodes()


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request that has not touched the engine yet."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # Set when params has structured_outputs: compiled here, so the engine's loop only copies its matcher.
    grammar: CompiledGrammar | None = None


class RequestIntake:
    def __init__(
        self,
        tokenizer: object | None,
        model_config: ModelConfig,
        grammar_compiler: Callable[[], GrammarCompiler],
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.grammar_compiler = grammar_compiler
        self.grammar_limits = grammar_limits or GrammarLimits()
        self._max_token_bytes = _max_token_bytes(tokenizer)
        self._bound = PromptBound.for_tokenizer(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; never holds the GIL long (see the module docstring)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and type(self.tokenizer).encode in _PLAIN_ENCODES:
            return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prepare(self, prompt: str | dict, params: SamplingParams) -> PreparedRequest:
        """Validate and tokenize without side effects, so a bad request in a batch starts no work."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init pass prompt_token_ids")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; with skip_tokenizer_init use stop_token_ids")
        limit = self.model_config.max_model_len
        if isinstance(prompt, str):
            self._check_length_bound(prompt, limit)
            text, ids = prompt, self.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise TypeError("a prompt is a str or a dict with 'prompt_token_ids'")
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= limit:  # before the per-token check: a huge prompt costs no Python loop
            raise ValueError(
                f"the prompt has {len(ids)} tokens; it must be shorter than max_model_len={limit}"
            )
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler().compile(params.structured_outputs, self.grammar_limits)
        return PreparedRequest(text, ids, params, grammar)

    def _check_length_bound(self, text: str, limit: int) -> None:
        if self._max_token_bytes is not None:
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            at_least = -(-num_bytes // self._max_token_bytes)
            if at_least >= limit:
                raise ValueError(
                    f"the prompt has at least {at_least} tokens ({num_bytes} bytes, and no token covers more "
                    f"than {self._max_token_bytes}); it must be shorter than max_model_len={limit}"
                )
        # A prompt of fewer characters than this rarely holds max_model_len tokens: it is tokenized once, whole.
        if self._bound is not None and len(text) > 2 * limit:
            at_least = self._bound.tokens_at_least(text, limit)
            if at_least >= limit:
                raise ValueError(
                    f"the prompt has at least {at_least} tokens (counted up to the limit); it must be shorter "
                    f"than max_model_len={limit}"
                )


def _max_token_bytes(tokenizer: object | None) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, where that bounds the token count: tokenizers with
    no normalizer (byte-level BPE: GPT-2, Llama 3, Qwen, DeepSeek, SmolLM2) only split the text, so n bytes make
    at least n / this many tokens. Token strings are written in an alphabet at least as long as the bytes they
    stand for (byte-level characters, byte-fallback <0xNN>, sentencepiece's 3-byte space), so their UTF-8
    length bounds it safely. None (no bound) for tokenizers that may shrink text first."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=None) or None
