"""benchmarks/layer_vs_planner.py: one layer timed against the planner's compute model (a GPU
script; here its CPU path, which runs the same code on a small layer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringtree.sim.network.clusters import get
from ringtree.sim.training import compute
from tests.benchmark_scripts import load


def test_every_matmul_and_the_layer_are_timed_against_the_planner(tmp_path: Path) -> None:
    out = tmp_path / "layer.json"
    args = [
        "--allow-cpu",
        "--tiny",
        "--no-compile",
        "--repeats",
        "1",
        "--preset",
        "dgx-a100",
        "--json",
        str(out),
    ]
    assert load("layer_vs_planner").main(args) == 0
    record = json.loads(out.read_text())
    items = [r["item"] for r in record["rows"]]
    assert [i.split(" (")[0] for i in items[:7]] == [
        f"matmul {n}" for n in ("q", "k", "v", "o", "gate", "up", "down")
    ]
    assert items[7:] == ["layer forward, eager", "layer backward, eager"]
    tokens = 2 * 64  # --tiny: micro-batch 2 of 64 tokens, hidden 64, SwiGLU width 128
    assert record["rows"][4]["predicted_s"] == compute.gemm_s(tokens, 128, 64, get("dgx-a100").gpu, "bf16")
    assert all(
        r["measured_s"] > 0 and r["ratio"] == r["measured_s"] / r["predicted_s"] for r in record["rows"]
    )
    assert record["shape"]["hidden"] == 64 and record["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "layer.json"
    assert load("layer_vs_planner").main(["--json", str(out)]) == 0
    assert json.loads(out.read_text())["status"].startswith("no CUDA device")
