"""The server's request intake: tokenizing, chat templates and token texts on worker threads, never the engine's.

The engine's thread steps the model; anything it does between steps delays every stream's next token. A copy of
the tokenizer serves these threads, so the engine's own (detokenizing outputs) is never used by two threads.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from mlaserve.engine.intake import RequestIntake
from mlaserve.sampling.grammar_limits import GrammarLimits

T = TypeVar("T")


class ServerIntake:
    def __init__(
        self,
        engine: object,
        workers: int = 2,
        share_tokenizer: bool = False,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        """engine: AsyncEngine or CoreProcessClient (model_config, tokenizer, grammar_compiler). The tokenizer is
        copied unless share_tokenizer (it already belongs to this process's server alone). Grammars compile on
        the compiler's own threads; an intake thread waits for them, within grammar_limits' deadline."""
        tokenizer = engine.tokenizer
        if tokenizer is not None and not share_tokenizer:
            tokenizer = copy.deepcopy(tokenizer)
        self.intake = RequestIntake(tokenizer, engine.model_config, engine.grammar_compiler, grammar_limits)
        self.max_model_len = engine.model_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mlaserve-intake")

    @property
    def tokenizer(self) -> object | None:
        return self.intake.tokenizer

    async def run(self, fn: Callable[[RequestIntake], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.intake)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
