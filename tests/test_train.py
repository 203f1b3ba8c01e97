"""The training job: config errors, models, checkpoints, and one spawned world of trainer runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.launch import spawn
from ringtree.train import TrainConfig, train
from ringtree.train.data import digits
from ringtree.train.metrics import SUMMARY_KEYS
from ringtree.train.models import ViT, build_model
from ringtree.train.trace import chrome_trace

QUICK = TrainConfig(epochs=2, progress=False)  # 2 ranks x 32: 23 steps per epoch


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model": "resnet"}, "unknown model 'resnet'; choose one of mlp, mlp-tiny, vit"),
        ({"algorithm": "rnig"}, "unknown algorithm (for mode 'ddp') 'rnig'"),
        ({"mode": "dp", "algorithm": "bfb"}, "unknown algorithm (for mode 'dp') 'bfb'"),
        ({"mode": "dp", "compression": "fp16"}, "compression works in mode 'ddp' only"),
        ({"compression": "int8"}, "unknown compression 'int8'"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"lr": -1.0}, "lr must be positive, got -1.0"),
        ({"resume": True}, "resume needs a checkpoint directory"),
    ],
)
def test_config_errors_name_the_value(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**changes)


def test_digits_split_is_fixed_and_disjoint() -> None:
    (train_a, test_a), (_, test_b) = digits(), digits()
    assert len(train_a) + len(test_a) == 1797 and len(test_a) == 359
    assert torch.equal(test_a.tensors[0], test_b.tensors[0])
    assert float(train_a.tensors[0].max()) <= 1.0


def test_models_classify_a_batch_and_vit_blocks_are_a_module_list() -> None:
    x = torch.rand(5, 64)
    for name in ("mlp", "vit"):
        assert build_model(name)(x).shape == (5, 10)
    vit = ViT(depth=3)
    assert isinstance(vit.blocks, nn.ModuleList) and len(vit.blocks) == 3
    h = vit.tokens(x)
    assert h.shape == (5, 17, 64)  # class token + 16 patches of 2x2


def test_vit_patches_follow_the_image_layout() -> None:
    vit = ViT()
    with torch.no_grad():
        vit.embed.weight.copy_(torch.eye(64, 4))  # each patch's 4 pixels land in features 0..3
        vit.embed.bias.zero_()
        vit.pos.zero_()
    img = torch.arange(64.0).view(1, 64)
    first_patch = vit.tokens(img)[0, 1, :4]
    assert first_patch.tolist() == [0.0, 1.0, 8.0, 9.0]  # the top-left 2x2 square


def run_world(rank: int, ck: str) -> dict[str, Any]:
    """Several trainer runs in one world of 2 ranks."""
    out: dict[str, Any] = {}
    full = train(rank, replace(QUICK, checkpoint_dir=f"{ck}/full"), trace=True)
    out["full"] = full.summary
    out["events"] = full.events
    first = replace(QUICK, epochs=1, checkpoint_dir=f"{ck}/part", checkpoint_every=7)
    out["first"] = train(rank, first).summary  # last checkpoint at step 21 of 23
    out["resumed"] = train(rank, replace(QUICK, checkpoint_dir=f"{ck}/part", resume=True)).summary
    out["dp"] = train(rank, replace(QUICK, epochs=1, mode="dp", algorithm="ps", accumulate=2)).summary
    out["long"] = train(rank, replace(QUICK, epochs=8)).summary
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ck = tmp_path_factory.mktemp("checkpoints")
    return spawn(run_world, 2, (str(ck),), timeout_s=240), ck


def test_summary_has_every_key(world: tuple[list[dict[str, Any]], Path]) -> None:
    summary = world[0][0]["full"]
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["world_size"] == 2 and summary["steps"] == 46 and 0 <= summary["accuracy"] <= 1
    assert summary["samples_per_s"] > 0 and 0 < summary["comm_time_s"] < summary["step_time_s"]
    other = world[0][1]["full"]  # the same numbers on every rank, but each rank's own training loss
    assert {k: v for k, v in other.items() if k != "train_loss"} == {
        k: v for k, v in summary.items() if k != "train_loss"
    }


def test_trains_to_high_accuracy(world: tuple[list[dict[str, Any]], Path]) -> None:
    assert world[0][0]["long"]["accuracy"] >= 0.93


def test_resume_continues_from_the_last_step(world: tuple[list[dict[str, Any]], Path]) -> None:
    results, ck = world
    assert results[0]["resumed"]["resumed_from_step"] == 21 and results[0]["resumed"]["steps"] == 46
    full, resumed = torch.load(ck / "full/last.pt"), torch.load(ck / "part/last.pt")
    assert full["step"] == resumed["step"] == 46
    for name, tensor in full["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), f"{name} differs after resuming"


def test_dp_mode_with_accumulation(world: tuple[list[dict[str, Any]], Path]) -> None:
    dp = world[0][0]["dp"]
    assert dp["mode"] == "dp" and dp["steps"] == 12  # ceil(23 / 2)
    assert dp["exposed_comm_time_s"] == pytest.approx(dp["comm_time_s"])


def test_trace_has_every_phase_per_rank(world: tuple[list[dict[str, Any]], Path]) -> None:
    events = world[0][0]["events"] + world[0][1]["events"]
    trace = chrome_trace(events)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "optimizer", "all_reduce bucket 0"} <= names
    buckets = [e for e in spans if e["name"].startswith("all_reduce")]
    assert all(e["tid"] == 1 and e["dur"] > 0 and e["args"]["bytes"] > 0 for e in buckets)
    json.dumps(trace)


def test_cli_writes_json_and_trace(tmp_path: Path) -> None:
    args = ["train", "--nproc", "2", "--epochs", "1", "--no-progress", "--algorithm", "double_tree"]
    out = CliRunner().invoke(
        app, [*args, "--json", str(tmp_path / "s.json"), "--trace", str(tmp_path / "t.json")]
    )
    assert out.exit_code == 0, out.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary) == list(SUMMARY_KEYS) and summary["algorithm"] == "double_tree"
    assert summary["predicted_step_time_s"] is None and "exposed_comm_time_s" in out.output
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_cli_rejects_bad_options() -> None:
    out = CliRunner().invoke(app, ["train", "--compression", "int4"])
    assert out.exit_code != 0 and "unknown compression 'int4'" in out.output
