"""Unit checks of the connection guards: accept() failures are logged once per interval, the connection cap stays
below the open-files limit, listening sockets are TCP sockets (so accepted ones get TCP_NODELAY)."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket

from mlaserve.server.connections import connection_cap, listening_socket, quiet_accept_errors


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
