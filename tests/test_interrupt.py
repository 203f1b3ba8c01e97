"""Ctrl-C: an interrupted command prints one line and exits 130, with no traceback from torch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(args: list[str], ready: Callable[[int], bool], timeout: float = 120) -> tuple[int, str]:
    """Start `ringtree ARGS` in its own process group, wait until ready(its pid), Ctrl-C the group (as a
    terminal does); return its exit code and stderr. The command starts with SIGINT's default
    action, as from a terminal, even where these tests run from a background shell (which
    ignores SIGINT for its children)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(
        [sys.executable, "-m", "ringtree", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready(job.pid) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.poll() is None, "the command ended before it could be interrupted"
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job.returncode, err


def test_ctrl_c_in_train_says_where_it_stopped_in_one_line(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    code, err = _interrupt(
        ["train", "--nproc", "2", "--model", "mlp-tiny", "--epochs", "1000", "--no-progress",
         "--checkpoint-dir", str(ck), "--checkpoint-every", "2"],
        lambda _: len(list(ck.glob("step-*.json"))) >= 2,
    )  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130, err
    assert "Traceback" not in err and "SignalException" not in err and "death signal" not in err, err
    m = re.fullmatch(r"interrupted at step (\d+); last checkpoint: (.*step-(\d+)\.pt)", lines[-1])
    assert m is not None and len(lines) == 1, err
    assert Path(m.group(2)).is_file() and int(m.group(1)) >= int(m.group(3)) >= 2


def test_ctrl_c_in_bench_exits_130_in_one_line(tmp_path: Path) -> None:
    started = time.monotonic()
    code, err = _interrupt(
        ["bench", "--nproc", "2", "--max-bytes", "64M", "--json", str(tmp_path / "rows.json")],
        lambda _: time.monotonic() - started > 8,
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and lines == ["ringtree bench: interrupted; nothing written"], err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_in_bench_while_its_workers_import_is_one_line(tmp_path: Path) -> None:
    started: list[Callable[[], bool]] = []

    def importing(pid: int) -> bool:  # its workers spawned, still importing torch and ringtree
        if not started:
            started.append(_workers_started(pid))
        return started[0]()

    code, err = _interrupt(
        ["bench", "--nproc", "2", "--max-bytes", "64M", "--json", str(tmp_path / "rows.json")], importing
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130 and lines == ["ringtree bench: interrupted; nothing written"], err
    assert list(tmp_path.iterdir()) == []


def _workers_started(launcher: int) -> Callable[[], bool]:
    """True half a second after the launcher spawned its first worker: past the instant of its
    fork and exec, while it imports torch (seconds)."""
    seen: list[float] = []

    def started() -> bool:
        if not seen and _a_worker_of(launcher):
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 0.5

    return started


def _a_worker_of(pid: int) -> bool:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(x for x in status.read_text().splitlines() if x.startswith("PPid:"))
            cmdline = (status.parent / "cmdline").read_bytes()
        except (OSError, StopIteration):
            continue
        if int(ppid.split()[1]) == pid and b"spawn_main" in cmdline:
            return True
    return False


def test_ctrl_c_while_workers_start_is_one_line(tmp_path: Path) -> None:
    launcher: list[subprocess.Popen[str]] = []
    real_popen = subprocess.Popen

    started: list[Callable[[], bool]] = []

    def remember(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        launcher.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        started.append(_workers_started(launcher[-1].pid))
        return launcher[-1]

    subprocess.Popen = remember  # type: ignore[misc, assignment]
    try:
        code, err = _interrupt(
            ["train", "--nproc", "2", "--model", "mlp-tiny", "--no-progress"],
            lambda _: bool(launcher) and started[0](),
        )
    finally:
        subprocess.Popen = real_popen  # type: ignore[misc]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert lines == ["interrupted at step 0; last checkpoint: none (no --checkpoint-dir)"], err
