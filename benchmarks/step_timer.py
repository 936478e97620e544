"""Decode throughput from the engine steps that only decode, timed one by one.

Timing a whole generate call mixes prefill into decode figures; subtracting a 1-token run from a longer one
leaves the difference of two noisy prefills, which dominated the MLA-vs-MHA table at long contexts. Here every
engine step is timed (scheduling, model, sampling and output handling included) and only the steps that carry no
prompt tokens count.
"""

import time
from collections.abc import Callable


class DecodeStepTimer:
    """Context manager over an LLMEngine: `tokens` and `seconds` of its decode-only steps while active, and
    `other_steps`, `other_seconds`, `other_tokens` of the rest (steps carrying prompt tokens, alone or mixed).

    `sync` makes the device finish its queued work before each clock read (torch.cuda.synchronize on GPU)."""

    def __init__(self, engine: object, sync: Callable[[], None] = lambda: None) -> None:
        """engine: an LLMEngine; its core's update of each step is watched to tell the decode-only steps."""
        self.engine, self.sync = engine, sync
        self.tokens, self.seconds, self.steps = 0, 0.0, 0
        self.other_tokens, self.other_seconds, self.other_steps = 0, 0.0, 0
        self._decode_only, self._rows, self._tokens = False, 0, 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def __enter__(self) -> "DecodeStepTimer":
        apply, step = self.engine.core._update, self.engine.step

        def apply_and_note(output, result):
            # The step whose tokens this call applies (with asynchronous scheduling it was queued by the call
            # before); one token per scheduled request means nobody was prefilling in it.
            self._decode_only = output.num_batched_tokens == len(output.scheduled)
            self._rows, self._tokens = len(output.scheduled), output.num_batched_tokens
            return apply(output, result)

        def timed_step(**kwargs):
            self._decode_only, self._tokens = False, 0
            self.sync()
            start = time.perf_counter()
            outputs = step(**kwargs)
            self.sync()
            if self._decode_only:
                self.seconds += time.perf_counter() - start
                self.tokens += self._rows
                self.steps += 1
            elif self._tokens:
                self.other_seconds += time.perf_counter() - start
                self.other_tokens += self._tokens
                self.other_steps += 1
            return outputs

        self.engine.core._update, self.engine.step = apply_and_note, timed_step
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.core._update, self.engine.step  # the class methods show through again
        # The figures outlive the engine: holding it would keep its KV cache allocated (the suite's MLA-vs-MHA
        # table ran out of GPU memory building its next engine that way).
        self.engine = None
