"""The commands the README and the guide mark runnable, and a runner for them.

A fenced `sh` block right after `<!-- runnable -->` is run by `make docs-check`; one after
`<!-- runnable: ci -->` is fast enough for the test suite too (tests/test_docs.py). Each block runs
as one bash script (`set -e`) in a fresh folder holding links to the repository's `tests/` and
`examples/`, with .venv/bin first on PATH, and must exit 0.

    python tests/docs_commands.py          # the ci blocks
    python tests/docs_commands.py --all    # every runnable block (make docs-check)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md", "docs/tutorial.md", "docs/how-to/*.md")
MARK = re.compile(r"<!-- runnable(: ci)? -->\s*\n```sh\n(.*?)```", re.S)
# pages whose `$ COMMAND` lines, in a fenced block with the command's output after them, are run too
SHOWN = ("docs/tutorial.md", "docs/how-to/show-a-schedule.md", "docs/how-to/calibrate.md", "docs/planner.md",
         "docs/how-to/plan-a-cluster.md")  # fmt: skip
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    script: str
    ci: bool

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(ci_only: bool = False) -> list[Block]:
    """Every runnable block of the pages, in page order."""
    out = []
    for pattern in PAGES:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text()
            for m in MARK.finditer(text):
                line = text[: m.start()].count("\n") + 1
                out.append(Block(str(path.relative_to(ROOT)), line, m.group(2), bool(m.group(1))))
    return [b for b in out if b.ci or not ci_only]


@dataclass(frozen=True)
class Shown:
    """A `$ COMMAND` line and the output printed under it (up to the next `$` line)."""

    page: str
    line: int
    command: str
    output: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def shown() -> list[Shown]:
    """Every `$ COMMAND` of the SHOWN pages, with the output the page prints for it."""
    out = []
    for page in SHOWN:
        text = (ROOT / page).read_text()
        for fence in FENCE.finditer(text):
            start = text[: fence.start(1)].count("\n") + 1
            lines = fence.group(1).splitlines()
            heads = [i for i, line in enumerate(lines) if line.startswith("$ ")]
            for k, i in enumerate(heads):
                end = heads[k + 1] if k + 1 < len(heads) else len(lines)
                out.append(Shown(page, start + i, lines[i][2:], "\n".join(lines[i + 1 : end])))
    return out


def commands(block: Block) -> list[list[str]]:
    """The block's command lines, continuations joined and comments dropped, split as bash would."""
    import shlex

    joined = block.script.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.split("#")[0].strip()]


def run(block: Block, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run one block in a fresh folder; the completed process (stdout and stderr together)."""
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory(prefix="ringtree-docs-") as tmp:
        for name in ("tests", "examples", "benchmarks"):
            (Path(tmp) / name).symlink_to(ROOT / name)
        return subprocess.run(
            ["bash", "-e", "-c", block.script],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--all", action="store_true", help="every runnable block, not only the ci ones")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per block")
    args = parser.parse_args()
    failed = []
    extra = [Block(s.page, s.line, s.command, True) for s in shown()]
    for block in [*blocks(ci_only=not args.all), *extra]:
        start = time.perf_counter()
        try:
            done = run(block, args.timeout)
            ok, tail = done.returncode == 0, done.stdout[-2000:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.timeout:.0f} s"
        print(f"{'ok  ' if ok else 'FAIL'} {block.name} ({time.perf_counter() - start:.1f} s)", flush=True)
        if not ok:
            failed.append(block.name)
            print(tail)
    print(f"{len(failed)} failed" if failed else "every runnable command ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
