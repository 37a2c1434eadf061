"""free_port: ports the kernel will not hand to an outgoing connection, never twice."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from effectledger_cli import embedded
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
    # Hold many ports low in the range open; none of them may come back. Each is claimed
    # machine-wide first, for this process: unclaimed, the other test worker's free_port could
    # hand one out and its service, or its bind, would find it taken (CI, round fourteen:
    # "Address already in use" in the test above, run at the same moment on the other
    # worker). A claim of our own does not hide a port from our own free_port, so what skips
    # these here is that they are bound.
    held: list[socket.socket] = []
    try:
        lo, _ = ephemeral_port_range()
        for port in range(10000, min(lo, 10000 + 300)):
            if not embedded._claimed(port):
                continue  # another live process holds it
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


def test_two_processes_picking_at_once_never_get_the_same_port() -> None:
    """Each process keeps its ports alive until both have picked: 300 random picks each from
    about 22,000 ports would collide several times (the birthday bound) without the
    machine-wide claims."""
    pick = ("from effectledger_cli.embedded import free_port; import sys; "
            "print(' '.join(str(free_port()) for _ in range(300)), flush=True); "
            "sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", pick], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        picked = []
        for p in procs:
            assert p.stdout is not None
            picked.append({int(x) for x in p.stdout.readline().split()})
    finally:
        for p in procs:
            p.communicate("", timeout=30)
    assert len(picked[0]) == len(picked[1]) == 300
    assert not picked[0] & picked[1]


@pytest.mark.skipif(embedded.fcntl is None, reason="no fcntl: claims are per process only")
def test_a_claim_lasts_as_long_as_its_process(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, text=True)
    try:
        claims.write_text(f"12345 {other.pid}\n")
        assert not embedded._claimed(12345, claims=claims)  # held by a live process
        assert embedded._claimed(12346, claims=claims)
    finally:
        other.communicate("", timeout=10)
    assert embedded._claimed(12345, claims=claims)  # its holder ended: ours now
    me = os.getpid()
    assert claims.read_text() == f"12345 {me}\n12346 {me}\n"


@pytest.mark.skipif(embedded.fcntl is None, reason="no fcntl: claims are per process only")
def test_a_link_in_place_of_the_claims_file_is_not_followed(tmp_path: Path) -> None:
    """The claims file lies in a directory every user writes to: a link planted there must
    not make `free_port` rewrite the file it points to."""
    target = tmp_path / "someone-elses-file"
    target.write_text("keep me\n")
    link = tmp_path / "claims"
    link.symlink_to(target)
    assert embedded._claimed(12345, claims=link)  # per process only, as without claims
    assert target.read_text() == "keep me\n"
