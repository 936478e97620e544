"""What the routes of one server share: engine, settings, metrics, admission (draining, concurrency limit)."""

from __future__ import annotations

import time
from collections.abc import Callable

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.sampling.grammar_limits import GrammarLimits
from mlaserve.server.body import check_json_content_type, parse_json_object, read_body
from mlaserve.server.errors import OpenAIError
from mlaserve.server.intake import ServerIntake
from mlaserve.server.logprobs import TokenTexts
from mlaserve.server.metrics import ServerMetrics
from mlaserve.server.parsers import server_parsers
from mlaserve.server.shared_count import ServerCounts

_PARSE_INLINE_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class ServerState:
    def __init__(
        self,
        engine: AsyncEngine,
        settings: ServerSettings,
        startup_report: dict,
        counts: ServerCounts | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.startup_report = startup_report
        self.created = int(time.time())
        self.draining = False  # set once shutdown begins: health 503, new /v1 calls 503
        # What max_concurrent_requests and max_connections are held to: every API-server process's together.
        self.counts = counts or ServerCounts.for_processes(1)
        # Sequences this process admitted and has not yet answered (event-loop side only): what its drain waits for.
        self.in_flight = 0
        self.metrics = ServerMetrics(
            engine.stats,
            lambda: engine.is_alive,
            settings.served_model_name,
            engine.model_config.max_model_len,
            self.counts,
        )
        # A core in its own process leaves the tokenizer to this process alone: no copy needed.
        limits = GrammarLimits(
            settings.grammar_max_choices,
            settings.grammar_max_choice_bytes,
            settings.grammar_max_bytes,
            settings.grammar_compile_timeout_s,
        )
        self.intake = ServerIntake(
            engine, share_tokenizer=not hasattr(engine, "engine"), grammar_limits=limits
        )
        self.token_texts = TokenTexts(self.intake)
        self.parsers = server_parsers(settings, engine.model_config, self.intake.tokenizer)
        self.connection_limits = None  # ConnectionLimits, set by serve() (tests may run without)

    @property
    def healthy(self) -> bool:
        return self.engine.is_alive and not self.draining

    def count_request(self, path: str, status: str) -> None:
        if path in GENERATION_PATHS:
            self.metrics.count(status)

    def check_accepting(self) -> None:
        if self.draining:
            raise OpenAIError(
                503,
                "the server is shutting down and takes no new requests",
                code="server_shutting_down",
                headers={"Retry-After": "5", "Connection": "close"},
                status="unavailable",
            )
        if not self.engine.is_alive:
            raise OpenAIError(503, "the engine loop is not running", code="engine_dead", status="error")

    def admit(self, sequences: int = 1) -> Callable[[], None]:
        """Take `sequences` of the server's concurrency slots (one per sequence the request generates: prompts x n)
        or raise 429; returns the (idempotent) release. A request that could never fit is a 400 naming n."""
        self.check_accepting()
        limit = self.settings.max_concurrent_requests
        if sequences > limit:
            raise OpenAIError(
                400,
                f"this request asks for {sequences} sequences (prompts x n), more than max_concurrent_requests="
                f"{limit} can ever run at once",
                "n",
            )
        if not self.counts.sequences.try_acquire(sequences, limit):
            raise OpenAIError(
                429,
                f"too many sequences in flight on this server (max_concurrent_requests={limit}); retry shortly",
                code="too_many_requests",
                headers={"Retry-After": "1"},
                status="throttled",
            )
        self.in_flight += sequences
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= sequences
                self.counts.sequences.release(sequences)

        return release

    async def read_json(self, request: object) -> dict:
        """The request's body as a JSON object (4xx otherwise). A large body is parsed and checked on an intake
        thread, so the event loop keeps streaming other requests' tokens meanwhile."""
        settings = self.settings
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        # Checked once the body is read, as every refusal is: a client still sending is never reset.
        check_json_content_type(request.headers.get("content-type"))
        if len(raw) < _PARSE_INLINE_BYTES:
            return parse_json_object(raw)
        return await self.intake.run(lambda _: parse_json_object(raw))

    def check_model(self, name: str | None) -> None:
        served = self.settings.served_model_name
        if name is not None and name != served:
            raise OpenAIError(
                404,
                f"the model '{name}' does not exist; this server serves '{served}'",
                "model",
                "model_not_found",
            )
