"""Every command's JSON: one key per quantity, each documented in its command's table in docs/."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from json_tables import documented, keys
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.train import TrainConfig, Trainer
from ringtree.train.summary import METRIC_KEYS, MOE_KEYS, PIPELINE_KEYS, THREAD_KEYS


def test_bench_rows_have_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "--nproc", "2", "--algorithms", "ring", "--min-bytes", "1K", "--max-bytes", "1K"]
    result = CliRunner().invoke(app, [*args, "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    table = documented("collectives.md", "bench")
    assert len(set(table)) == len(table)
    assert [keys(row) for row in json.loads(out.read_text())] == [table]


def test_the_doctor_report_has_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    args = ["doctor", "--nproc", "2", "--local-size", "1", "--size", "4K", "--iters", "1"]
    result = CliRunner().invoke(app, [*args, "--matmul", "16", "--json", str(out)])
    assert result.exit_code in (0, 1), result.output  # 1: a suspect, which a loaded host may make
    report = json.loads(out.read_text())
    report["mismatches"] = [{"rank": 1, "key": "torch", "value": "x", "rank0": "y"}]  # what one holds
    report["suspects"] = [{"node": 1, "rank": 1, "kind": "link", "measured": 0.1, "expected": 1.0}]
    table = documented("emulate.md", "doctor")
    assert len(set(table)) == len(table)
    assert sorted(keys(report)) == sorted(table)


@pytest.mark.parametrize("layout", [{}, {"pp": 2, "micro_batches": 2}, {"mode": "dp-threads"}])
def test_the_train_summary_has_the_documented_keys(layout: dict[str, Any]) -> None:
    table = documented("training.md", "train")
    assert len(set(table)) == len(table)
    assert set(table) == {*METRIC_KEYS, *PIPELINE_KEYS, *THREAD_KEYS, *MOE_KEYS, "recipe"}
    options = {f.name for f in fields(TrainConfig)}
    # a measured key stands for its option only where they are one quantity (the mesh's tp, pp and
    # cp, the segments the stages really checkpointed, the MoE layers' experts and top-k, how the
    # replicas synchronised: the method, the replica groups in effect and their inner steps)
    one = {"tp", "pp", "cp", "ep", "experts", "top_k", "checkpoint_segments"}
    one |= {"sync", "replicas", "inner_steps"}
    assert set(table) & options == one
    if layout.get("pp"):
        return  # a pipeline needs two ranks: its keys are checked above, against summary.py
    data = TensorDataset(__import__("torch").randn(64, 4), __import__("torch").randint(0, 2, (64,)))
    cfg = TrainConfig(epochs=1, batch_size=16, progress=False, **layout)
    summary = Trainer(nn.Linear(4, 2), data, nn.CrossEntropyLoss(), cfg).fit()
    assert set(summary) <= set(table) | options, set(summary) - set(table) - options


@pytest.mark.parametrize(
    ("args", "page", "command"),
    [
        (["show", "ring", "--ranks", "4"], "collectives.md", "show"),
        (["show", "1f1b", "--stages", "2", "--micro-batches", "2"], "pipeline.md", "show-pipeline"),
        (["show", "moe-dispatch", "--ranks", "2", "--experts", "4"], "moe.md", "show-moe"),
        (["show", "bruck", "--ranks", "4"], "all-to-all.md", "show-a2a"),
    ],
)
def test_show_json_has_the_documented_keys(tmp_path: Path, args: list[str], page: str, command: str) -> None:
    out = tmp_path / "show.json"
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    table = documented(page, command)
    assert len(set(table)) == len(table)
    assert sorted(keys(json.loads(out.read_text()))) == sorted(table)


def test_sim_rows_have_the_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = ["sim", "--cluster", "dgx-h100", "--nodes", "2", "--algorithm", "native", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = documented("simulator.md", "sim")
    assert len(set(table)) == len(table)
    rows = json.loads(out.read_text())
    assert rows and all(keys(row) == table for row in rows)


def test_calibrate_writes_the_documented_keys_once(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    logs = Path(__file__).parent / "data" / "nccl-tests"
    args = ["calibrate", str(logs / "a100-1x8-old.log"), str(logs / "a100-2x8-mpirun.log"), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    table = documented("simulator.md", "calibrate")
    assert len(set(table)) == len(table)
    data = json.loads(out.read_text())
    assert set(keys(data)) <= set(table), set(keys(data)) - set(table)
    assert set(table) - set(keys(data)) == {"inter_bandwidth_Bps"}  # two-level bench fits only
    assert not {"rows", "rms_rel_error", "max_rel_error", "levels"} & set(data["nccl"])  # the top's


def test_checkpoint_inspect_json_has_the_documented_keys(tmp_path: Path) -> None:
    data = TensorDataset(__import__("torch").randn(32, 4), __import__("torch").randint(0, 2, (32,)))
    cfg = TrainConfig(epochs=1, batch_size=16, progress=False, checkpoint_dir=str(tmp_path / "ck"))
    Trainer(nn.Linear(4, 2), data, nn.CrossEntropyLoss(), cfg).fit()
    out = tmp_path / "inspect.json"
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(tmp_path / "ck"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    table = documented("checkpoints.md", "checkpoint-inspect")
    assert sorted(keys(json.loads(out.read_text()))) == sorted(table)
