"""Unit checks of the connection guards: accept() failures are logged once per interval, the connection cap stays
below the open-files limit and holds for the connections of every API-server process together, listening sockets
are TCP sockets (so accepted ones get TCP_NODELAY), and several API-server processes each get a socket of their own
on one port, over which new connections spread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
import select
import socket
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from mlaserve.config.server_settings import ServerSettings
from mlaserve.server import connections
from mlaserve.server.connections import (
    ConnectionLimits,
    connection_cap,
    listening_socket,
    listening_sockets,
    quiet_accept_errors,
    uvicorn_config,
)
from mlaserve.server.shared_count import SharedCount
from tests.server.conftest import wait_for
from tests.server.test_hostile_clients import raw_connection, read_all


def test_accept_failures_are_logged_once_per_interval_with_a_count(caplog):
    loop = asyncio.new_event_loop()
    handler = quiet_accept_errors(interval_s=60)
    context = {
        "message": "socket.accept() out of system resource",
        "exception": OSError(24, "Too many open files"),
    }
    with caplog.at_level(logging.WARNING, logger="mlaserve.server"):
        for _ in range(10_000):
            handler(loop, context)
    records = [r for r in caplog.records if "accept() failed" in r.getMessage()]
    assert len(records) == 1
    loop.close()


def test_other_loop_errors_still_reach_the_default_handler(caplog):
    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        quiet_accept_errors()(loop, {"message": "something else broke"})
    assert any("something else broke" in r.getMessage() for r in caplog.records)
    loop.close()


def test_the_cap_stays_below_the_open_files_limit():
    cap = connection_cap(10**9)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 1 <= cap < soft
    assert connection_cap(5) == 5


def test_listening_sockets_are_tcp_so_accepted_ones_get_nodelay():
    sock = listening_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    sock.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads connections on Linux")
def test_each_process_gets_its_own_socket_and_connections_spread_over_them():
    socks = listening_sockets("127.0.0.1", 0, 3)
    clients = []
    try:
        assert len({id(s) for s in socks}) == 3
        assert len({s.getsockname()[1] for s in socks}) == 1
        for s in socks:
            s.listen(128)
        port = socks[0].getsockname()[1]
        for _ in range(60):
            clients.append(socket.create_connection(("127.0.0.1", port)))
        accepted = [0, 0, 0]
        while sum(accepted) < 60:
            ready, _, _ = select.select(socks, [], [], 5)
            assert ready, f"connections lost: {accepted}"
            for s in ready:
                conn, _ = s.accept()
                conn.close()
                accepted[socks.index(s)] += 1
        # A shared socket would leave the split to whichever process accepts first; here the kernel hashes each
        # connection to a socket: all three get some (a share of 0 of 60 has odds near 1e-10).
        assert all(n > 0 for n in accepted), accepted
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()


def test_one_process_or_no_reuse_port_shares_one_socket(monkeypatch):
    socks = listening_sockets("127.0.0.1", 0, 1)
    assert len(socks) == 1
    socks[0].close()
    monkeypatch.setattr(sys, "platform", "darwin")
    socks = listening_sockets("127.0.0.1", 0, 3)
    assert socks[0] is socks[1] is socks[2]
    socks[0].close()


_RELEASE = threading.Event()  # holds every request to /hold until set
_HOLD = b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n"


async def _hello(scope: dict, receive: object, send: object) -> None:
    if scope["type"] == "http":
        while scope["path"] == "/hold" and not _RELEASE.is_set():
            await asyncio.sleep(0.02)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def _guarded_server(limits: ConnectionLimits) -> Iterator[str]:
    """uvicorn with the guarded protocol over `limits`, in a thread; yields its URL."""
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(_hello, ServerSettings(), limits, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, timeout=10)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _busy(url: str) -> socket.socket:
    """A connection whose request is being served (until _RELEASE is set): never idle."""
    sock = raw_connection(url)
    sock.sendall(_HOLD)
    return sock


def _closed(sock: socket.socket, timeout: float = 2.0) -> bytes | None:
    """What the server sent before closing `sock`, or None if it is still open after `timeout`."""
    sock.settimeout(timeout)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return answer


def test_servers_sharing_a_count_hold_one_connection_cap():
    """Two servers standing for two API-server processes (one count, as ServerCounts hands them): four connections
    being served over both fill a cap of four, so the next is refused on either, even the one holding a single
    connection; one closed on the first makes room on the second."""
    _RELEASE.clear()
    count = SharedCount.across_processes(multiprocessing.get_context("spawn"))
    limits = [ConnectionLimits(30.0, 4, count) for _ in range(2)]
    with _guarded_server(limits[0]) as first, _guarded_server(limits[1]) as second:
        held = [_busy(first) for _ in range(3)] + [_busy(second)]
        assert wait_for(
            lambda: count.value == 4 and len(limits[1].open) == 1 and not limits[1].idle, timeout=5
        )
        assert wait_for(lambda: not limits[0].idle, timeout=5)
        for url in (first, second):
            sock = raw_connection(url)
            answer = read_all(sock, timeout=5)
            assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
            sock.close()
        assert limits[0].refused == limits[1].refused == 1
        held.pop(0).close()
        assert wait_for(lambda: count.value == 3, timeout=5)
        _RELEASE.set()
        assert httpx.get(second, timeout=5).text == "ok"
        for sock in held:
            sock.close()
        assert wait_for(lambda: count.value == 0, timeout=5)  # every connection gave its place back once


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_at_the_cap_the_longest_idle_connection_is_closed_first(parser, monkeypatch):
    """Cap 4: each connection past it closes the one that has waited longest for a request (a kept-alive one
    waits from the end of its last response; one that sent half a header is told 503), never one being served;
    over either of uvicorn's parsers."""
    if parser == "h11":
        monkeypatch.setattr(connections, "HttpToolsProtocol", None)
    _RELEASE.clear()
    limits = ConnectionLimits(30.0, 4, SharedCount.in_process())
    with _guarded_server(limits) as url:
        socks: dict[str, socket.socket] = {}

        def connect(name: str, first_bytes: bytes = b"") -> None:
            socks[name] = raw_connection(url)
            if first_bytes:
                socks[name].sendall(first_bytes)
            assert wait_for(lambda: len(limits.open) + limits.evicted == len(socks), timeout=5)

        connect("busy", _HOLD)
        for name in "abc":
            connect(name)
        connect("d")  # past the cap: a goes
        assert _closed(socks["a"]) == b"" and limits.evicted == 1
        socks["b"].sendall(
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        )  # b is served, then waits again: last in line
        assert socks["b"].recv(1024).startswith(b"HTTP/1.1 200")
        socks["c"].sendall(b"GET / HTTP/1.1\r\nHo")  # half a header: still idle, still in its place
        connect("e")
        assert _closed(socks["c"]).startswith(b"HTTP/1.1 503")
        connect("f")
        assert _closed(socks["d"]) == b""
        assert _closed(socks["b"], 0.2) is None and _closed(socks["busy"], 0.2) is None
        assert limits.evicted == 3 and limits.refused == 0 and limits.count.value == 4
        _RELEASE.set()
        for sock in socks.values():
            sock.close()
        assert wait_for(lambda: limits.count.value == 0 and not limits.idle, timeout=5)
