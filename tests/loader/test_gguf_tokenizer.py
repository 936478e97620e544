"""Our GGUF tokenizer against transformers' own GGUF conversion: same ids, decode and chat template."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from mlaserve.loader import gguf_bpe_tokenizer
from mlaserve.loader.gguf_reader import gguf_tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "ünïcödé café naïve Ελληνικά 日本語 한국어 עברית",
    "emoji 🤗🚀👍🏽 and a family 👨‍👩‍👧",
    "def square(x: int) -> int:\n\treturn x ** 2  # why not\n",
    "numbers 12345 3.14159 -42 1,000,000 2024-11-29 0x1F",
    "   many    spaces\n\n\n\ttabs\r\n  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "glued<|im_start|>special<|im_end|>tokens",
    "<repo_name>x<file_sep>y<jupyter_code>",
    "it's we'll they're I'M YOU'VE",
    "\u00a0non\u2003breaking\u200bzero-width",
    "\x00\x01 control chars \x7f",
    "",
    " ",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
    ],
]


def _transformers_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="module")
def ours(smollm_path: Path) -> PreTrainedTokenizerBase:
    return gguf_tokenizer(smollm_path)


@pytest.fixture(scope="module")
def reference(smollm_path: Path) -> PreTrainedTokenizerBase:
    """transformers' GGUF tokenizer: about 8-13 s to build, so once per module."""
    return _transformers_tokenizer(smollm_path)


def test_build_is_fast(smollm_path: Path) -> None:
    gguf_tokenizer(smollm_path)  # imports and page cache warm
    start = time.perf_counter()
    gguf_tokenizer(smollm_path)
    assert time.perf_counter() - start < 3.0


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_transformers(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase, text: str
) -> None:
    ids = ours(text).input_ids
    assert ids == reference(text).input_ids
    assert ours.decode(ids) == reference.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_batch_and_vocab_match_transformers(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase
) -> None:
    assert ours(TEXTS).input_ids == reference(TEXTS).input_ids
    assert ours.get_vocab() == reference.get_vocab()
    assert len(ours) == len(reference) == 49152


@pytest.mark.slow
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_matches_transformers(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> None:
    def render(tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> Any:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)

    assert render(ours, tokenize=False) == render(reference, tokenize=False)
    assert render(ours, tokenize=True).input_ids == render(reference, tokenize=True).input_ids


@pytest.mark.slow
def test_special_tokens_match_transformers(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase
) -> None:
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.convert_tokens_to_ids("<|im_start|>") == 1
    assert ours.add_bos_token is False


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm"])
def test_synthetic_files_match_transformers(
    gguf_writer: Any, tiny_bpe: tuple[list[str], list[int], list[str]], pre: str
) -> None:
    """Split patterns, add_bos, user-defined tokens and a mislabelled control token, on a tiny vocab."""
    tokens, types, merges = tiny_bpe
    tokens, types = [*tokens, "<think>", "<| pad |>"], [*types, 4, 3]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ bos_token + m['content'] }}{% endfor %}",
    }
    path = gguf_writer(f"tiny-{pre}.gguf", "qwen2", metadata)
    ours, reference = gguf_tokenizer(path), _transformers_tokenizer(path)

    texts = [*TEXTS, "I <think>hard</think> about 1234567 things\n\n\n  ok", "don't DON'T 12 345"]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids), text
    assert ours("x").input_ids[0] == 1  # add_bos_token from the metadata
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
        messages, tokenize=False
    )


def test_unverified_pre_tokenizer_falls_back_to_transformers(
    gguf_writer: Any, tiny_bpe: tuple[list[str], list[int], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, types, merges = tiny_bpe
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "tekken",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
    }
    path = gguf_writer("tekken.gguf", "llama", metadata)
    reasons: list[str] = []
    monkeypatch.setattr(gguf_bpe_tokenizer, "_fallback", lambda _path, reason: reasons.append(reason))
    gguf_tokenizer(path)
    assert reasons and "tekken" in reasons[0]
