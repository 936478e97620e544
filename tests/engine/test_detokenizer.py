"""Incremental detokenization gives, step by step, prefixes of the full decode and, at the end, exactly it."""

import random

import pytest

from mlaserve.engine.detokenizer import RequestText
from mlaserve.loader.model_files import default_model_path, resolve_model
from mlaserve.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(resolve_model(str(default_model_path())))


def stream(
    tokenizer, ids: list[int], skip: bool, stop: list[str] | None = None
) -> tuple[RequestText, list[str]]:
    text = RequestText(stop or [], False, skip)
    seen = []
    for i in range(1, len(ids) + 1):
        if text.update(tokenizer, ids[:i]):
            break
        seen.append(text.text)
    text.flush(tokenizer, ids)
    return text, seen


PIECES = ["héllo ", "wörld", " 日本語", "😀", " x", "é", "\n", "  ", "ß", "test.", " <|im_end|>"]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_the_full_decode(smol_tokenizer, seed):
    rng = random.Random(seed)
    if seed % 2:  # any ids at all, special tokens and stray UTF-8 bytes included
        ids = [rng.randrange(len(smol_tokenizer)) for _ in range(40)]
    else:  # text with multi-byte characters split across byte-level tokens
        ids = smol_tokenizer.encode("".join(rng.choice(PIECES) for _ in range(20)), add_special_tokens=False)
    for skip in (True, False):
        text, seen = stream(smol_tokenizer, ids, skip)
        full = smol_tokenizer.decode(ids, skip_special_tokens=skip)
        assert text.text == full
        assert all(full.startswith(partial) for partial in seen)


def test_a_character_cut_by_the_last_token_is_flushed_as_the_full_decode_shows_it(smol_tokenizer):
    ids = smol_tokenizer.encode("ab😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's bytes span several tokens; stop before the last one
    text, seen = stream(smol_tokenizer, cut, skip=True)
    assert "\ufffd" not in "".join(seen)  # held back while it could still complete
    assert text.text == smol_tokenizer.decode(cut, skip_special_tokens=True)


def test_stop_string_still_ends_the_text(smol_tokenizer):
    ids = smol_tokenizer.encode("one two three four", add_special_tokens=False)
    text, _ = stream(smol_tokenizer, ids, skip=True, stop=[" three"])
    assert text.text == "one two" and text.stop_reason == " three"


def test_a_tokenizer_with_its_own_decode_keeps_it():
    class Custom:  # a backend is there, but this class decodes its own way
        backend_tokenizer = object()

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    text, seen = stream(Custom(), [0, 1, 2, 25], skip=True)
    assert text.text == "abcz" and seen == ["a", "ab", "abc", "abcz"]
