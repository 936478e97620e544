"""Structured outputs (a JSON schema, any JSON object, a regex, a choice, a Lark grammar) through llguidance.

Why llguidance (rather than xgrammar or outlines): it computes each step's token mask on demand from the
grammar and the tokenizer's trie, with no per-schema compile step to wait for or to cache; it takes JSON schema,
regex and Lark grammars through one interface; it is one of the backends vLLM and SGLang ship; and it is a small
abi3 wheel with no torch or CUDA dependency, so the same wheel serves every Python and either machine.

The grammar is checked when a request is prepared (a bad schema is the client's error, before anything is
queued); each request then gets its own matcher, which the runner advances with every sampled token.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from mlaserve.sampling_params import StructuredOutputsParams


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise ValueError(
            "structured outputs (response_format, structured_outputs) need the llguidance package, which is not "
            "installed here: pip install llguidance"
        ) from None
    return llguidance


# JSON is written one way, with json.dumps' default separators: with free whitespace a model (or a random one in a
# test) can fill max_tokens with blanks and never close the object. A schema's own "x-guidance" can override it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The request's grammar in llguidance's serialized form."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
    if kind == "regex":
        return llg.grammar_from("regex", params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(params.choice))
    return llg.grammar_from("lark", params.grammar)


class Grammar:
    """One request's matcher: which tokens may come next, advanced by each token the request keeps."""

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self._words = words

    def allowed_bitmask(self, vocab_size: int) -> torch.Tensor:
        llg = _llguidance()
        bitmask = torch.zeros(1, self._words, dtype=torch.int32)
        llg.torch.fill_next_token_bitmask(self._matcher, bitmask, 0)
        return bitmask[0, : -(-vocab_size // 32)]

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar cannot take it (the mask allowed nothing)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Builds llguidance's view of the tokenizer once (about a second for a 50k vocabulary), on first use."""

    def __init__(self, tokenizer: object | None, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer; they are not available with skip_tokenizer_init"
            )
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None

    def _ll(self) -> Any:
        if self._ll_tokenizer is None:
            llg = _llguidance()
            try:
                self._ll_tokenizer = llg.hf.from_tokenizer(self._tokenizer, n_vocab=self._vocab_size)
            except Exception as e:  # noqa: BLE001 - llguidance reads many tokenizer layouts, not all
                raise ValueError(
                    f"structured outputs are not available for this model's tokenizer (llguidance: {e})"
                ) from None
        return self._ll_tokenizer

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raises ValueError naming the problem if the grammar cannot be used."""
        llg = _llguidance()
        try:
            text = grammar_text(params)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured output ({params.kind}) is not a valid grammar: {e}") from None
        error = llg.LLMatcher.validate_grammar(text, self._ll())
        if error:
            raise ValueError(f"structured output ({params.kind}) is not a valid grammar: {error}")

    def new(self, params: StructuredOutputsParams) -> Grammar:
        llg = _llguidance()
        tokenizer = self._ll()
        matcher = llg.LLMatcher(tokenizer, grammar_text(params))
        if matcher.is_error():
            raise ValueError(f"structured output ({params.kind}): {matcher.get_error()}")
        words = llg.torch.get_bitmask_shape(1, tokenizer.vocab_size)[1]
        return Grammar(matcher, words)
