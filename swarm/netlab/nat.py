"""A home router for a netlab process: its own namespace between the process and the lab's bridge,
masquerading what the process sends (NAT) and dropping every connection from outside that the
process did not open. The process dials out; nobody dials in.

    process namespace            router namespace <tag>-<name>-nat              bridge
    eth0 192.168.<k>.2/24  <->   lan0 192.168.<k>.1/24 | eth0 <public address>  <->  br0

The router's eth0 takes the process's place on the bridge (its public address, its shaped access
link), so rates and delays apply as without NAT. iptables (nat table, MASQUERADE, conntrack) runs
inside the router's namespace only: nothing changes on the host.
"""

from __future__ import annotations

from swarm.netlab.kernel import NetlabError, find_tool, run_tool

ROUTER_SUFFIX = "-nat"


def private_subnet(index: int) -> tuple[str, str]:
    """(router's LAN address, process's address) of the `index`th NATed process, each its own /24."""
    if not 0 <= index < 254:
        raise NetlabError(f"at most 254 processes behind NAT in one lab, got index {index}")
    return f"192.168.{index + 1}.1", f"192.168.{index + 1}.2"


def require_iptables() -> str:
    iptables = find_tool("iptables")
    if iptables is None:
        raise NetlabError("processes behind NAT need iptables: apt-get install iptables")
    return iptables


def build_router(process_ns: str, router_ns: str, index: int, mtu: int) -> None:
    """The router namespace, its LAN link to `process_ns` (whose default route it becomes) and its
    NAT rules. The caller gives the router an eth0 on the bridge afterwards."""
    ip, iptables = find_tool("ip") or "ip", require_iptables()
    lan_router, lan_process = private_subnet(index)
    run_tool([ip, "netns", "add", router_ns])
    run_tool([ip, "-n", router_ns, "link", "set", "lo", "up"])
    veth = ["link", "add", "lan0", "mtu", str(mtu), "type", "veth", "peer", "name", "eth0", "netns", process_ns]
    run_tool([ip, "-n", router_ns, *veth])
    run_tool([ip, "-n", router_ns, "addr", "add", f"{lan_router}/24", "dev", "lan0"])
    run_tool([ip, "-n", router_ns, "link", "set", "lan0", "up"])
    run_tool([ip, "-n", process_ns, "addr", "add", f"{lan_process}/24", "dev", "eth0"])
    run_tool([ip, "-n", process_ns, "link", "set", "eth0", "mtu", str(mtu), "up"])
    run_tool([ip, "-n", process_ns, "route", "add", "default", "via", lan_router])
    inside = [ip, "netns", "exec", router_ns]
    run_tool([*inside, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
    run_tool([*inside, iptables, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"])
    established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    run_tool([*inside, iptables, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", *established])
    run_tool([*inside, iptables, "-A", "FORWARD", "-i", "eth0", "-o", "lan0", "-j", "DROP"])
