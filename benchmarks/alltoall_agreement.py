"""All-to-all closed forms against the event replay of the executor's schedules, at scale.

The tests hold the two equal at 8 to 256 ranks (tests/test_sim_alltoall.py); this runs larger
shapes once, on DGX-like nodes (8 GPUs on NVLink, a 400 Gb/s NIC per GPU), 64 MiB per rank. A
schedule holds p^2 blocks (Bruck about p^2 lg(p) / 2), so 1,024 ranks take minutes and about
2 GB; 4,096 ranks would hold 16.7 million blocks (Bruck 100 million) and are left to the closed forms.

Run: PYTHONPATH=. python benchmarks/alltoall_agreement.py [--nodes 64,128]
"""

from __future__ import annotations

import argparse
import resource
import time

from ringtree.sim import INTER, INTRA, Cluster
from ringtree.sim.network.alltoall import ALGORITHMS, estimate, replay

NBYTES = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="64,128", help="node counts, comma-separated (8 GPUs each)")
    args = parser.parse_args()
    head = ("ranks", "algorithm", "closed form (us)", "replay (us)", "difference", "replay (s)")
    print(f"{head[0]:>5} {head[1]:12} {head[2]:>16} {head[3]:>12} {head[4]:>10} {head[5]:>10}")
    for nodes in (int(n) for n in args.nodes.split(",")):
        cluster = Cluster(nodes, 8, INTRA["nvlink-h100"], INTER["ib-ndr"], nics_per_node=8)
        for algorithm in ALGORITHMS:
            closed = estimate(algorithm, cluster, NBYTES)
            start = time.perf_counter()
            replayed = replay(algorithm, cluster, NBYTES)
            took = time.perf_counter() - start
            print(f"{cluster.ranks:5d} {algorithm:12} {closed * 1e6:16.1f} {replayed * 1e6:12.1f} "
                  f"{closed / replayed - 1:+10.1e} {took:10.1f}", flush=True)  # fmt: skip
    print(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")


if __name__ == "__main__":
    main()
