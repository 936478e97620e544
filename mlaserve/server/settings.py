"""What the HTTP server needs to know, whichever way it was configured (YAML deploy file or flags)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # /health and /metrics also answer on this port when set, so they can stay internal.
    metrics_port: int | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no auth on /v1/*
    served_model_name: str = "mlaserve"
    max_concurrent_requests: int = 64
    request_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
