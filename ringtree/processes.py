"""Joining a process group: under torchrun as it is, or as N local processes spawned by torch.

ringtree never replaces the launcher: under torchrun (one node or many) it joins the world
torchrun set up. Without torchrun, `spawn` starts N local workers with torch.multiprocessing
and a file-based rendezvous (no ports to choose), for `--nproc N` and for the tests.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore  # type: ignore[attr-defined]  # exported, not in __all__
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.multiprocessing.spawn import start_processes

from ringtree.comm.collectives import DEFAULT_TIMEOUT_S


def under_torchrun() -> bool:
    """True when torchrun (or another launcher speaking its protocol) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(device: str = "cpu") -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_from_env(backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the world torchrun describes in the environment (env:// rendezvous)."""
    whole_lines()
    if dist.is_initialized():
        return
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def whole_lines() -> None:
    """Make every printed line one write to stdout and stderr.

    torchrun starts its workers with `python -u`: print() then writes the text and the newline in
    two calls, and the ranks of a node share their agent's stdout, so two ranks printing at the
    same moment can interleave as "line A" "line B" "\n" "\n": a reader splitting on newlines
    then sees one rank's line fewer (issue 24, item 4). Line buffering keeps each line whole.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:
            stream.reconfigure(write_through=False, line_buffering=True)


def run_under_torchrun(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Join the world torchrun set up, run fn(rank, *args) on this rank, and leave it cleanly.

    Destroying the process group before the interpreter exits matters: a gloo group left to
    Python's teardown can abort the process after a successful run.
    """
    init_from_env(backend, timeout_s)
    try:
        return fn(dist.get_rank(), *args)
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple[Any, ...] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    local_world_size: int | None = None,
    collective_timeout_s: float = DEFAULT_TIMEOUT_S,
    allow_missing: bool = False,
) -> list[Any]:
    """Run fn(rank, *args) on nproc local processes in one process group; return each rank's result.

    A worker that raises makes spawn raise with its traceback (the others are terminated); a
    world that has not finished within timeout_s is killed and raises TimeoutError. Nothing hangs.
    `local_world_size` pretends the processes sit on nproc/local_world_size nodes, so that
    topology-aware algorithms can be exercised on one machine. A rank that exits cleanly without
    returning (os._exit(0), as fault tests do) is an error, or None with allow_missing=True.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    local = nproc if local_world_size is None else local_world_size
    if local < 1 or nproc % local:
        raise ValueError(f"local_world_size={local} must divide nproc={nproc}")
    with tempfile.TemporaryDirectory(prefix="ringtree-") as tmp:
        ctx = start_processes(  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            _worker,
            args=(fn, nproc, local, backend, collective_timeout_s, tmp, args),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not _joined(ctx):
            if time.monotonic() > deadline:
                _kill(ctx)
                raise TimeoutError(
                    f"{nproc} ranks running {getattr(fn, '__name__', fn)} did not finish within "
                    f"{timeout_s:.0f}s; they were killed"
                )
        return [_load(Path(tmp) / f"result-{r}.pkl", r, allow_missing) for r in range(nproc)]


def _joined(ctx: Any) -> bool:
    """Whether every worker has finished; on Ctrl-C, the workers are killed and it propagates."""
    try:
        return bool(ctx.join(timeout=0.2))
    except KeyboardInterrupt:
        _kill(ctx)
        raise


def _kill(ctx: Any) -> None:
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()


def _worker(
    rank: int,
    fn: Callable[..., Any],
    nproc: int,
    local: int,
    backend: str,
    collective_timeout_s: float,
    tmp: str,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank % local),
        LOCAL_WORLD_SIZE=str(local),
        GROUP_RANK=str(rank // local),
    )
    torch.set_num_threads(1)  # N processes share the host's cores: one intra-op thread each
    store = FileStore(os.path.join(tmp, "rendezvous"), nproc)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=nproc,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    try:
        result = fn(rank, *args)
        with open(os.path.join(tmp, f"result-{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
    # The work is done and its result saved: leave without interpreter teardown, where torch's
    # C++ destructors occasionally abort a loaded machine's worker ("terminate called without an
    # active exception") after a clean run. A worker that raised took the normal path above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def elastic_spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple[Any, ...] = (),
    *,
    max_restarts: int = 0,
    backend: str = "gloo",
    collective_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run fn(rank, *args) on nproc local workers under torch's elastic agent; return each result.

    The same agent torchrun runs: a worker that dies (SIGKILL, OOM) makes it stop the group and
    start it again, up to `max_restarts` times, with TORCHELASTIC_RESTART_COUNT counting the
    attempts, so a local run restarts exactly as a cluster job would. Rendezvous is c10d on
    127.0.0.1 with a port the agent picks. A run that fails after its restarts raises
    torch's ChildFailedError naming the failed rank and its exit code.
    """
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"need nproc >= 1 and max_restarts >= 0, got {nproc} and {max_restarts}")
    # The rendezvous store shared with the workers keeps a killed attempt's keys, and a restarted
    # gloo or NCCL group can read them and connect to a dead port (pytorch/pytorch#135712): give
    # each attempt its own store, as that issue advises.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ringtree-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    _quiet_shutdown_logs()
    results = elastic_launch(config, _elastic_worker)(fn, backend, collective_timeout_s, *args)
    return [results[r] for r in range(nproc)]


class _ShutdownNotices(logging.Filter):
    """Drops the agent's notices that it is stopping the workers on a signal: an interrupted run
    says so in one line of its own (`interrupted at step S; ...`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(
            s in str(record.msg) for s in ("death signal", "Closing process", "termination signal")
        )


def _quiet_shutdown_logs() -> None:
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShutdownNotices) for f in logger.filters):
            logger.addFilter(_ShutdownNotices())


def _elastic_worker(fn: Callable[..., Any], backend: str, collective_timeout_s: float, *args: Any) -> Any:
    """One worker of elastic_spawn: join the attempt's world, run, leave. Its result travels
    back through the agent, so it returns normally (no early exit as in `spawn`)."""
    torch.set_num_threads(1)  # N processes share the host's cores: one intra-op thread each
    if backend == "nccl":  # one GPU per local rank, bound before the group is made
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_from_env(backend, collective_timeout_s)
    try:
        return fn(dist.get_rank(), *args)
    except KeyboardInterrupt:  # Ctrl-C reached the workers too: the launcher says where it stopped
        _exit_now(130)
    finally:
        dist.destroy_process_group()


def _exit_now(code: int) -> None:
    """Leave at once, without a traceback or a wait on peers that are leaving too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this worker's group (0 on the first try)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _load(path: Path, rank: int, allow_missing: bool) -> Any:
    if not path.exists():
        if allow_missing:
            return None
        raise RuntimeError(f"rank {rank} exited without returning a result")
    with open(path, "rb") as f:
        return pickle.load(f)
