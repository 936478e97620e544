"""Output text and stop strings for one request.

Text grows incrementally, as in vLLM: each step decodes only a short window (the ids already read since the
last emitted text, plus the new ones) and appends what the window adds beyond its already-read part, once that
is no longer an incomplete UTF-8 character. Re-decoding every output id each step was quadratic in the output
length. Tokenizers that clean up spaces across tokens (" ." -> ".") can rewrite text behind the window, so they
keep the full re-decode. Only the tail that the new token could have changed is searched for stop strings.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from mlaserve.outputs import LogprobEntry

# transformers' own decode for fast tokenizers: the Rust decode plus an optional space clean-up (handled apart).
_PLAIN_DECODES = {
    "PreTrainedTokenizerBase.decode",
    "PreTrainedTokenizerFast.decode",
    "TokenizersBackend.decode",
}
_PLAIN_INNER = {"PreTrainedTokenizerFast._decode", "TokenizersBackend._decode"}


@functools.cache
def _plain_decode(cls: type) -> bool:
    """Whether the class's decode is transformers' plain wrapper of the Rust decode (asked once per class)."""
    return (
        getattr(cls.decode, "__qualname__", "") in _PLAIN_DECODES
        and getattr(getattr(cls, "_decode", None), "__qualname__", "") in _PLAIN_INNER
    )


def _window_decoder(tokenizer: object) -> Callable[..., str]:
    """The Rust tokenizer's decode where transformers' would only wrap it: two short decodes run each step, and
    the Python wrapper's overhead would otherwise outweigh the window's saving on short outputs. A tokenizer
    class that overrides decode (CodeGen, Whisper, ...) keeps its own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.decode if backend is not None and _plain_decode(type(tokenizer)) else tokenizer.decode


@dataclass(slots=True)
class RequestText:
    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    text: str = ""
    stop_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prefix_offset: int = 0  # the window starts here: ids whose text is already in `text`, kept for context
    read_offset: int = 0  # ids before this have their text in `text`

    def visible_text(self, finished: bool) -> str:
        """While running, hold back what could still become the start of a stop string (as vLLM does)."""
        if finished or not self.stop:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def update(self, tokenizer: object, output_ids: list[int], check_stop: bool = True) -> bool:
        """Refresh the text after a new token; True if a stop string now ends the output (searched only with
        check_stop: min_tokens holds stop strings back)."""
        previous = len(self.text)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self.text = tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens)
        else:
            self._append_new_text(tokenizer, output_ids)
        if not self.stop or not check_stop:
            return False
        longest = max(len(s) for s in self.stop)
        search_from = max(0, previous - longest + 1)
        hits = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        self.stop_reason = stop
        return True

    def _append_new_text(self, tokenizer: object, output_ids: list[int], force: bool = False) -> None:
        # Both decodes start at prefix_offset, so a first token's dropped leading space or a merge across the
        # boundary affects them alike and cancels out in the difference.
        decode = _window_decoder(tokenizer)
        skip = self.skip_special_tokens
        read = decode(output_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        window = decode(output_ids[self.prefix_offset :], skip_special_tokens=skip)
        # A window ending in U+FFFD may be a character cut in two: wait for its next byte (unless forced).
        if force or (len(window) > len(read) and not window.endswith("\ufffd")):
            self.text += window[len(read) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)

    def flush(self, tokenizer: object, output_ids: list[int]) -> None:
        """At the end, the held-back tail too (a character cut by max_tokens shows as U+FFFD, as in a full
        decode), unless a stop string already ended the text."""
        clean_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        if self.stop_reason is None and self.read_offset < len(output_ids) and not clean_up:
            self._append_new_text(tokenizer, output_ids, force=True)
