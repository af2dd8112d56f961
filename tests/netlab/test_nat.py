"""The lab's NAT routers (swarm.netlab.nat) are real: iptables masquerades in the router's
namespace, the process behind it dials out and is seen at its router's address, and nobody dials
in, neither its private address nor its router's. Needs root, iproute2 and iptables (installed
with apt-get when missing); fails, never skips, without them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _util import ensure_iptables

from swarm.netlab.namespaces import NetLab, NetlabError, list_namespaces, require

SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
    print("listening", flush=True)
    while True:
        c, addr = s.accept(); c.sendall(addr[0].encode() + b"\\n"); c.close()
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
        print("seen as", c.makefile().readline().strip())
    except OSError as e:
        print("failed", type(e).__name__)
    """
)


@pytest.fixture(scope="module")
def caps():
    try:
        ensure_iptables()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        return require()
    except NetlabError as e:
        pytest.fail(f"these tests need Linux namespaces (root, iproute2): {e}")


def _server(net: NetLab, name: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        net.wrap(name, [sys.executable, "-c", SERVER, str(port)]), stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "listening"
    return process


def _connect(net: NetLab, name: str, host: str, port: int) -> str:
    argv = net.wrap(name, [sys.executable, "-c", CLIENT, host, str(port)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.mark.peers
def test_a_process_behind_nat_dials_out_and_nobody_dials_in(caps):
    with NetLab(["public", "home"], nat=["home"]) as net:
        tag = net.topology.tag
        assert net.address("home").startswith("192.168.") and net.public_address("home") == "10.77.0.3"
        assert "home is behind NAT at 192.168.1.2: its router 10.77.0.3 lets nobody dial in" in net.summary()
        servers = [_server(net, "public", 7000), _server(net, "home", 7001)]
        try:
            # out: the connection arrives from the router's address (masqueraded)
            assert _connect(net, "home", net.address("public"), 7000) == "seen as 10.77.0.3"
            # in: the private address is not routed from outside, the router's refuses
            assert _connect(net, "public", net.address("home"), 7001).startswith("failed")
            assert _connect(net, "public", net.public_address("home"), 7001).startswith("failed")
        finally:
            for server in servers:
                server.kill()
                server.wait()
    assert list_namespaces(tag + "-") == []  # the router's namespace too


def test_nat_for_an_unknown_process_is_a_one_line_error():
    with pytest.raises(ValueError, match="behind NAT: unknown process"):
        NetLab(["a", "b"], nat=["c"])
