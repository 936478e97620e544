"""Structured outputs (a JSON schema, any JSON object, a regex, a choice, a Lark grammar) through llguidance.

Why llguidance (rather than xgrammar or outlines): it computes each step's token mask on demand from the
grammar and the tokenizer's trie, with no per-schema mask tables to wait for or to cache; it takes JSON schema,
regex and Lark grammars through one interface; it is one of the backends vLLM and SGLang ship; and it is a small
abi3 wheel with no torch or CUDA dependency, so the same wheel serves every Python and either machine.

The grammar is compiled when a request is prepared (on an intake thread in the server, never the engine's loop),
within the size caps and the deadline of grammar_limits.py; one that cannot be compiled (a bad schema or regex, a
Lark grammar with an unknown rule or too large for llguidance, a list past a cap) is the client's error, raised as
GrammarError before anything is queued. The prepared request carries a CompiledGrammar: llguidance's serialized
grammar and, in the process that compiled it, the matcher, which each request the engine adds copies. An engine
core in another process gets the text alone and rebuilds the matcher on the compiler's worker threads (llguidance
releases the GIL while it builds), so its step loop never compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from mlaserve.sampling.grammar_error import GrammarError, compile_error
from mlaserve.sampling.grammar_limits import MAX_CHOICE_ENTRIES, GrammarLimits
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

    def draft_masks(self, drafts: list[int], vocab_size: int) -> tuple[list[torch.Tensor], int]:
        """For a step that runs speculative drafts: the bitmask after each prefix of the drafts the grammar takes
        (the first before any), and how many it takes in order. The matcher ends where it began: it advances by
        the tokens the step keeps, once they are known. A draft it cannot take is only checked, never consumed:
        consuming it would leave the matcher in an error state that no rollback clears."""
        matcher = self._matcher
        valid = matcher.validate_tokens(drafts)
        masks = [self.allowed_bitmask(vocab_size)]
        for token in drafts[:valid]:
            matcher.consume_token(token)
            masks.append(self.allowed_bitmask(vocab_size))
        if valid:
            matcher.rollback(valid)
        return masks, valid

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar cannot take it (the mask allowed nothing)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class CompiledGrammar:
    """A request's compiled grammar. Its text (llguidance's serialized grammar) crosses a process boundary; the
    matcher built from it does not pickle, so it stays in the process that built it (`ready` says whether it is
    here). The template matcher is never advanced: each request gets its own copy, which costs far less than a
    compile (an n > 1 request shares one compile)."""

    __slots__ = ("kind", "text", "label", "_template")

    def __init__(self, kind: str, text: str, label: str, template: Any = None) -> None:
        self.kind = kind
        self.text = text
        self.label = label
        self._template = template

    @property
    def ready(self) -> bool:
        return self._template is not None

    def matcher(self) -> Any:
        return self._template.deep_copy()

    def __getstate__(self) -> tuple[str, str, str]:
        return (self.kind, self.text, self.label)

    def __setstate__(self, state: tuple[str, str, str]) -> None:
        self.kind, self.text, self.label = state
        self._template = None


# Compiles run here, off the thread that asked (an intake thread, or the engine core's loop): two at a time, so a
# burst of costly grammars queues here rather than taking every core from the model's step.
_COMPILE_WORKERS = 2
# On a CPU engine the step's threads and a compile share the cores; the step's threads wait for each other, so one
# of them losing its core to a compile stalls every stream. Nice compile workers yield the core (their deadline
# still holds), and no priority is raised anywhere.
_COMPILE_NICENESS = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICENESS)  # this thread alone
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: the compile runs at the process's priority


class GrammarCompiler:
    """Compiles grammars on its own worker threads. Builds llguidance's view of the tokenizer once (about a
    second for a 50k vocabulary), on first use."""

    def __init__(self, tokenizer: object | None, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError(
                "structured outputs need a tokenizer; they are not available with skip_tokenizer_init"
            )
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._pool = ThreadPoolExecutor(
            _COMPILE_WORKERS, thread_name_prefix="mlaserve-grammar", initializer=_lower_priority
        )

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

    def compile(
        self, params: StructuredOutputsParams, limits: GrammarLimits | None = None
    ) -> CompiledGrammar:
        """The compiled grammar; GrammarError (a ValueError) naming the problem if it is past a cap of `limits`,
        cannot be built, or is not built within their deadline. The caller waits; the compile runs on a worker."""
        limits = limits or GrammarLimits()
        limits.check(params)
        future = self._pool.submit(self._compile, params)
        try:
            return future.result(timeout=limits.compile_timeout_s)
        except FutureTimeout:
            future.cancel()  # one still queued never starts; a started one ends on its worker, unread
            raise limits.deadline_error(params.kind) from None

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind = params.kind
        try:
            text = grammar_text(params)
        except (ValueError, TypeError, RuntimeError) as e:
            raise compile_error(kind, str(e)) from None
        compiled = CompiledGrammar(kind, text, grammar_label(params))
        self._build(compiled)
        return compiled

    def _build(self, compiled: CompiledGrammar) -> None:
        """The matcher from the serialized text. Building it is the whole compile: llguidance's validate_grammar
        passes grammars whose symbol table then overflows here."""
        if compiled.ready:
            return
        llg = _llguidance()
        tokenizer = self._ll()
        try:
            matcher = llg.LLMatcher(tokenizer, compiled.text)
        except (ValueError, TypeError, RuntimeError) as e:
            raise compile_error(compiled.kind, str(e)) from None
        if matcher.is_error():
            raise compile_error(compiled.kind, matcher.get_error())
        compiled._template = matcher

    def build_async(self, compiled: CompiledGrammar) -> Future:
        """Rebuild the matcher of a grammar compiled in another process (its text already passed the caps and
        the deadline there), on a worker; the future's result is None, or the GrammarError."""
        return self._pool.submit(self._build, compiled)

    def new(self, compiled: CompiledGrammar) -> Grammar:
        """A request's own matcher; builds it here if `compiled` came from another process."""
        self._build(compiled)
        words = _llguidance().torch.get_bitmask_shape(1, self._ll().vocab_size)[1]
        return Grammar(compiled.matcher(), words, compiled.label)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["MAX_CHOICE_ENTRIES", "CompiledGrammar", "Grammar", "GrammarCompiler", "GrammarError"]
