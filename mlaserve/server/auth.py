"""Bearer-token auth for /v1/*: constant-time comparison against every configured key."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request

from mlaserve.server.errors import OpenAIError


def check_bearer(authorization: str | None, api_keys: Sequence[str]) -> bool:
    """True if the header carries one of the keys. Every key is compared, so timing says nothing about which."""
    if not api_keys:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    given = token.strip().encode("utf-8", "surrogateescape")
    matched = False
    for key in api_keys:
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    return matched


def api_key_dependency(api_keys: Sequence[str]) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency for the /v1 router; raises a 401 in OpenAI's shape."""
    keys = tuple(api_keys)

    async def require_api_key(request: Request) -> None:
        header = request.headers.get("authorization")
        if check_bearer(header, keys):
            return
        reason = "no API key given" if not header else "the API key is not valid"
        raise OpenAIError(
            401,
            f"{reason}: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
            status="unauthorized",
        )

    return require_api_key
