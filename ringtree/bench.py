"""An nccl-tests-style benchmark of every collective algorithm, run side by side on one world."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringtree import comm, dtypes
from ringtree.comm import shm
from ringtree.comm.collectives import NATIVE
from ringtree.comm.reduce_ops import check_op
from ringtree.sim.network.busbw import busbw_factor
from ringtree.units import format_size

# The rows `--json` writes: exactly these keys, in this order.
ROW_KEYS = (
    "collective",
    "algorithm",
    "bytes",
    "count",
    "dtype",
    "op",
    "world_size",
    "nodes",
    "ranks_per_node",
    "transport",
    "time_us",
    "time_s",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
)


MOVING = ("all_gather", "all_to_all", "broadcast")  # collectives that reduce nothing


@dataclass(frozen=True)
class BenchConfig:
    """One sweep: sizes from min_bytes to max_bytes (x step_factor), every algorithm at each size."""

    collective: str = "all_reduce"  # or all-reduce: hyphens are read as underscores
    algorithms: tuple[str, ...] = ()  # empty: every algorithm of the collective
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    step_factor: int = 2
    dtype: str = "float32"
    op: str = "sum"
    warmup: int = 5
    iters: int = 20
    root: int = 0
    device: str = "cpu"
    timeout_s: float = comm.DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective", self.collective.replace("-", "_"))
        valid = comm.algorithms(self.collective)
        unknown = [a for a in self.algorithms if a not in valid]
        if unknown:
            raise ValueError(
                f"unknown {self.collective} algorithm(s) {', '.join(unknown)}; choose from {', '.join(valid)}"
            )
        if self.min_bytes < 0 or self.max_bytes < self.min_bytes:
            raise ValueError(
                f"--min-bytes {self.min_bytes} and --max-bytes {self.max_bytes}: the smallest size must be "
                "at least 0 and at most the largest; swap or fix them"
            )
        if self.step_factor < 2:
            raise ValueError(f"step_factor must be at least 2, got {self.step_factor}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got {self.iters} and {self.warmup}")
        check_op(self.op, torch_dtype(self.dtype))
        if self.collective in MOVING and self.op != "sum":
            raise ValueError(
                f"--op {self.op} reduces, and {self.collective.replace('_', '-')} only moves data; "
                "drop --op or bench a reducing collective (all-reduce, reduce-scatter, reduce)"
            )
        check_device(self.device)

    def algorithm_list(self) -> list[str]:
        return list(self.algorithms) or comm.algorithms(self.collective)

    def sizes(self) -> list[int]:
        """Byte sizes of the sweep, geometric from min_bytes to max_bytes."""
        out, size = [], max(self.min_bytes, 0)
        while size <= self.max_bytes:
            out.append(size)
            size = size * self.step_factor if size else 1
        return out


@dataclass(frozen=True)
class Row:
    collective: str
    algorithm: str
    bytes: int
    count: int
    dtype: str
    op: str
    world_size: int
    nodes: int  # the node shape, from torchrun's LOCAL_WORLD_SIZE (spawn: --local-size)
    ranks_per_node: int
    transport: str  # "shm" or "p2p" for ringtree's schedules, the backend's name for native
    time_us: float
    time_s: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_device(device: str) -> None:
    """cpu, or cuda[:i] on a machine that has CUDA (NCCL): refused here, not inside the workers."""
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; choose cpu (gloo) or cuda (NCCL)")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} needs a CUDA GPU and this machine has none; use --device cpu")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype not in comm.DTYPES:
        names = ", ".join(dtypes.short(str(d)) for d in comm.DTYPES)
        raise ValueError(f"unknown dtype {name!r}; choose one of {names}")
    return dtype


def environment(device: str = "cpu") -> dict[str, Any]:
    """What a reader needs to reproduce a figure: versions, backend, world, machine."""
    env = {
        "torch": torch.__version__,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "host": socket.gethostname(),
        "host_cores": os.cpu_count(),
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def run_sweep(cfg: BenchConfig, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run the sweep on the current process group; every rank returns the same rows.

    Sizes are the outer loop and algorithms the inner one, so a drift in machine load touches
    every algorithm alike. Each measurement: warm-up calls (the first one validates arguments
    across ranks), then `iters` timed calls without validation (as nccl-tests times only the
    collective), the slowest rank's mean time reported, then one checked call whose wrong
    elements are counted on every rank and summed.
    """
    dtype = torch_dtype(cfg.dtype)
    p = dist.get_world_size()
    k = int(os.environ.get("LOCAL_WORLD_SIZE", p))
    rows = []
    for count in _counts(cfg, dtype, p):
        for algorithm in cfg.algorithm_list():
            seconds = _time(cfg, algorithm, count, dtype)
            wrong = _check(cfg, algorithm, count, dtype)
            size = count * dtype.itemsize
            algbw = size / seconds / 1e9 if seconds > 0 else 0.0
            row = Row(
                cfg.collective,
                algorithm,
                size,
                count,
                cfg.dtype,
                "none" if cfg.collective in MOVING else cfg.op,  # as nccl-tests' redop column
                p,
                p // k,
                k,
                _transport(cfg, algorithm),
                seconds * 1e6,
                seconds,
                algbw,
                algbw * busbw_factor(cfg.collective, p),
                wrong,
            )
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def _transport(cfg: BenchConfig, algorithm: str) -> str:
    """How the call moved its data: shared memory or point-to-point for ringtree's schedules."""
    pg = dist.distributed_c10d._get_default_group()
    if algorithm == NATIVE:
        return dist.get_backend(pg)
    return "shm" if shm.usable(torch.device(cfg.device), pg, timedelta(seconds=cfg.timeout_s)) else "p2p"


def _counts(cfg: BenchConfig, dtype: torch.dtype, p: int) -> list[int]:
    """Element counts of the sweep; sizes that round to the same count are measured once."""
    return list(dict.fromkeys(_count(cfg.collective, nbytes, dtype, p) for nbytes in cfg.sizes()))


def _count(collective: str, nbytes: int, dtype: torch.dtype, p: int) -> int:
    """Elements of the full buffer; reduce-scatter, all-gather and all-to-all round down to a
    multiple of p (all-to-all: the per-rank buffer, p equal blocks, as nccl-tests' size column)."""
    count = nbytes // dtype.itemsize
    return count - count % p if collective in ("reduce_scatter", "all_gather", "all_to_all") else count


class _Case:
    """Buffers and the call for one (collective, algorithm, count): input, output, expected."""

    def __init__(self, cfg: BenchConfig, algorithm: str, count: int, dtype: torch.dtype) -> None:
        self.cfg, self.algorithm = cfg, algorithm
        self.p, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = torch.device(cfg.device)
        self.n = count // self.p if cfg.collective in ("reduce_scatter", "all_gather") else count
        self.full = count
        self.dtype = dtype
        self.reset()

    def values(self, rank: int, count: int, offset: int = 0) -> torch.Tensor:
        """Small integers, exact in every dtype once reduced (products stay powers of two)."""
        i = torch.arange(offset, offset + count, device=self.device)
        v = 1 + (i + rank) % 2 if self.cfg.op == "product" else 1 + (i + 3 * rank) % 4
        return v.to(self.dtype)

    def reset(self) -> None:
        c = self.cfg.collective
        if c == "all_gather":
            self.input = self.values(self.rank, self.n, self.rank * self.n)
            self.output = torch.empty(self.full, dtype=self.dtype, device=self.device)
        elif c == "reduce_scatter":
            self.input = self.values(self.rank, self.full)
            self.output = torch.empty(self.n, dtype=self.dtype, device=self.device)
        elif c == "all_to_all":
            self.input = self.values(self.rank, self.full)
            self.output = torch.empty(self.full, dtype=self.dtype, device=self.device)
        else:
            self.input = self.values(self.rank, self.full)
            self.output = self.input

    def call(self, validate: bool) -> None:
        c, a, op, t = self.cfg.collective, self.algorithm, self.cfg.op, self.cfg.timeout_s
        if c == "all_reduce":
            comm.all_reduce(self.input, op, a, timeout_s=t, validate=validate)
        elif c == "reduce_scatter":
            comm.reduce_scatter(self.output, self.input, op, a, timeout_s=t, validate=validate)
        elif c == "all_gather":
            comm.all_gather(self.output, self.input, a, timeout_s=t, validate=validate)
        elif c == "all_to_all":
            comm.all_to_all_single(self.output, self.input, algorithm=a, timeout_s=t, validate=validate)
        elif c == "broadcast":
            comm.broadcast(self.input, self.cfg.root, a, timeout_s=t, validate=validate)
        else:
            comm.reduce(self.input, self.cfg.root, op, a, timeout_s=t, validate=validate)

    def expected(self) -> torch.Tensor | None:
        """What this rank must hold afterwards (None where the collective promises nothing)."""
        c, p = self.cfg.collective, self.p
        if c == "all_gather":
            return torch.cat([self.values(r, self.n, r * self.n) for r in range(p)])
        if c == "all_to_all":  # block i: rank i's block for this rank
            b = self.full // p
            return torch.cat(
                [self.values(r, self.full)[self.rank * b : (self.rank + 1) * b] for r in range(p)]
            )
        if c == "broadcast":
            return self.values(self.cfg.root, self.full)
        if c == "reduce" and self.rank != self.cfg.root:
            return None
        every = torch.stack([self.values(r, self.full).to(torch.float64) for r in range(p)])
        reduced = {
            "sum": every.sum(0),
            "avg": every.mean(0),
            "product": every.prod(0),
            "max": every.amax(0),
            "min": every.amin(0),
        }[self.cfg.op]
        if self.dtype.is_floating_point:
            reduced = reduced.to(self.dtype)
        else:
            reduced = reduced.to(torch.int64).to(self.dtype)  # integer overflow wraps, as in the ranks
        if c == "reduce_scatter":
            return reduced[self.rank * self.n : (self.rank + 1) * self.n]
        return reduced


def _time(cfg: BenchConfig, algorithm: str, count: int, dtype: torch.dtype) -> float:
    case = _Case(cfg, algorithm, count, dtype)
    for i in range(cfg.warmup):
        case.call(validate=i == 0)
    if cfg.warmup == 0:
        case.call(validate=True)
    _sync(case.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg.iters):
        case.call(validate=False)
    _sync(case.device)
    mine = torch.tensor([(time.perf_counter() - start) / cfg.iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def _check(cfg: BenchConfig, algorithm: str, count: int, dtype: torch.dtype) -> int:
    case = _Case(cfg, algorithm, count, dtype)
    case.call(validate=False)
    want = case.expected()
    wrong = torch.zeros(1, dtype=torch.int64)
    if want is not None:
        got = case.output.to(torch.float64).cpu()
        ref = want.to(torch.float64).cpu()
        tol = (
            0.0
            if cfg.op != "avg"
            else 4 * torch.finfo(dtype).eps * max(1.0, float(ref.abs().max()) if ref.numel() else 0.0)
        )
        wrong[0] = int(((got - ref).abs() > tol).sum())
    dist.all_reduce(wrong)
    return int(wrong.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, cfg: BenchConfig, show_progress: bool = True) -> list[dict[str, Any]]:
    """Entry point for each spawned rank: run the sweep, rank 0 reporting progress."""
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        cfg = BenchConfig(**{**asdict(cfg), "device": f"cuda:{torch.cuda.current_device()}"})
    if rank != 0 or not show_progress:
        return [r.as_dict() for r in run_sweep(cfg)]
    if "TORCHELASTIC_RUN_ID" in os.environ and not sys.stderr.isatty():  # torchrun's logs, emulate's
        # node 0: no bar shows there, and a default sweep on a slow link takes minutes
        return [r.as_dict() for r in run_sweep(cfg, on_row=SizesDone(cfg, _sizes(cfg)))]
    from rich.progress import Progress

    total = len(_counts(cfg, torch_dtype(cfg.dtype), dist.get_world_size())) * len(cfg.algorithm_list())
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{cfg.collective} x {dist.get_world_size()} ranks", total=total)
        rows = run_sweep(cfg, on_row=lambda _: bar.advance(task))
    return [r.as_dict() for r in rows]


def _sizes(cfg: BenchConfig) -> list[int]:
    """The byte sizes the sweep measures (each a whole number of elements)."""
    dtype = torch_dtype(cfg.dtype)
    return [c * dtype.itemsize for c in _counts(cfg, dtype, dist.get_world_size())]


class SizesDone:
    """A `#` line on stderr as each size is done, where no progress bar can show: the size, how
    many of the sweep's are done, the time so far and an estimate of the rest, from the sizes
    done as alpha + beta x bytes (alpha: the first size's time, beta: the last's growth over it)."""

    def __init__(self, cfg: BenchConfig, sizes: list[int], clock: Callable[[], float] = time.monotonic):
        self.per_size, self.sizes, self.clock = len(cfg.algorithm_list()), sizes, clock
        self.start, self.rows = clock(), 0
        self.times = [self.start]  # when each size ended, after the start

    def __call__(self, row: Row) -> None:
        self.rows += 1
        if self.rows % self.per_size:
            return
        self.times.append(self.clock())
        print(self.line(self.rows // self.per_size), file=sys.stderr, flush=True)

    def line(self, done: int) -> str:
        elapsed = self.times[-1] - self.start
        size, n = format_size(self.sizes[done - 1]), len(self.sizes)
        said = f"# {size} done ({done} of {n} sizes) in {_duration(elapsed)}"
        if done == len(self.sizes):
            return said
        return f"{said}; about {_duration(self.rest(done))} left"

    def rest(self, done: int) -> float:
        """Seconds the sizes not done yet would take at alpha + beta x bytes."""
        alpha = self.times[1] - self.times[0]
        last = self.times[done] - self.times[done - 1]
        grown = self.sizes[done - 1] - self.sizes[0]
        beta = max(0.0, last - alpha) / grown if grown > 0 else 0.0
        return sum(alpha + beta * (size - self.sizes[0]) for size in self.sizes[done:])


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.1f} s"
        if seconds < 10
        else f"{seconds:.0f} s"
        if seconds < 120
        else f"{seconds / 60:.1f} min"
    )
