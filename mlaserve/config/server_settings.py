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
    # Connection limits (connections.py): a client gets this long to send its request line and headers, and its
    # whole body; an idle keep-alive connection is closed after keep_alive_timeout_s; at max_connections open
    # connections to the API port (capped below a process's open-files limit) a new one closes the longest-idle one,
    # or gets a 503 when none is idle. The ops port has a small budget of its own.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1024
    # Structured-output constraints (sampling/grammar_limits.py): past a cap a request is refused before any compile,
    # and one whose compile outlasts the deadline gets a 400 too; both name the request's field.
    grammar_max_choices: int = 10_000
    grammar_max_choice_bytes: int = 256 * 1024
    grammar_max_bytes: int = 256 * 1024
    grammar_compile_timeout_s: float = 5.0
    # HTTP processes in front of the one engine core (vLLM's --api-server-count): each parses, detokenizes and
    # streams for the connections it accepts; max_concurrent_requests and max_connections hold for all of them
    # together (counted across the processes), since the kernel does not spread connections evenly.
    api_server_count: int = 1
    # Tool calls and reasoning in chat replies (vLLM's flags). tool_choice "auto" needs enable_auto_tool_choice and
    # a parser: tool_call_parser, or the one the model's chat template or config names.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # Which of those processes this is (0: the one started first); set by serve(), not configured. With more than
    # one, generation responses name it in an X-Mlaserve-Api-Server header, so load spread can be seen.
    api_server_index: int = 0
