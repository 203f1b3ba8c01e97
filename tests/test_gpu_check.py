"""benchmarks/gpu_check.py: without CUDA it says so and exits 0; its checks run on CPU with --allow-cpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_writes_the_json_and_exits_0(tmp_path: Path) -> None:
    done = _run(tmp_path, "--json", "out.json")
    assert done.returncode == 0, done.stderr
    assert "no CUDA device: nothing to check" in done.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["cuda"] is False and data["message"] == "no CUDA device: nothing to check"
    again = _run(tmp_path, "--json", "out.json")  # never overwrites a file silently
    assert again.returncode == 2 and "out.json exists" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA --allow-cpu changes nothing: it runs on the GPUs"
)
def test_the_checks_pass_on_cpu_with_two_ranks(tmp_path: Path) -> None:
    done = _run(tmp_path, "--json", "cpu.json", "--allow-cpu", "--nproc", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads((tmp_path / "cpu.json").read_text())["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert all(v["ok"] for k, v in r["ddp"].items() if k != "seconds"), r["ddp"]
        assert r["tp"]["ok"] and r["pp"]["ok"], (r["tp"], r["pp"])
        assert r["zero_bubble"]["ok"] and "zb_v_bubble_fraction" in r["zero_bubble"], r["zero_bubble"]
        assert all(v["ok"] for k, v in r["zero"].items() if k != "seconds"), r["zero"]
        assert all(v["ok"] for k, v in r["moe"].items() if k != "seconds"), r["moe"]
        assert all(v["ok"] for k, v in r["diloco"].items() if k != "seconds"), r["diloco"]
        assert all(v["ok"] for k, v in r["powersgd"].items() if k != "seconds"), r["powersgd"]
        assert "skipped" in r["amp"] and "skipped" in r["h2d"]  # CUDA-only paths say why they did not run
        assert r["trace"]["ok"], r["trace"]  # profiled, then read back by ringtree trace
