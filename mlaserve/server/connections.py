"""Connection-level limits that uvicorn does not set by itself, as production HTTP servers do.

- A header deadline: a connection gets `header_timeout_s` to send a request line and headers, on a new connection
  and between requests on a kept-alive one. uvicorn closes idle kept-alive connections (its keep-alive timeout)
  but never a connection that sent nothing, or half a header: those used to stay open for good.
- A cap on open connections, counted across every API-server process and kept below a process's open-files limit,
  so no process runs out of descriptors (which stalled /health and filled the log with accept() tracebacks). At the
  cap a new connection makes room by closing this process's oldest idle connection (one that has not sent a whole
  request line and headers yet, or a kept-alive one between requests): refusing the newcomer instead let a client
  that only opens connections hold the server, /health included, for each header window. Only when no idle
  connection is left (every one is a request being served) does a new connection get a 503 with Retry-After.
- The ops port (/health, /metrics) has a small budget of its own, so however many connections the API port holds, a
  probe gets through.
- Accept failures (EMFILE and friends) are logged at most once per interval, with a count.
- Listening sockets are created with IPPROTO_TCP, so asyncio sets TCP_NODELAY on every accepted connection; with
  protocol 0 it does not, and each reply on a kept-alive connection waited for Nagle's algorithm.

The body deadline is the app's (body.read_body): only the app knows when it has read a body.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from mlaserve.server.shared_count import SharedCount

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11, pure Python
    HttpToolsProtocol = None

logger = logging.getLogger("mlaserve.server")

# The ops port's connections, counted apart from the API port's: probes and scrapes open a few at a time, and an
# idle flood on that port is answered by closing its oldest idle ones as on the API port.
OPS_MAX_CONNECTIONS = 32
# Descriptors kept free for everything that is not a client connection (model files, logs, the tokenizer...).
_RESERVED_FDS = 128
_BUSY_BODY = (
    b'{"error":{"message":"too many open connections; retry shortly","type":"service_unavailable",'
    b'"param":null,"code":"too_many_connections"}}'
)
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\nconnection: close\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


@dataclass
class ConnectionLimits:
    header_timeout_s: float
    # Held to by `count`, the open connections of every API-server process: one process alone may take them all,
    # so the cap is below each process's own open-files limit (connection_cap).
    max_connections: int
    count: SharedCount
    refused: int = 0  # connections closed at once: the cap was reached and none was idle
    timed_out: int = 0  # connections closed because headers did not arrive in time
    evicted: int = 0  # idle connections closed to make room for a new one
    open: set = field(default_factory=set)  # the guarded connections open in this process (all its servers)
    # The open connections waiting for a request, in the order they began to wait: the first is closed first.
    idle: dict = field(default_factory=dict)
    # Told each connection the limits close, by why ("evicted", "refused", "header_timeout"): the metrics' counter.
    on_close: Callable[[str], None] | None = None

    def make_room(self) -> bool:
        """Close this process's longest-idle connection; False when none is idle."""
        while self.idle:
            guard = next(iter(self.idle))
            if guard.evict():
                self.evicted += 1
                self.closed("evicted")
                return True
        return False

    def closed(self, reason: str) -> None:
        if self.on_close is not None:
            self.on_close(reason)


def port_limits(
    header_timeout_s: float,
    max_connections: int,
    count: SharedCount,
    on_close: Callable[[str], None] | None = None,
) -> dict[str, ConnectionLimits]:
    """The limits of each listener: the API port's cap is the server's (`count`, shared by the API-server
    processes); the ops port, served by one process, counts its own connections under a small cap, so no number of
    connections to the API port keeps a probe out. `on_close` hears of the API port's closes only: the ops port's
    are probes and scrapes, not clients."""
    return {
        "api": ConnectionLimits(header_timeout_s, connection_cap(max_connections), count, on_close=on_close),
        "ops": ConnectionLimits(header_timeout_s, OPS_MAX_CONNECTIONS, SharedCount.in_process()),
    }


def connection_cap(requested: int, others: int = OPS_MAX_CONNECTIONS) -> int:
    """`requested`, but below the open-files limit (raised to the hard limit first, as servers do), less `others`
    (the ops port's connections, which have their own budget)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, min(requested, soft - _RESERVED_FDS - others))


class _Guard:
    """A header deadline and a connection cap (`limits`, set by `guarded_protocol`) over one of uvicorn's HTTP
    protocols; `_headers_arrived` is called by the protocol once a request line and its headers are parsed."""

    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._bytes_since_request = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limits = self.limits
        acquired = limits.count.try_acquire(1, limits.max_connections)
        # Another process may take the place given back before this one does: then it is a refusal after all.
        while not acquired and limits.make_room():
            acquired = limits.count.try_acquire(1, limits.max_connections)
        if not acquired:
            self._refused = True
            limits.refused += 1
            limits.closed("refused")
            transport.write(_BUSY)
            transport.close()
            return
        limits.open.add(self)
        super().connection_made(transport)
        self._arm()
        self._wait_for_request()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of another request on a kept-alive connection
        self._bytes_since_request += len(data)
        super().data_received(data)

    def _headers_arrived(self) -> None:
        self._disarm()
        self._bytes_since_request = 0
        self.limits.idle.pop(self, None)

    def on_response_complete(self) -> None:
        # Before uvicorn's: it may start a pipelined request at once (h11 parses it then, httptools has it queued).
        if not self.transport.is_closing() and not getattr(self, "pipeline", None):
            self._wait_for_request()
        super().on_response_complete()

    def _wait_for_request(self) -> None:
        self.limits.idle.pop(self, None)
        self.limits.idle[self] = None  # last in line to be closed

    def evict(self) -> bool:
        """Close this connection for a newer one if it is still waiting for a request; False (and out of the idle
        line) otherwise. Its place in the count is given back now: the close itself completes on a later turn of the
        loop, and the newcomer takes the place at once."""
        self.limits.idle.pop(self, None)
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return False
        self._disarm()
        self._give_back()
        if self._bytes_since_request:  # half a request: say why
            self.transport.write(_BUSY)
        self.transport.close()
        return True

    def _give_back(self) -> None:
        self.limits.idle.pop(self, None)
        if self in self.limits.open:  # the set makes giving the count back happen once
            self.limits.open.remove(self)
            self.limits.count.release(1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        self._give_back()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        self.limits.timed_out += 1
        self.limits.closed("header_timeout")
        if self._bytes_since_request:  # half a request: say why; a connection that sent nothing just closes
            self.transport.write(_TIMED_OUT)
        self.transport.close()


class GuardedH11Protocol(_Guard, H11Protocol):
    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request line and its headers arrived: a new cycle began
            self._headers_arrived()


if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(_Guard, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._headers_arrived()


def guarded_protocol(limits: ConnectionLimits) -> type:
    """The C parser (httptools) where it is installed, else h11: parsing each request and framing each streamed
    event is per-token work on the server's one event loop."""
    base = GuardedHttpToolsProtocol if HttpToolsProtocol is not None else GuardedH11Protocol
    return type(f"Guarded{base.__name__}", (base,), {"limits": limits})


def uvicorn_config(app: Any, settings: Any, limits: ConnectionLimits, **options: Any) -> Any:
    """The uvicorn Config every mlaserve listener uses (ServerSettings' keep-alive; the guarded protocol)."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        lifespan="off",
        **options,
    )


def quiet_accept_errors(interval_s: float = 10.0) -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """An event-loop exception handler that logs accept() failures once per interval, with a count; every other
    error goes to asyncio's default handler."""
    state = {"last": -interval_s, "suppressed": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if "socket.accept()" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - state["last"] < interval_s:
            state["suppressed"] += 1
            return
        extra = f" ({state['suppressed']} more since the last report)" if state["suppressed"] else ""
        logger.warning("accept() failed: %s%s", context.get("exception") or context["message"], extra)
        state["last"], state["suppressed"] = now, 0

    return handler


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket for uvicorn: IPPROTO_TCP so that accepted connections get TCP_NODELAY."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"{host}:{port} is not available ({e.strerror}); pick another --port") from None
    sock.set_inheritable(True)
    return sock


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One bound socket per API-server process, all on one port. On Linux each gets its own (SO_REUSEPORT) and the
    kernel spreads new connections over them by address: with one shared socket the processes race to accept, and
    a burst lands mostly on whichever loops are idle at that moment (29, 94, 30 and 103 of 256 streams over four
    processes on the H200, where the busiest one set every stream's latency). Elsewhere the processes share one."""
    if count == 1 or not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return [listening_socket(host, port)] * count
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(listening_socket(host, port, reuse_port=True))
            port = sockets[0].getsockname()[1]  # port 0: the others join the one the first was given
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
