"""A health check of a world before training: links between and within nodes, compute, versions.

Every measurement runs on the process group torchrun (or `spawn`) set up. Links are measured
one pair at a time, the other ranks idle, so that no two measurements share a link or a core:
the first rank of every pair of nodes (inter-node), and local ranks 0 and 1 of every node
(intra-node). Compute is a fixed float32 matmul, one rank at a time. A node whose best link
falls below `threshold` x the expected bandwidth is a link suspect; a rank whose matmul rate
falls below `threshold` x the median is a compute suspect. Units: links in Gbit/s, compute in
GFLOP/s, latency in microseconds.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringtree.comm import CollectiveError

SLOW_RANK_ENV = "RINGTREE_DOCTOR_SLOW_RANK"  # test hook: this rank sleeps in its compute timing
SLOW_SECONDS = 0.05


@dataclass(frozen=True)
class DoctorConfig:
    """What to measure and when to call something a suspect."""

    size: int = 1 << 20  # bytes per bandwidth message
    iters: int = 3  # timed messages per link (and round trips x 4 for latency)
    matmul: int = 256  # n of the n x n float32 matmul timed on every rank
    threshold: float = 0.5  # below threshold x expected: a suspect
    expect_gbps: float = 0.0  # the inter-node link rate the user expects; 0: the median node's
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.size < 4 or self.iters < 1 or self.matmul < 1:
            raise ValueError(
                "need size >= 4 bytes, iters >= 1 and matmul >= 1, "
                f"got {self.size}, {self.iters}, {self.matmul}"
            )
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must lie between 0 and 1, got {self.threshold}")
        if self.expect_gbps < 0:
            raise ValueError(f"the expected bandwidth must not be negative, got {self.expect_gbps}")


def node_shape() -> tuple[int, int]:
    """(nodes, ranks per node) of the current world, from torchrun's LOCAL_WORLD_SIZE."""
    p = dist.get_world_size()
    k = int(os.environ.get("LOCAL_WORLD_SIZE", p))
    return p // k, k


def _send(t: torch.Tensor, peer: int, timeout_s: float) -> None:
    work = dist.isend(t, peer)
    assert work is not None  # None only for ranks outside the group, which never call this
    if not work.wait(timedelta(seconds=timeout_s)):
        raise CollectiveError(f"doctor: send to rank {peer} did not complete", peer=peer)


def _recv(t: torch.Tensor, peer: int, timeout_s: float) -> None:
    work = dist.irecv(t, peer)
    assert work is not None  # None only for ranks outside the group, which never call this
    if not work.wait(timedelta(seconds=timeout_s)):
        raise CollectiveError(f"doctor: receive from rank {peer} did not complete", peer=peer)


def measure_pair(
    a: int, b: int, size: int, iters: int, timeout_s: float = 60.0
) -> tuple[float, float] | None:
    """Rank a sends `size` bytes to rank b `iters` times, each acknowledged; the median time counts.

    Returns (Gbit/s, one-way latency in us) on rank a, None on b; other ranks must not call it.
    """
    rank = dist.get_rank()
    peer = b if rank == a else a
    buf, ack = torch.zeros(max(size // 4, 1)), torch.zeros(1)
    lat_iters = 4 * iters

    def one(payload: torch.Tensor) -> None:
        if rank == a:
            _send(payload, peer, timeout_s)
            _recv(ack, peer, timeout_s)
        else:
            _recv(payload, peer, timeout_s)
            _send(ack, peer, timeout_s)

    one(buf)  # warm-up: connections and buffers
    latency = _median_seconds(one, ack, lat_iters) / 2  # a round trip of one float, halved
    seconds = _median_seconds(one, buf, iters)  # includes the acknowledgement's trip back
    if rank != a:
        return None
    return buf.numel() * 4 * 8 / max(seconds, 1e-9) / 1e9, latency * 1e6


def _median_seconds(fn: Callable[[torch.Tensor], None], payload: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(payload)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(n: int) -> float:
    """This rank's float32 matmul rate (best of five timings of four n x n products)."""
    x, y = torch.randn(n, n), torch.randn(n, n)
    slow = os.environ.get(SLOW_RANK_ENV) == str(dist.get_rank())
    torch.mm(x, y)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(x, y)
        if slow:
            time.sleep(SLOW_SECONDS)
        best = min(best, time.perf_counter() - start)
    return 4 * 2 * n**3 / best / 1e9


def versions() -> dict[str, Any]:
    """What every rank must agree on."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": dist.get_backend(),
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "cuda": torch.version.cuda,
    }


def link_pairs(nodes: int, k: int) -> list[tuple[int, int, str]]:
    """(rank a, rank b, level): first ranks of every pair of nodes, then local ranks 0-1 of each node."""
    inter = [(u * k, v * k, "inter") for u in range(nodes) for v in range(u + 1, nodes)]
    intra = [(u * k, u * k + 1, "intra") for u in range(nodes)] if k > 1 else []
    return inter + intra


def run(cfg: DoctorConfig) -> dict[str, Any] | None:
    """Measure the world; the report on rank 0, None elsewhere."""
    rank, p = dist.get_rank(), dist.get_world_size()
    nodes, k = node_shape()
    mine: dict[str, Any] = {"links": [], "versions": versions()}
    for a, b, level in link_pairs(nodes, k):
        if rank in (a, b):
            got = measure_pair(a, b, cfg.size, cfg.iters, cfg.timeout_s)
            if got is not None:
                link = {"a": a, "b": b, "node_a": a // k, "node_b": b // k, "level": level}
                mine["links"].append({**link, "gbps": got[0], "latency_us": got[1]})
        dist.barrier()
    for r in range(p):
        if rank == r:
            mine["gflops"] = matmul_gflops(cfg.matmul)
        dist.barrier()
    gathered: list[Any] = [None] * p if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    return report(gathered, nodes, k, cfg) if rank == 0 else None


def report(per_rank: list[dict[str, Any]], nodes: int, k: int, cfg: DoctorConfig) -> dict[str, Any]:
    """Assemble the ranks' measurements, compare versions and name the suspects."""
    links = [link for r in per_rank for link in r["links"]]
    compute = [{"rank": r, "node": r // k, "gflops": d["gflops"]} for r, d in enumerate(per_rank)]
    ref = per_rank[0]["versions"]
    mismatches = [
        {"rank": r, "key": key, "value": d["versions"][key], "rank0": ref[key]}
        for r, d in enumerate(per_rank)
        for key in ref
        if d["versions"][key] != ref[key]
    ]
    return {
        "world_size": len(per_rank),
        "nodes": nodes,
        "ranks_per_node": k,
        "versions": ref,
        "mismatches": mismatches,
        "links": links,
        "compute": compute,
        "suspects": suspects(links, compute, nodes, k, cfg),
    }


def suspects(
    links: list[dict[str, Any]], compute: list[dict[str, Any]], nodes: int, k: int, cfg: DoctorConfig
) -> list[dict[str, Any]]:
    """Nodes whose best inter-node link, or whose intra-node link, is slow; ranks that compute slowly."""
    out = []
    best = (
        {
            u: max(x["gbps"] for x in links if x["level"] == "inter" and u in (x["node_a"], x["node_b"]))
            for u in range(nodes)
        }
        if nodes > 1
        else {}
    )
    expected = cfg.expect_gbps or (statistics.median(best.values()) if best else 0.0)
    for u, gbps in best.items():
        if gbps < cfg.threshold * expected:
            out.append(_suspect(u, u * k, "link", gbps, expected))
    intra = [x for x in links if x["level"] == "intra"]
    if intra:
        typical = statistics.median(x["gbps"] for x in intra)
        for x in intra:
            if x["gbps"] < cfg.threshold * typical:
                out.append(_suspect(x["node_a"], x["b"], "link", x["gbps"], typical))
    typical = statistics.median(c["gflops"] for c in compute)
    for c in compute:
        if c["gflops"] < cfg.threshold * typical:
            out.append(_suspect(c["node"], c["rank"], "compute", c["gflops"], typical))
    return out


def _suspect(node: int, rank: int, kind: str, measured: float, expected: float) -> dict[str, Any]:
    """One entry of the JSON's `suspects`."""
    return {"node": node, "rank": rank, "kind": kind, "measured": measured, "expected": expected}
