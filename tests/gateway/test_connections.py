"""The connection shell the Tank and Kafka gateways share, on real TCP sockets."""

from __future__ import annotations

import ipaddress
import os
import socket
import time

from dafka.gateway.connections import Connection, client_allowed, flush, prepare, send

HOST = "127.0.0.1"


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server((HOST, 0)) as listener:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # the kernel holds little
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    prepare(server)
    return server, client


def test_answers_go_out_whole_and_in_order_however_much_the_socket_takes() -> None:
    server, client = tcp_pair()
    conn = Connection(server, "peer")
    try:
        answers = [os.urandom(3 << 20), [os.urandom(100), os.urandom(5 << 20), os.urandom(7)], os.urandom(10)]
        sent = sum(send(conn, a) for a in answers)
        total = 3 * (1 << 20) + 100 + (5 << 20) + 7 + 10
        assert sent + conn.out_size == total and conn.out  # more than the kernel holds: queued
        want = b"".join(b"".join(a) if isinstance(a, list) else a for a in answers)
        got = bytearray()
        client.settimeout(10)
        deadline = time.monotonic() + 30
        while len(got) < total and time.monotonic() < deadline:
            got += client.recv(1 << 20)
            flush(conn)
        assert bytes(got) == want
        assert not conn.out and conn.out_size == 0
    finally:
        server.close()
        client.close()


def test_allowed_clients_by_network_with_ipv4_mapped_addresses() -> None:
    nets = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]
    assert client_allowed("10.1.2.3", nets)
    assert client_allowed("::ffff:10.1.2.3", nets)
    assert client_allowed("::1", nets)
    assert not client_allowed("192.168.0.1", nets)
    assert not client_allowed("not an address", nets)
    assert not client_allowed("10.1.2.3", [])
