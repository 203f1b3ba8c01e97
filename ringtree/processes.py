"""Joining a process group: under torchrun as it is, or as N local processes spawned by torch.

ringtree never replaces the launcher: under torchrun (one node or many) it joins the world
torchrun set up. Without torchrun, `spawn` starts N local workers with torch.multiprocessing
and a file-based rendezvous (no ports to choose), for `--nproc N` and for the tests.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.util
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore  # type: ignore[attr-defined]  # exported, not in __all__
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
        with _workers_start_deaf():  # a Ctrl-C while they import is this process's alone to report
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
    # Started deaf to Ctrl-C (_workers_start_deaf); from here torch's own wrapper takes a
    # KeyboardInterrupt quietly while this process's parent kills the world and reports it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


class WorkerError(Exception):
    """What a local worker said when it stopped the run: a user's mistake (a ValueError or
    TypeError, code 2) or any error before training started (code 1), in one sentence."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


_started = False  # set in a worker when the training loop begins (training_started)


def training_started() -> None:
    """Mark this worker's training as begun: a failure from here on is torch's report, with its
    traceback and the elastic agent's restarts; before, it is one sentence (WorkerError)."""
    global _started
    _started = True


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
    127.0.0.1 with a port the agent picks. A worker that raises ValueError or TypeError (a user's
    mistake), or any error before training_started(), makes it raise WorkerError with that one
    sentence (the lowest rank's); any other failure raises torch's ChildFailedError naming the
    failed rank and its exit code. The agent's logs go to a temporary folder removed at the end.
    """
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"need nproc >= 1 and max_restarts >= 0, got {nproc} and {max_restarts}")
    # The rendezvous store shared with the workers keeps a killed attempt's keys, and a restarted
    # gloo or NCCL group can read them and connect to a dead port (pytorch/pytorch#135712): give
    # each attempt its own store, as that issue advises.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="ringtree-elastic-") as folder:
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
            logs_specs=DefaultLogsSpecs(log_dir=folder),  # not a /tmp/torchelastic_* left behind
            # Not SIGINT: the agent would pass it on to workers still deaf to it and wait for them.
            # Ctrl-C raises KeyboardInterrupt here instead, and the agent stops them with SIGTERM.
            signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
        )
        _quiet_shutdown_logs()
        with _agent_quiet_after(Path(folder)), _workers_start_deaf():
            try:
                results = elastic_launch(config, _elastic_worker)(
                    fn, backend, collective_timeout_s, folder, *args
                )
            except ChildFailedError:
                said = _what_workers_said(Path(folder))
                if said is None:
                    raise
                raise said from None
    return [results[r] for r in range(nproc)]


@contextlib.contextmanager
def _workers_start_deaf() -> Iterator[None]:
    """Workers start with SIGINT ignored (a disposition that survives exec, and that Python keeps)
    and hear it again once they run ringtree's code (_worker, _elastic_worker): a Ctrl-C while
    they import torch and ringtree reaches only this process, which stops them and says so in one
    line, instead of a traceback or a line of their own from every one. This process ignores it
    only for the instant of each fork and exec (multiprocessing's spawn goes through
    util.spawnv_passfds)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start = multiprocessing.util.spawnv_passfds

    def deaf(path: Any, args: Any, passfds: Any) -> int:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return start(path, args, passfds)
        finally:
            signal.signal(signal.SIGINT, previous)

    multiprocessing.util.spawnv_passfds = deaf
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = start


class _AfterWorkerSaid(logging.Filter):
    """Drops the agent's report of a failed worker (its traceback, the terminated peers) once a
    worker has said why it stopped: that one sentence is the run's last word."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(self.folder.glob("said-*"))


_AGENT_LOGGERS = (
    "torch.multiprocessing.spawn",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.launcher.api",
)


@contextlib.contextmanager
def _agent_quiet_after(folder: Path) -> Iterator[None]:
    quiet = _AfterWorkerSaid(folder)
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def _what_workers_said(folder: Path) -> WorkerError | None:
    """The lowest rank's sentence (said-<rank>: its exit code, then the text), if any said one."""
    said = sorted(folder.glob("said-*"), key=lambda p: int(p.name.split("-")[1]))
    if not said:
        return None
    code, _, message = said[0].read_text().partition("\n")
    return WorkerError(message, int(code))


class _ShutdownNotices(logging.Filter):
    """Drops the agent's notices that it is stopping the workers on a signal: an interrupted run
    says so in one line of its own (`interrupted at step S; ...`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(
            s in str(record.msg)
            for s in ("death signal", "Closing process", "termination signal", "Unable to shutdown")
        )


def _quiet_shutdown_logs() -> None:
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ShutdownNotices) for f in logger.filters):
            logger.addFilter(_ShutdownNotices())


def _elastic_worker(
    fn: Callable[..., Any], backend: str, collective_timeout_s: float, folder: str, *args: Any
) -> Any:
    """One worker of elastic_spawn: join the attempt's world, run, leave. Its result travels
    back through the agent, so it returns normally (no early exit as in `spawn`)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # started deaf to Ctrl-C
        torch.set_num_threads(1)  # N processes share the host's cores: one intra-op thread each
        if backend == "nccl":  # one GPU per local rank, bound before the group is made
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_from_env(backend, collective_timeout_s)
        return fn(dist.get_rank(), *args)
    except KeyboardInterrupt:  # Ctrl-C reached the workers too: the launcher says where it stopped
        _exit_now(130)
    except Exception as e:
        _say(Path(folder), e)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _say(folder: Path, error: Exception) -> None:
    """A user's mistake, or a failure before training began: its one sentence to the launcher
    (said-<rank>, written whole by a rename), and leave without a traceback."""
    mistake = isinstance(error, ValueError | TypeError)
    if _started and not mistake:
        return  # a failure mid-run: torch's report, and the agent's restarts
    rank = os.environ.get("RANK", "0")
    text = str(getattr(error, "cli", error))
    if not mistake:
        text = f"rank {rank} failed before training started: {type(error).__name__}: {text}"
    tmp = folder / f".said-{rank}"
    tmp.write_text(f"{2 if mistake else 1}\n{text}")
    tmp.rename(folder / f"said-{rank}")
    _exit_now(2 if mistake else 1)


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
