"""What happens to the ranks' printed lines under torchrun (issue 24, item 4: in about one run of
four under load, a two-node job whose agents both exited 0 showed three of its four ranks' lines).

Nothing is lost: torchrun starts every worker with `python -u` and, without --tee/--redirects,
lets it write straight to the agent's stdout, which the node's ranks share. Under `-u`, print()
writes the text and the newline in two calls, so two ranks printing at the same moment can
interleave as "line A" "line B" "\\n" "\\n", and a reader counting lines sees one rank's line
fewer. ringtree.processes.whole_lines (called when ringtree joins a torchrun world) makes each line
one write."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from ringtree.processes import whole_lines

SCRIPT = """
import sys
print(sys.stdout.write_through, sys.stdout.line_buffering)
"""


def test_torchrun_workers_write_through_unbuffered(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(script),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]  # torchrun's `python -u`: every write goes out as is


class _Pipe(io.RawIOBase):
    """A stand-in for the agent's pipe that records each write() the way the kernel receives it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        data = bytes(b)  # type: ignore[call-overload]
        self.writes.append(data)
        return len(data)


def test_a_print_under_python_u_is_two_writes_and_whole_lines_makes_it_one() -> None:
    pipe = _Pipe()
    out = io.TextIOWrapper(pipe, write_through=True)  # what `python -u` makes of a pipe
    print("rank 1 done", file=out)
    assert pipe.writes == [b"rank 1 done", b"\n"]  # another rank's write can land in between
    pipe.writes.clear()
    saved = sys.stdout
    sys.stdout = out
    try:
        whole_lines()
        print("rank 1 done")
    finally:
        sys.stdout = saved
    assert pipe.writes == [b"rank 1 done\n"]
