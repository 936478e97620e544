"""Unit checks of the connection guards: accept() failures are logged once per interval, the connection cap stays
below the open-files limit, listening sockets are TCP sockets (so accepted ones get TCP_NODELAY), and several API-server
processes each get a socket of their own on one port, over which new connections spread."""

from __future__ import annotations

import asyncio
import logging
import resource
import select
import socket
import sys

import pytest

from mlaserve.server.connections import (
    connection_cap,
    listening_socket,
    listening_sockets,
    quiet_accept_errors,
)


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
