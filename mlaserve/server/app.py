"""The FastAPI apps: the OpenAI API (with /health and /metrics), and an ops-only app for a separate port."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mlaserve.config.server_settings import ServerSettings
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.server.auth import api_key_dependency
from mlaserve.server.body import sequences_asked
from mlaserve.server.chat import create_chat_completion
from mlaserve.server.completions import create_completion
from mlaserve.server.errors import install_error_handlers
from mlaserve.server.responses import create_response
from mlaserve.server.shared_count import ServerCounts
from mlaserve.server.sse import EventStreamResponse
from mlaserve.server.state import ServerState
from mlaserve.server.tokenization import detokenize, tokenize, tokenizer_info, version

Handler = Callable[[ServerState, Request, dict, float], Awaitable[Response]]


def build_app(
    engine: AsyncEngine, settings: ServerSettings, startup_report: dict, counts: ServerCounts | None = None
) -> FastAPI:
    """`counts`: what this app's limits are held to, shared with the server's other API-server processes (None:
    this app's own)."""
    state = ServerState(engine, settings, startup_report, counts)
    # No docs pages, and the schema only behind the API key (below): it lists every route to someone probing.
    app = FastAPI(title="mlaserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.count_request = state.count_request
    install_error_handlers(app)
    _add_ops_routes(app, state)

    auth = [Depends(api_key_dependency(settings.api_keys))]
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    # vLLM's tokenizer endpoints sit outside /v1; they take the same keys (they use the engine's thread).
    tokens = APIRouter(dependencies=auth)

    @tokens.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        state.check_accepting()
        return await tokenize(state, request)

    @tokens.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        state.check_accepting()
        return await detokenize(state, request)

    @tokens.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        state.check_accepting()
        return await tokenizer_info(state)

    @tokens.get("/openapi.json", include_in_schema=False)
    async def openapi_route() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/version")
    async def version_route() -> dict:
        return version()

    @v1.get("/models")
    async def list_models() -> dict:
        state.check_accepting()
        card = {
            "id": settings.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "mlaserve",
            "max_model_len": engine.model_config.max_model_len,
            "mlaserve": startup_report,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, create_completion)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, create_chat_completion)

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        return await _generate(state, request, create_response)

    app.include_router(v1)
    app.include_router(tokens)
    return app


def build_ops_app(app: FastAPI) -> FastAPI:
    """/health and /metrics of `app`'s server, for a port that stays inside the cluster (no auth, no /v1)."""
    ops = FastAPI(title="mlaserve-ops", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(ops)
    _add_ops_routes(ops, app.state.server)
    return ops


async def _generate(state: ServerState, request: Request, handler: Handler) -> Response:
    """Body first, then a concurrency slot (the server's, shared by its API-server processes): a slow body holds no
    slot, and every answer (429 and the draining 503 included) comes after the body was read, so closing the
    connection never resets a client still sending."""
    arrival = time.monotonic()
    body = await state.read_json(request)
    release = state.admit(sequences_asked(body))
    try:
        response = await handler(state, request, body, arrival)
    except BaseException:
        release()
        raise
    if isinstance(response, EventStreamResponse):  # a stream holds its slot until it ends
        response.on_close(release)
    else:
        release()
    if state.settings.api_server_count > 1:
        response.headers["X-Mlaserve-Api-Server"] = str(state.settings.api_server_index)
    return response


def _add_ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.healthy:
            return JSONResponse({"status": "ok"})
        reason = "draining" if state.draining else "engine loop not running"
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
