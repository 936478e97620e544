"""A fast tokenizer built straight from a GGUF file's `tokenizer.ggml.*` metadata.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` takes 8-13 s for SmolLM2; building the same
`tokenizers` pipeline here takes well under a second. The result is meant to be token-for-token what
transformers' GGUF converter builds (tests/loader checks ids, decode and chat template against it), so
its choices are mirrored on purpose (see `_PRE_TOKENIZERS`).
Files outside the verified subset fall back to transformers rather than risk a silently different split.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from mlaserve.loader.gguf_metadata import read_gguf_header

logger = logging.getLogger(__name__)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizer split patterns, keyed by `tokenizer.ggml.pre`; None is GPT-2's built-in ByteLevel regex,
# which transformers uses for every pre type it has no pattern for. For "smollm" llama.cpp also splits
# digits one by one; SmolLM2's vocabulary has no token with two digits or a space before a digit, so the
# ids agree either way.
_GPT2_REGEX = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str | None, str | None] = {
    None: _GPT2_REGEX,
    "default": _GPT2_REGEX,
    "gpt-2": _GPT2_REGEX,
    "smollm": _GPT2_REGEX,
    "starcoder": _GPT2_REGEX,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def _byte_spelling() -> tuple[str, ...]:
    """GPT-2's byte -> printable character table, the alphabet byte-level vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved, in byte
    order, to code points from 256 up so that every byte has a visible, unambiguous character.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = {b: chr(b) for b in printable}
    moved = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return tuple(spelling[b] for b in range(256))


def _byte_level(token: str, alphabet: frozenset[str]) -> str:
    # Some converters store added tokens as plain text; the BPE model only ever sees byte-spelled pieces.
    if set(token) <= alphabet:
        return token
    spelling = _byte_spelling()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(split_pattern: str | None) -> pre_tokenizers.PreTokenizer:
    if split_pattern is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _fallback(path: Path, reason: str) -> PreTrainedTokenizerBase:
    logger.warning("building the tokenizer of %s with transformers (slow): %s", path, reason)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def _special_token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return tokens[token_id] if token_id is not None and token_id < len(tokens) else None


def build_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The file's byte-level BPE tokenizer, or transformers' own build for other kinds of file."""
    path = Path(path)
    meta = read_gguf_header(path).metadata
    pre = meta.get("tokenizer.ggml.pre")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return _fallback(path, f"tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}, not 'gpt2'")
    if pre not in _PRE_TOKENIZERS:
        return _fallback(
            path, f"tokenizer.ggml.pre {pre!r} is not in the verified set {sorted(map(str, _PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in meta:
        return _fallback(path, "the file has no tokenizer.ggml.merges")

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = frozenset(_byte_spelling())
    vocab = {_byte_level(token, alphabet): index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]

    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole, never through BPE. One spelled outside the byte
    # alphabet is a mislabel that would grow the vocabulary past the embedding, so it is left out.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    backend.add_special_tokens(control)
    # user-defined tokens (like <think>) also match whole in llama.cpp, but are ordinary text when decoding
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types)
            if kind == _USER_DEFINED and token in vocab
        ]
    )

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_special_token(tokens, meta, "bos_token_id"),
        eos_token=_special_token(tokens, meta, "eos_token_id"),
        unk_token=_special_token(tokens, meta, "unknown_token_id"),
        pad_token=_special_token(tokens, meta, "padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
