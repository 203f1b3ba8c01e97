"""An emulated multi-node cluster on one machine: namespaces, shaped links, one torchrun per node.

A launcher-level tool beside the CLI: the job it runs (`ringtree bench`, `train`, `doctor`, ...)
is a real multi-node torchrun job and runs unchanged.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ringtree.emulate import cpu, interrupt, network
from ringtree.emulate.cluster import ClusterSpec, run_agents
from ringtree.emulate.network import Network, cleanup, has_net_admin, parse_rate

__all__ = ["ClusterSpec", "Emulated", "cleanup", "has_net_admin", "parse_rate", "run"]


def cleanup_all() -> list[str]:
    """Remove the namespaces and CPU groups interrupted emulate runs left; their names."""
    return [*cleanup(), *cpu.cleanup()]


@dataclass
class Emulated:
    """How an emulated run went: its exit code, the cluster's record and every node's log."""

    code: int
    record: dict[str, Any]
    logs: list[str]
    verdict: bool = False  # the code is the command's answer (doctor: suspects found), not a failure


def run(
    spec: ClusterSpec,
    argv: Sequence[str],
    *,
    measure: bool = True,
    timeout_s: float = 3600.0,
    stdout: IO[str] | None = None,
) -> Emulated:
    """Build the network (and the nodes' CPU shares), measure its links, run `python -m ringtree
    ARGV` on it, tear it down."""
    out = stdout if stdout is not None else sys.stdout
    with (
        interrupt.interruptible(),
        network.build(spec.rates()) as net,
        cpu.maybe(net.tag, spec.nodes, spec.cpus_per_node) as shares,
    ):
        record = spec.describe()
        links = measure_links(net, spec, timeout_s, shares) if measure and spec.nodes > 1 else []
        record["links"] = links
        record["command"] = ["ringtree", *argv]
        print_header(record, out)
        before = [network.link_bytes(node.netns) for node in net.nodes]
        target = ["-m", "ringtree", *argv]
        code, logs, said = run_agents(net, spec, target, timeout_s=timeout_s, stdout=out, shares=shares)
        record["link_bytes"] = job_bytes(net, before)
    record["exit_code"] = code
    return Emulated(code, record, logs, said)


def job_bytes(net: Network, before: list[tuple[int, int]]) -> list[dict[str, int]]:
    """What each node's interface sent and received during the job (the link probe excluded)."""
    rows = []
    for node, (sent0, received0) in zip(net.nodes, before, strict=True):
        sent, received = network.link_bytes(node.netns)
        rows.append({"node": node.index, "sent": sent - sent0, "received": received - received0})
    return rows


def measure_links(
    net: Network, spec: ClusterSpec, timeout_s: float, shares: cpu.Shares | None = None
) -> list[dict[str, Any]]:
    """Node 0 to every node, one rank per node: configured -> measured Gbit/s (see probe), on the
    nodes' CPU shares when they have them."""
    probe_spec = ClusterSpec(spec.nodes, 1, spec.inter_rate, spec.slow, spec.cpus_per_node)
    with tempfile.TemporaryDirectory(prefix="ringtree-probe-") as tmp:
        path = Path(tmp) / "links.json"
        rates = ",".join(str(r) for r in spec.rates())
        target = ["-m", "ringtree.emulate.probe", str(path), rates]
        code, logs, _ = run_agents(net, probe_spec, target, timeout_s=min(timeout_s, 300.0), shares=shares)
        if code or not path.exists():
            raise RuntimeError(f"measuring the emulated links failed (exit {code}):\n{logs[0][-2000:]}")
        rows: list[dict[str, Any]] = json.loads(path.read_text())
    return rows


def print_header(record: dict[str, Any], out: IO[str]) -> None:
    slow = ", ".join(f"node {i} at {r}" for i, r in record["slow"].items()) or "none"
    lines = [
        f"# emulated cluster: {record['nodes']} nodes x {record['ranks_per_node']} ranks per node, "
        f"inter-node links {record['inter_bw']} (tbf, burst about 1 ms), slower links: {slow}",
        f"# cpu: {record['cpu_policy']}",
    ]
    for x in record["links"]:
        lines.append(
            f"# link node 0 <-> node {x['node']}: configured {x['configured_gbps']:.3g} Gbit/s, "
            f"measured {x['measured_gbps']:.3g} Gbit/s, "
            f"after a 1 s idle pause {x['after_idle_gbps']:.3g} Gbit/s, "
            f"latency {x['latency_us']:.0f} us"
        )
    out.write("\n".join(lines) + "\n")
    out.flush()
