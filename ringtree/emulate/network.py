"""The emulated network: one namespace per node, veth pairs to a bridge, egress shaped by tbf.

Everything lives in namespaces this module creates (names start with PREFIX): a bridge
namespace holding the bridge and one port per node, and one namespace per node holding that
node's end of the veth pair (IFNAME) and its loopback. Nothing is added to the host's own
namespace, and the addresses (SUBNET) exist only inside these namespaces, so the network is
closed. Deleting the namespaces removes the links and qdiscs with them. The iproute2 tools do
the netlink work; nothing here writes packets.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field

from ringtree.emulate import interrupt

PREFIX = "rtemu"  # every namespace, link and port this module creates starts with it
IFNAME = "rtemu0"  # a node's interface, inside its namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.213.0"  # a private /24 that only the emulated nodes use
MTU = 1500

_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1.0}


def parse_rate(text: str) -> float:
    """'100mbit' -> 1e8 bits per second (tc's units: bit, kbit, mbit, gbit)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    unit = m.group(2) if m else ""
    if m is None or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"cannot read rate {text!r}; write it like 100mbit, 1gbit or 10gbit")
    return float(m.group(1)) * _RATE_UNITS[unit]


def format_rate(bits_per_s: float) -> str:
    """1e9 -> '1gbit'; 2.5e8 -> '250mbit' (tc's own spelling)."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        value = bits_per_s / _RATE_UNITS[unit]
        if value >= 1:
            return f"{value:g}{unit}"
    return f"{bits_per_s:g}bit"


def burst_bytes(bits_per_s: float) -> int:
    """The token bucket's depth: about 1 ms of line rate, at least two full frames.

    A deep bucket lets a step's all-reduce ride at line speed on tokens saved up while the
    step computed; a shallow one keeps every burst of traffic to the configured rate.
    """
    return max(int(bits_per_s / 8 * 1e-3), 2 * (MTU + 14))


def has_net_admin() -> bool:
    """True when this process may create namespaces and links (root or CAP_NET_ADMIN).

    RINGTREE_EMULATE_NO_NET_ADMIN=1 pretends it may not (for tests of the refusal).
    """
    if os.environ.get("RINGTREE_EMULATE_NO_NET_ADMIN") == "1":
        return False
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    cap_net_admin = 12
    return bool(int(caps.split()[1], 16) >> cap_net_admin & 1)


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, address and link rate (bits per second)."""

    index: int
    netns: str
    address: str
    rate: float


@dataclass
class Network:
    """A built network; `close()` (or leaving the `with`) removes every part of it."""

    tag: str
    nodes: list[Node]
    bridge_netns: str
    created: list[str] = field(default_factory=list)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespaces (links and qdiscs go with them), Ctrl-C or not."""
        with interrupt.deferred():  # a second Ctrl-C must not leave debris
            for netns in reversed(self.created):
                delete_netns(netns)
            self.created.clear()


def build(rates: list[float]) -> Network:
    """Create one namespace per rate (node i gets rates[i]) and wire them to a shaped bridge."""
    tag = f"{PREFIX}-{secrets.token_hex(4)}"
    nodes = [Node(i, f"{tag}-n{i}", f"{SUBNET}.{i + 1}", r) for i, r in enumerate(rates)]
    net = Network(tag, nodes, f"{tag}-br")
    try:
        _add_netns(net, net.bridge_netns)
        _ip(net.bridge_netns, "link", "add", f"{PREFIX}-br", "type", "bridge")
        _ip(net.bridge_netns, "link", "set", f"{PREFIX}-br", "up")
        for node in nodes:
            _add_node(net, node)
    except BaseException:
        net.close()
        raise
    return net


def _add_node(net: Network, node: Node) -> None:
    port = f"{PREFIX}-p{node.index}"
    _add_netns(net, node.netns)
    _ip(node.netns, "link", "set", "lo", "up")
    # Both ends are born inside namespaces: the port in the bridge's, the interface in the node's.
    _ip(net.bridge_netns, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", node.netns)
    _ip(net.bridge_netns, "link", "set", port, "master", f"{PREFIX}-br", "up")
    _ip(node.netns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
    _ip(node.netns, "link", "set", IFNAME, "up")
    # Shape both directions: the node's egress (what it sends) and the port's (what it receives).
    _shape(node.netns, IFNAME, node.rate)
    _shape(net.bridge_netns, port, node.rate)


def _shape(netns: str, dev: str, rate: float) -> None:
    burst = burst_bytes(rate)
    # The queue holds up to 20 ms of traffic beyond the burst before tbf drops (TCP backs off).
    limit = burst + max(int(rate / 8 * 0.02), 4 * MTU)
    cmd = ["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "tbf"]
    _run([*cmd, "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)])


def _add_netns(net: Network, netns: str) -> None:
    _run(["ip", "netns", "add", netns])
    net.created.append(netns)


def _ip(netns: str, *args: str) -> None:
    _run(["ip", "-n", netns, *args])


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def link_bytes(netns: str, dev: str = IFNAME) -> tuple[int, int]:
    """(sent, received) bytes of a node's interface, from the kernel's own counters (every frame,
    headers and retransmissions included): what really crossed the emulated link."""
    import json

    stats = json.loads(_run(["ip", "-n", netns, "-s", "-j", "link", "show", "dev", dev]))[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def list_netns(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose names start with prefix."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def kill_inside(netnses: list[str]) -> None:
    """SIGKILL every process inside these namespaces in one pass: agents and their workers (torch
    starts each worker in a session of its own) die together, so no survivor sees a peer's reset
    connection and prints a traceback."""
    found = [
        subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True, check=False)
        for n in netnses
    ]
    for pid in (p for out in found for p in out.stdout.split()):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def delete_netns(netns: str, tries: int = 5) -> None:
    """Stop what still runs inside netns (an emulate run's leftovers), then delete it; tried again
    while it is still listed (a process killed a moment ago can keep it busy)."""
    for _ in range(tries):
        kill_inside([netns])
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        if netns not in list_netns(netns):
            return
        time.sleep(0.2)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace left over by an emulate run; return their names."""
    leftovers = list_netns(prefix)
    for netns in leftovers:
        delete_netns(netns)
    return leftovers


def host_links(prefix: str = PREFIX) -> list[str]:
    """Links in the host's namespace whose names start with prefix (there should be none)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    return [
        f.split("@")[0] for f in (line.split(": ")[1] for line in out.splitlines()) if f.startswith(prefix)
    ]


def qdiscs(netns: str) -> str:
    """tc's description of the qdiscs inside netns (for the record)."""
    return _run(["tc", "-n", netns, "qdisc", "show"])
