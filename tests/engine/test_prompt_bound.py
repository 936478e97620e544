"""The piecewise token count: never above the true count, and it refuses a megabyte prompt in milliseconds."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlaserve.engine.intake import RequestIntake
from mlaserve.engine.prompt_bound import PromptBound
from mlaserve.sampling_params import SamplingParams

LONG_TOKEN = "x" * 300  # defeats the bytes-per-token bound: 1 MB / 300 bytes is far below the limit below


def random_text(rng: random.Random, chars: int) -> str:
    pieces = ["ab", "cd", "the", "1234", ",", ".", "  ", "\n", "(x)", "'s", "é", "中文", "-", "_", "!?"]
    out: list[str] = []
    size = 0
    while size < chars:
        out.append(rng.choice(pieces) + rng.choice([" ", "", "", "\n", "  "]))
        size += len(out[-1])
    return "".join(out)[:chars]


def byte_bpe(use_regex: bool = True, normalizer: object | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on random text (so merges cross characters), with one very long token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    rng = random.Random(0)
    tok.train_from_iterator([random_text(rng, 2000) for _ in range(50)], trainer)
    tok.add_tokens([LONG_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return byte_bpe()


def test_the_count_equals_the_whole_texts_when_nothing_stops_it(tokenizer):
    bound = PromptBound.for_tokenizer(tokenizer)
    assert bound is not None
    rng = random.Random(1)
    for chars in (50, 1500, 5000, 20000):
        text = random_text(rng, chars)
        whole = len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        assert bound.tokens_at_least(text, 10**9) == whole
        # Stopped at a limit: at least the limit, never more than the true count.
        assert min(whole, 100) <= bound.tokens_at_least(text, 100) <= whole


def test_tokenizers_that_may_not_cut_at_spaces_get_no_bound():
    assert PromptBound.for_tokenizer(byte_bpe(use_regex=False)) is None
    assert PromptBound.for_tokenizer(byte_bpe(normalizer=normalizers.Lowercase())) is None
    assert PromptBound.for_tokenizer(None) is None


def test_a_megabyte_prompt_is_refused_in_milliseconds(tokenizer):
    config = SimpleNamespace(max_model_len=8192, vocab_size=len(tokenizer))
    intake = RequestIntake(tokenizer, config, lambda: None)
    prompt = random_text(random.Random(2), 1_000_000)
    intake.prepare("warm up", SamplingParams())
    started = time.perf_counter()
    with pytest.raises(ValueError, match="max_model_len=8192") as error:
        intake.prepare(prompt, SamplingParams())
    assert time.perf_counter() - started < 0.1
    assert "at least" in str(error.value)
    # A prompt under the limit that passes the character check is tokenized whole as before.
    short = "the cd ab " * 1800
    assert len(short) > 2 * 8192 and len(tokenizer.encode(short)) < 8192
    prepared = intake.prepare(short, SamplingParams())
    assert prepared.prompt_token_ids == tokenizer.encode(short)
