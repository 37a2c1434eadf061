"""free_port: ports the kernel will not hand to an outgoing connection, never twice."""

from __future__ import annotations

import socket

from effectledger_cli.embedded import ephemeral_port_range, free_port


def test_ports_lie_below_the_ephemeral_range_and_are_bindable() -> None:
    lo, _ = ephemeral_port_range()
    for _ in range(20):
        port = free_port()
        assert port < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_is_never_handed_out_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_a_taken_port_is_skipped() -> None:
    # Hold many ports low in the range open; none of them may come back.
    held: list[socket.socket] = []
    try:
        lo, _ = ephemeral_port_range()
        for port in range(10000, min(lo, 10000 + 300)):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                s.close()
                continue
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(100)}
    finally:
        for s in held:
            s.close()
