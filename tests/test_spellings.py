"""One spelling per dtype and per collective, the other accepted everywhere; and piped lines whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree import dtypes
from ringtree.cli.app import app
from ringtree.train import TrainConfig

runner = CliRunner()


@pytest.mark.parametrize(
    ("name", "short", "torch"),
    [("bfloat16", "bf16", "bfloat16"), ("torch.float16", "fp16", "float16"), ("half", "fp16", "float16"),
     ("FP32", "fp32", "float32"), ("float", "fp32", "float32"), ("float8_e4m3fn", "fp8", "fp8"),
     ("int32", "int32", "int32")],
)  # fmt: skip
def test_a_dtype_has_one_spelling(name: str, short: str, torch: str) -> None:
    assert dtypes.short(name) == short
    assert dtypes.torch_name(name) == torch  # fp8: no one torch dtype


def test_train_takes_torchs_names_and_records_the_short_ones() -> None:
    cfg = TrainConfig(amp="bfloat16", compression="float16")
    assert (cfg.amp, cfg.compression) == ("bf16", "fp16")


def _json(args: list[str], path: Path) -> dict[str, object]:
    result = runner.invoke(app, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    data: dict[str, object] = json.loads(path.read_text())
    return data


def test_plan_takes_torchs_dtype_names(tmp_path: Path) -> None:
    job = ["plan", "--model", "llama3-8b", "--nodes", "2", "--cluster", "dgx-h100", "--global-batch", "64"]
    short = _json([*job, "--dtype", "bf16", "--grad-dtype", "fp32"], tmp_path / "a.json")
    long = _json([*job, "--dtype", "bfloat16", "--grad-dtype", "float32"], tmp_path / "b.json")
    assert short == long


def test_every_command_takes_both_spellings_of_a_collective(tmp_path: Path) -> None:
    for command in (["sim", "--cluster", "dgx-a100"], ["show", "ring"]):
        dashed = _json([*command, "--collective", "all-reduce"], tmp_path / "a.json")
        underscored = _json([*command, "--collective", "all_reduce"], tmp_path / "b.json")
        assert dashed == underscored, command


def test_piped_lines_are_not_wrapped_mid_line() -> None:
    out = runner.invoke(app, ["show", "ring"], env={"COLUMNS": "80"}).output
    first = out.splitlines()[0]
    whole = "ringtree show ring (all_reduce): 4 ranks on 1 node, 4MB of float32 in 4 chunks (c0 = 1MB)"
    assert first == whole
    out = runner.invoke(app, ["show", "1f1b"], env={"COLUMNS": "80"}).output
    assert any(line.startswith("bubble fraction: ") and line.endswith("= 0.273") for line in out.splitlines())
