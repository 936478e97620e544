"""Structured outputs (a JSON schema, any JSON object, a regex, a choice, a Lark grammar) through llguidance.

Why llguidance (rather than xgrammar or outlines): it computes each step's token mask on demand from the
grammar and the tokenizer's trie, with no per-schema mask tables to wait for or to cache; it takes JSON schema,
regex and Lark grammars through one interface; it is one of the backends vLLM and SGLang ship; and it is a small
abi3 wheel with no torch or CUDA dependency, so the same wheel serves every Python and either machine.

The grammar is compiled when a request is prepared, so one that cannot be compiled (a bad schema or regex, a
Lark grammar with an unknown rule or too large for llguidance, a choice list past MAX_CHOICE_ENTRIES) is the
client's error, raised as GrammarError before anything is queued; each request then gets its own matcher, which
the runner advances with every sampled token.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from mlaserve.sampling.grammar_error import GrammarError, compile_error
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


# A choice list is compiled as one regex alternation (choice_regex), whose compile time grows with its length; the
# engine core compiles each request's grammar on its own thread, so a longer list would pause every stream.
MAX_CHOICE_ENTRIES = 10_000
# Rust regex's metacharacters outside a character class; every other character stands for itself.
_REGEX_META = frozenset("\\.+*?()|[]{}^$")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices`. llguidance's own "choice" grammar makes one Earley alternative
    per entry: a list past its max_items_in_row fails at the first token (and the constraint is then dropped),
    and a longer one overflows its symbol table. One alternation is a single lexeme, with neither limit."""
    return "(?:" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in x) for x in choices) + ")"


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
        return llg.grammar_from("regex", choice_regex(params.choice))
    return llg.grammar_from("lark", params.grammar)


def source_text(params: StructuredOutputsParams) -> str:
    """What the client wrote for its constraint, as one string (for its size and hash)."""
    kind = params.kind
    if kind == "json":
        return params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    if kind == "choice":
        return "\n".join(params.choice)
    return {"regex": params.regex, "grammar": params.grammar}.get(kind) or ""


def grammar_label(params: StructuredOutputsParams) -> str:
    """How logs name a grammar: its kind, size and a short hash. Never its text: a grammar can be megabytes of a
    client's data, and a log line per request would copy it."""
    text = source_text(params).encode("utf-8", "surrogatepass")
    return f"{params.kind}, {len(text)} bytes, sha256 {hashlib.sha256(text).hexdigest()[:12]}"


class Grammar:
    """One request's matcher: which tokens may come next, advanced by each token the request keeps."""

    def __init__(self, matcher: Any, words: int, label: str = "") -> None:
        self._matcher = matcher
        self._words = words
        self.label = label

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

    def compile(self, params: StructuredOutputsParams) -> Any:
        """llguidance's matcher for this grammar; GrammarError (a ValueError) naming the problem if it cannot be
        built. Building the matcher is the whole compile: llguidance's validate_grammar passes grammars whose
        symbol table then overflows here."""
        kind = params.kind
        if kind == "choice" and len(params.choice) > MAX_CHOICE_ENTRIES:
            raise GrammarError(
                kind,
                f"{len(params.choice)} entries is more than the {MAX_CHOICE_ENTRIES} a choice list may hold",
            )
        llg = _llguidance()
        tokenizer = self._ll()
        try:
            text = grammar_text(params)
            matcher = llg.LLMatcher(tokenizer, text)
        except (ValueError, TypeError, RuntimeError) as e:
            raise compile_error(kind, str(e)) from None
        if matcher.is_error():
            raise compile_error(kind, matcher.get_error())
        return matcher

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raises GrammarError naming the problem if the grammar cannot be used."""
        self.compile(params)

    def new(self, params: StructuredOutputsParams) -> Grammar:
        llg = _llguidance()
        matcher = self.compile(params)
        words = llg.torch.get_bitmask_shape(1, self._ll().vocab_size)[1]
        return Grammar(matcher, words, grammar_label(params))
