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
from ringtree.processes import spawn
from ringtree.train import RankResult, TrainConfig, Trainer
from ringtree.train.config import ConfigError, effective
from ringtree.train.data import digits
from ringtree.train.models import MLP, ViT, build_model, wide_mlp
from ringtree.train.summary import METRIC_KEYS
from ringtree.train.trace import chrome_trace

QUICK = TrainConfig(epochs=2, progress=False)  # 2 ranks x 32: 23 steps per epoch


def train(rank: int, cfg: TrainConfig, trace: bool = False) -> RankResult:
    """What `ringtree train` runs on each rank."""
    return Trainer.from_config(cfg, trace=trace).run()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"model": "resnet"}, "unknown model 'resnet'; choose one of mlp, mlp-tiny, vit"),
        ({"algorithm": "rnig"}, "unknown algorithm (for mode 'ddp') 'rnig'"),
        ({"mode": "dp", "algorithm": "bfb"}, "unknown algorithm (for mode 'dp') 'bfb'"),
        ({"mode": "dp", "compression": "fp16"}, "--compression: options of DDP's buckets"),
        ({"mode": "dp", "bucket_mb": 1.0}, "--bucket-mb: options of DDP's buckets"),
        ({"mode": "dp", "pp": 2}, "--mode dp steps the whole model on rank 0"),
        ({"schedule": "gpipe"}, "--schedule needs --pp 2 or more"),
        ({"micro_batches": 8}, "--micro-batches needs --pp 2 or more"),
        ({"distill_alpha": 0.3}, "--distill-alpha needs --teacher"),
        ({"tp_plan": {"0": "colwise"}}, "--tp-plan shards layers among --tp ranks; add --tp 2"),
        ({"pp": 2, "schedule": "pipedream", "accumulate": 2}, "cannot apply"),
        ({"model": "nodots"}, "choose one of mlp, mlp-tiny, vit, gpt, gpt-tied, moe or pkg.mod:factory"),
        ({"compression": "int8"}, "unknown compression 'int8'"),
        ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
        ({"lr": -1.0}, "--lr must be positive, got -1.0"),
        ({"resume": True}, "--resume needs a checkpoint directory"),
    ],
)
def test_config_errors_name_the_value(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**changes)
    assert words in caught.value.cli  # the command line reads its flags


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"micro_batches": 8}, "micro_batches needs pp=2 or more; drop it or add pp"),
        ({"tp_plan": {"0": "colwise"}}, "tp_plan shards layers among tp ranks; add tp=2 or more"),
        ({"mode": "dp", "overlap": False}, "overlap: options of DDP's buckets, which mode=dp does not have"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"timeout_s": -1.0}, "timeout_s must be positive"),
        ({"teacher": "/no/such/dir"}, "train one first with `ringtree train --checkpoint-dir DIR`"),
    ],
)
def test_config_errors_from_python_name_the_field(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as caught:
        TrainConfig(**changes)
    assert words in str(caught.value)
    flags = str(caught.value).split("`")[0::2]  # a quoted command may hold flags
    assert not any("--" in part for part in flags), str(caught.value)


def test_a_value_that_changes_nothing_is_accepted() -> None:
    assert TrainConfig(micro_batches=1).micro_batches == 1  # one micro-batch, no pipeline: the same run
    assert "micro_batches" not in effective(TrainConfig(micro_batches=1))


def test_the_effective_configuration_leaves_out_what_had_no_effect() -> None:
    plain = effective(TrainConfig())
    assert plain["bucket_mb"] == 25.0 and plain["overlap"] is True and plain["timeout_s"] == 60.0
    assert "schedule" not in plain and "distill_alpha" not in plain and "checkpoint_segments" not in plain
    master = effective(TrainConfig(mode="dp", algorithm="ps"))
    assert "bucket_mb" not in master and "overlap" not in master and "compression" not in master
    piped = effective(TrainConfig(pp=2))
    assert (piped["schedule"], piped["micro_batches"], piped["pp_balance"]) == ("1f1b", 4, "params")
    assert effective(TrainConfig(pp=2, schedule="pipedream"))["overlap"] is False
    chunked = effective(TrainConfig(pp=2, schedule="interleaved"))
    assert chunked["overlap"] is False and chunked["virtual_stages"] == 2 and "virtual_stages" not in piped


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


def test_mlp_depth_adds_hidden_layers_and_keeps_the_default_init() -> None:
    torch.manual_seed(0)
    default = MLP()
    torch.manual_seed(0)
    two = MLP(hidden=128, depth=2)  # the default, layer for layer and value for value
    assert all(torch.equal(a, b) for a, b in zip(default.parameters(), two.parameters(), strict=True))
    wide = wide_mlp()
    linears = [m for m in wide.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 256), *[(256, 256)] * 3, (256, 10)]
    assert sum(p.numel() for p in wide.parameters()) == 216_586
    assert wide(torch.rand(3, 64)).shape == (3, 10)
    with pytest.raises(ValueError, match="depth=0"):
        MLP(depth=0)


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
    total = torch.ones(1)
    torch.distributed.all_reduce(total)  # the world the runs trained in is still the caller's
    out["left_alone"] = torch.distributed.is_initialized() and float(total) == 2.0
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ck = tmp_path_factory.mktemp("checkpoints")
    return spawn(run_world, 2, (str(ck),), timeout_s=240), ck


def test_summary_has_every_key(world: tuple[list[dict[str, Any]], Path]) -> None:
    summary = world[0][0]["full"]
    assert list(summary)[: len(METRIC_KEYS)] == list(METRIC_KEYS)
    assert (summary["dp"], summary["tp"], summary["pp"], summary["mode"]) == (2, 1, 1, "ddp")
    assert summary["parameters"] == sum(p.numel() for p in build_model("mlp").parameters())
    assert summary["final_loss"] < 0.5 and summary["epochs"] == 2 and "schedule" not in summary
    assert summary["world_size"] == 2 and summary["steps"] == 46 and 0 <= summary["accuracy"] <= 1
    assert summary["samples_per_s"] > 0 and 0 < summary["comm_time_s"] < summary["step_time_s"]
    assert world[0][1]["full"] == summary  # the same numbers on every rank


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
    assert "bucket_mb" not in dp and "overlap" not in dp  # the master mode has no buckets


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


def test_cli_reads_a_config_file_that_flags_override(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("epochs: 1\nalgorithm: tree\nbatch-size: 64\nprogress: false\n")
    args = ["train", "--nproc", "2", "--config", str(tmp_path / "run.yaml"), "--algorithm", "double_tree"]
    out = CliRunner().invoke(
        app, [*args, "--json", str(tmp_path / "s.json"), "--trace", str(tmp_path / "t.json")]
    )
    assert out.exit_code == 0, out.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary)[: len(METRIC_KEYS)] == list(METRIC_KEYS)
    assert (summary["algorithm"], summary["epochs"], summary["batch_size"]) == ("double_tree", 1, 64)
    assert summary["steps"] == 12  # ceil(719 / 64): the file's batch size
    assert summary["predicted_step_time_s"] is None and "exposed_comm_time_s" in out.output
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--compression", "int4"], "unknown compression 'int4'"),
        (["--pp", "2", "--mode", "dp", "--algorithm", "ps"], "--mode dp steps the whole model on rank 0"),
        (["--schedule", "gpipe"], "--schedule needs --pp 2 or more"),
        (["--nproc", "3", "--pp", "2"], "does not divide the 3 ranks"),
        (["--device", "cuda"], "--device cuda needs a CUDA GPU"),
        (["--config", "/nonexistent.yaml"], "cannot read --config /nonexistent.yaml"),
        (["--json", "/tmp"], "--json /tmp is a folder"),
        (["--nproc", "8", "--pp", "8"], "--pp 8 is more stages than the 5 layers of the model"),
        (["--model", "nowhere.at.all:make"], "--model 'nowhere.at.all:make': cannot load it"),
        (["--dataset", "ringtree.train.models:MLP"], "the factory returned MLP, not a Dataset"),
    ],
)
def test_cli_refuses_before_any_process_starts(args: list[str], words: str) -> None:
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = CliRunner().invoke(app, ["train", *args])
    text = " ".join(out.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())  # unwrap rich's box
    assert out.exit_code == 2 and words in text and "Traceback" not in text, out.output


def test_a_config_file_with_an_unknown_option_is_refused(tmp_path: Path) -> None:
    from ringtree.train.config import load_file

    (tmp_path / "c.json").write_text('{"epochs": 1, "colour": "red"}')
    with pytest.raises(ValueError, match=r"unknown option\(s\) colour"):
        load_file(tmp_path / "c.json")


def test_help_fits_80_columns_with_every_option_name_whole() -> None:
    from dataclasses import fields

    from ringtree.train.config import flag

    out = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert out.exit_code == 0 and max(len(line) for line in out.output.splitlines()) <= 80
    for f in fields(TrainConfig):
        assert flag(f.name) in out.output, flag(f.name)


def test_each_model_carries_its_recipe_and_flags_override_it() -> None:
    from ringtree.train.models import REGISTRY

    for name, (_, recipe) in REGISTRY.items():
        cfg = TrainConfig(model=name, **({"dataset": recipe.dataset} if recipe.dataset else {}))
        assert (cfg.get("lr"), cfg.get("epochs"), cfg.get("batch_size")) == (
            recipe.lr,
            recipe.epochs,
            recipe.batch_size,
        )
        assert effective(cfg)["recipe"] == name
    vit = effective(TrainConfig(model="vit", lr=1e-3))
    assert (vit["recipe"], vit["lr"], vit["epochs"]) == ("vit", 1e-3, REGISTRY["vit"][1].epochs)
    assert REGISTRY["vit"][1] != REGISTRY["mlp"][1]  # the vit needs more than the mlp's defaults
    assert effective(TrainConfig(model="tests.restart_data:model"))["recipe"] == "default"


def test_the_docs_recipe_table_is_the_registry() -> None:
    from pathlib import Path

    from ringtree.train.models import FACTORY_RECIPE, REGISTRY

    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    table = text.split("<!-- recipes -->", 1)[1].strip().split("\n\n", 1)[0]
    shown = {line.split("|")[1].strip(): line.split("|")[2:5] for line in table.splitlines()[2:]}
    for name, (_, recipe) in [*REGISTRY.items(), ("a factory (`default`)", (None, FACTORY_RECIPE[1]))]:
        lr, epochs, batch = (cell.strip() for cell in shown[name if "(" in name else f"`{name}`"])
        assert (float(lr), int(epochs), int(batch)) == (recipe.lr, recipe.epochs, recipe.batch_size)


def test_fit_leaves_a_world_it_did_not_make_and_ends_the_one_it_made(
    world: tuple[list[dict[str, Any]], Path],
) -> None:
    assert all(rank["left_alone"] for rank in world[0])
    assert not torch.distributed.is_initialized()
    inputs = torch.randn(16, 4)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True))
    Trainer(nn.Linear(4, 1), data, nn.MSELoss(), TrainConfig(epochs=1, progress=False)).fit()
    assert not torch.distributed.is_initialized()  # its world of one is gone
