"""A lower bound on a long prompt's token count from its first pieces, so a prompt far past max_model_len is
refused after tokenizing about max_model_len tokens of it rather than all of it.

A tokenizer's model (BPE, WordLevel, Unigram) works on each pre-token alone, so where the text is cut at a boundary
the pre-tokenizer itself would draw, the pieces' tokens are the whole text's tokens, and the tokens counted so far
never exceed the whole's. The cut is placed before a space that follows a non-space character: a word, number or
punctuation run ends there in the splitting rules of GPT-2, Llama 3, Qwen and SmolLM2, and in whitespace splitting.
Whether a tokenizer really cuts there is checked on a probe text when the intake starts, not assumed from its type;
one that does not (no pre-tokenizer, a normalizer, an added token holding a space) gets no bound and is tokenized
whole, as before.
"""

from __future__ import annotations

from collections.abc import Iterator

# A space-free stretch this long ends the search for a cut: the rest is tokenized whole (on a worker thread).
_MAX_CUT_SEARCH_CHARS = 65_536
_PROBE = "ab cd, ef  12 gh. ij\nkl (mn) 'op' x1 y2z 345678 q.r s- t_u v,w"


class PromptBound:
    """Counts a text's tokens piece by piece until the count reaches a limit."""

    def __init__(self, backend: object) -> None:
        self._backend = backend

    @classmethod
    def for_tokenizer(cls, tokenizer: object | None) -> PromptBound | None:
        """A bound for this tokenizer, or None where its pre-tokenizer does not cut where the bound would."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
            return None
        added = backend.get_added_tokens_decoder().values()
        if any(" " in token.content for token in added):
            return None
        bound = cls(backend)
        spans = list(_pieces(_PROBE, 4))
        # No pre-token may straddle a cut, and the pieces' tokens must be the whole's (a pre-tokenizer may mark
        # where a text starts, which a piece would then get again).
        words = backend.pre_tokenizer.pre_tokenize_str(_PROBE)
        if any(s < cut < e for _, (s, e) in words for _, cut in spans):
            return None
        whole = backend.encode(_PROBE, add_special_tokens=False).ids
        pieces = [bound._count_ids(_PROBE[a:b]) for a, b in spans]
        return bound if [t for p in pieces for t in p] == whole else None

    def _count_ids(self, text: str) -> list[int]:
        # The batch call releases the GIL (see intake.py), so counting stalls no other thread.
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def tokens_at_least(self, text: str, limit: int) -> int:
        """A count of the text's tokens that is at most the true count, and at least `limit` whenever the text
        holds `limit` tokens or more and can be cut. The first piece is `limit` characters; each next one is sized
        from the characters per token seen so far to reach the limit, with a quarter more, so a text past the
        limit is usually refused after two pieces."""
        counted, start, size = 0, 0, max(limit, 1024)
        while start < len(text) and counted < limit:
            end = _cut(text, start + size)
            if end is None:
                break
            counted += len(self._count_ids(text[start:end]))
            start = end
            size = max(1024, int((limit - counted) * start / max(counted, 1) * 1.25))
        return counted


def _pieces(text: str, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) spans covering `text`, each ending at a cut (see the module docstring) at or past `size`
    characters from its start; the last one ends where the text does, or at a space-free stretch that is too long."""
    start = 0
    while start < len(text):
        end = _cut(text, start + size)
        if end is None:
            return
        yield start, end
        start = end


def _cut(text: str, at: int) -> int | None:
    """The first cut at or after `at` (the text's end if none follows); None past a long space-free stretch."""
    if at >= len(text):
        return len(text)
    limit = at + _MAX_CUT_SEARCH_CHARS
    i = text.find(" ", at)
    while i != -1 and i < limit:
        if not text[i - 1].isspace():
            return i
        i = text.find(" ", i + 1)
    return len(text) if limit >= len(text) and i == -1 else None
