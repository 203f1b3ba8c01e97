# ruff: noqa: E501  (the lines written are nccl-tests' fixed-width log lines, kept whole to be read)
"""Writes the synthetic A100 nccl-tests logs of this folder (see README.md); run from the repo root.

The "true" machine is NCCL's own cost model of a DGX A100 (NVLink 3, eight 200 Gbit/s HDR NICs)
with fixed corrections and a deterministic +-2% wobble, so a fit on some logs can be checked
against the others. Each log is laid out like a different nccl-tests version (see README.md).
"""

from __future__ import annotations

import math
from pathlib import Path

from ringtree.sim.network import nccl_model
from ringtree.sim.network.nccl_system import Corrections, NcclTuning
from ringtree.sim.network.presets import INTER, INTRA

HERE = Path(__file__).parent
TRUTH = NcclTuning(
    nccl_model.system_from_links(
        "ampere", "nvlink", INTRA["nvlink-a100"].bandwidth_Bps, 8 * INTER["ib-hdr"].bandwidth_Bps
    ),
    Corrections(latency_intra=1.8, latency_inter=1.3, transfer_intra=1.04, transfer_inter=1.10),
)
GPU = "NVIDIA A100-SXM4-80GB"
BUS = ("0x07", "0x0f", "0x47", "0x4e", "0x87", "0x90", "0xb7", "0xbd")


def bump(nbytes: int) -> float:
    """A smooth excess of up to +25% around 1 MiB that no correction of NCCL's model can express
    (real logs show such shapes where the protocol changes): the 1 x 2 and 1 x 4 logs carry it."""
    return 1 + 0.25 * math.exp(-((math.log2(nbytes) - 20) ** 2) / 8)


def times(p: int, nodes: int, nbytes: int, k: int, bumped: bool = False) -> tuple[float, float]:
    t = nccl_model.allreduce_seconds(TRUTH, p, nodes, nbytes)[0] * 1e6 * (bump(nbytes) if bumped else 1.0)
    wobble = 1 + 0.02 * math.sin(1.7 * k + p)
    return t * wobble, t * wobble * (1 - 0.01 * math.cos(k))


def cells(p: int, nbytes: int, t: float) -> tuple[str, str, str]:
    algbw = nbytes / t / 1e3
    return f"{t:.1f}" if t < 1e5 else f"{t:.0f}", f"{algbw:.2f}", f"{algbw * 2 * (p - 1) / p:.2f}"


def devices(p: int, nodes: int, group: bool, hash_: bool, same_pid: bool) -> list[str]:
    out = []
    for r in range(p):
        host, dev = f"dgx-a100-{r // (p // nodes):02d}", r % (p // nodes)
        pid = 41000 if same_pid else 41000 + r
        grp = " Group  0" if group else ""
        out.append(
            f"{'#' if hash_ else ' '}  Rank {r:2d}{grp} Pid {pid:6d} on {host:>12} device {dev:2d} [{BUS[dev]}] {GPU}"
        )
    return out


def old_format(path: Path, p: int, sizes: list[int]) -> None:
    """nccl-tests 2.0-era layout: no root column, 'error', device lines without '#', -g 8."""
    lines = [
        f" nThread 1 nGpus {p} minBytes {sizes[0]} maxBytes {sizes[-1]} step: 2(factor) warmup iters: 5 iters: 20 validation: 1 ",
        "",
        " Using devices",
        *devices(p, 1, False, False, True),
        "",
        "                                                     out-of-place                       in-place          ",
        "       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error",
        "        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
    ]
    for k, n in enumerate(sizes):
        (a, b, c), (d, e, f) = (cells(p, n, t) for t in times(p, 1, n, k))
        lines.append(
            f"{n:12d}  {n // 4:12d}   float     sum  {a:>7}  {b:>6}  {c:>6}  0e+00  {d:>7}  {e:>6}  {f:>6}  0e+00"
        )
    lines += [" Out of bounds values : 0 OK", " Avg bus bandwidth    : 100.0 ", ""]
    path.write_text("\n".join(lines) + "\n")


def new_format(
    path: Path,
    p: int,
    nodes: int,
    sizes: list[int],
    step: str,
    group: bool,
    repeat: int,
    info: bool,
    bumped: bool = False,
) -> None:
    """nccl-tests 2.13-era layout: root and #wrong columns; optional Group column, repeats, NCCL INFO."""
    head = [
        f"# nThread 1 nGpus 1 minBytes {sizes[0]} maxBytes {sizes[-1]} step: {step} warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0",
        "#",
        "# Using devices",
        *devices(p, nodes, group, True, False),
    ]
    lines = head * repeat
    if info:
        lines += [
            "dgx-a100-00:41000:41090 [0] NCCL INFO Bootstrap : Using ibp12s0:10.1.0.1<0>",
            "dgx-a100-00:41000:41090 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ibp12s0:10.1.0.1<0>",
            "dgx-a100-00:41000:41090 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7",
            f"dgx-a100-00:41000:41090 [0] NCCL INFO comm 0x5581 rank 0 nranks {p} cudaDev 0 busId 7000 - Init COMPLETE",
        ]
    lines += [
        "#",
        "#                                                              out-of-place                       in-place          ",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
    ]
    for k, n in enumerate(sizes):
        (a, b, c), (d, e, f) = (cells(p, n, t) for t in times(p, nodes, n, k, bumped))
        lines.append(
            f"{n:12d}  {n // 4:12d}     float     sum      -1  {a:>7}  {b:>6}  {c:>6}      0  {d:>7}  {e:>6}  {f:>6}      0"
        )
        if info and k == len(sizes) // 2:
            lines.append("dgx-a100-01:41008:41101 [0] NCCL INFO NCCL_IB_TIMEOUT set by environment to 22.")
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 100.0 ", "#", ""]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    pow2 = [8 << k for k in range(28)]  # 8 B .. 1 GiB
    old_format(HERE / "a100-1x8-old.log", 8, pow2)
    new_format(
        HERE / "a100-2x8-mpirun.log", 16, 2, [1024 << 2 * k for k in range(11)], "4(factor)", True, 2, True
    )
    new_format(HERE / "a100-4x8.log", 32, 4, pow2, "2(factor)", False, 1, False)
    step = [(4 << 20) * (k + 1) for k in range(16)]  # -b 4M -e 64M -i 4M
    new_format(HERE / "a100-1x8-step.log", 8, 1, step, "4194304(bytes)", True, 1, False)
    for p in (2, 4):
        new_format(HERE / f"a100-1x{p}-bump.log", p, 1, pow2, "2(factor)", True, 1, False, bumped=True)


if __name__ == "__main__":
    main()
