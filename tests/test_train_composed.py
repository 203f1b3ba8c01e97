"""One trainer for every layout: the capability table, the library API, DP x TP x PP on 4 ranks."""

from __future__ import annotations

import json
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from typer.testing import CliRunner

import ringtree
from ringtree.cli.app import app
from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer
from ringtree.train.config import (
    LAYOUTS,
    TECHNIQUES,
    ConfigError,
    capabilities_markdown,
    capability,
    options_markdown,
)
from ringtree.train.data import digits
from ringtree.train.models import ViT

DOCS = Path(__file__).parent.parent / "docs" / "training.md"
HOW_TO = Path(__file__).parent.parent / "docs" / "how-to" / "train-your-model.md"
PACKAGE = Path(ringtree.__file__).resolve().parent
REGRESSION = TrainConfig(epochs=2, batch_size=32, lr=1e-2, progress=False)


def test_docs_show_the_capability_and_options_tables_the_code_has() -> None:
    assert capabilities_markdown() in HOW_TO.read_text(), (
        "regenerate the table: ringtree.train.config.capabilities_markdown()"
    )
    assert options_markdown() in DOCS.read_text(), (
        "regenerate the table: ringtree.train.config.options_markdown()"
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("technique", list(TECHNIQUES))
def test_each_cell_of_the_table_is_what_the_config_does(
    layout: str, technique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `yes` cell makes a valid TrainConfig; a `no` cell is refused with the table's sentence."""
    (tmp_path / "ck").mkdir()
    torch.save({"step": 1}, tmp_path / "ck" / "last.pt")  # --teacher ck needs a file to point at
    monkeypatch.chdir(tmp_path)
    options = LAYOUTS[layout] | TECHNIQUES[technique]
    refusal = capability(layout, technique)
    if refusal is None:
        TrainConfig(**options)
    else:
        with pytest.raises(ConfigError) as e:
            TrainConfig(**options)
        assert e.value.cli == refusal  # the table speaks the command line's flags


def _regression(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def _regressor() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _reference(cfg: TrainConfig) -> tuple[nn.Module, float]:
    """The same training by hand: torch's AdamW over the sampler's order, MSE; the last step's loss."""
    net, data = _regressor(), _regression()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed)
    loss = torch.zeros(())
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=cfg.batch_size, sampler=sampler):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return net, float(loss.detach())


def test_library_api_trains_a_regression_on_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    net = _regressor()
    summary = Trainer(net, _regression(), nn.MSELoss(), REGRESSION, test_dataset=_regression(64)).fit()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("ringtree")]
    assert left == []  # the world of one left no store file behind (torch's own caches aside)
    reference, last_loss = _reference(REGRESSION)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert summary["final_loss"] == pytest.approx(last_loss, rel=1e-5)
    assert summary["accuracy"] is None and summary["test_loss"] > 0  # no classes: no accuracy
    assert (summary["world_size"], summary["dp"], summary["model"], summary["loss"]) == (
        1,
        1,
        "Sequential",
        "MSELoss",
    )
    assert summary["parameters"] == sum(p.numel() for p in net.parameters())
    assert (summary["device"], summary["backend"]) == ("cpu", "gloo")


def _dp_and_pp(rank: int) -> dict[str, Any]:
    """DP 2 (16 samples per rank) and PP 2 (4 micro-batches of 8): the 1-process run's 32 per step."""
    data = _regression()
    dp = Trainer(_regressor(), data, nn.MSELoss(), replace(REGRESSION, batch_size=16)).fit()
    pp = Trainer(
        _regressor(), data, nn.MSELoss(), replace(REGRESSION, batch_size=8, pp=2, micro_batches=4)
    ).fit()
    return {"dp": dp, "pp": pp}


def test_dp_2_and_pp_2_reach_the_one_process_loss() -> None:
    _, expected = _reference(REGRESSION)
    results = spawn(_dp_and_pp, 2, timeout_s=180)
    for r in results:
        assert r["dp"]["final_loss"] == pytest.approx(expected, rel=1e-4)
        assert r["pp"]["final_loss"] == pytest.approx(expected, rel=1e-4)
    assert (results[0]["dp"]["dp"], results[0]["pp"]["pp"], results[0]["pp"]["dp"]) == (2, 2, 1)


def _subset(n: int) -> tuple[TensorDataset, TensorDataset]:
    train, test = digits()
    return TensorDataset(*(t[:n] for t in train.tensors)), test


def _vit() -> ViT:
    torch.manual_seed(0)
    return ViT()


VIT = {"model": "vit", "dataset": "digits", "loss": "cross_entropy"}


def _four_ranks(rank: int, ck: str) -> dict[str, Any]:
    train, test = _subset(512)
    out: dict[str, Any] = {}
    reg = replace(REGRESSION, batch_size=4, pp=2, micro_batches=4)  # DP 2 x 16 = the reference's 32
    out["reg"] = Trainer(_regressor(), _regression(), nn.MSELoss(), reg).fit()
    many = replace(reg, overlap=False, bucket_mb=0.0002, algorithm="double_tree")  # a bucket per layer
    out["reg_buckets"] = Trainer(_regressor(), _regression(), nn.MSELoss(), many).fit()
    tp_pp = TrainConfig(
        model="vit", tp=2, pp=2, epochs=2, progress=False, checkpoint_activations=True, prefetch=True,
        checkpoint_dir=f"{ck}/vit",
    )  # fmt: skip
    out["tp_pp"] = Trainer(_vit(), train, config=tp_pp, test_dataset=test, names=VIT).fit()
    again = replace(tp_pp, epochs=3, resume=True, amp="bf16")
    out["resumed"] = Trainer(_vit(), train, config=again, test_dataset=test, names=VIT).fit()
    dp_pp = TrainConfig(
        pp=2, epochs=2, progress=False, algorithm="tree", bucket_mb=0.01, overlap=False, compression="bf16",
        accumulate=2, schedule="gpipe", checkpoint_dir=f"{ck}/mlp",
    )  # fmt: skip
    out["dp_pp"] = Trainer.from_config(replace(dp_pp, dataset="digits")).fit()
    distil = TrainConfig(model="mlp-tiny", pp=2, epochs=1, progress=False, teacher=f"{ck}/mlp")
    out["distil"] = Trainer.from_config(distil).fit()
    pipedream = TrainConfig(pp=2, epochs=1, progress=False, schedule="pipedream", compression="fp16")
    out["pipedream"] = Trainer.from_config(pipedream).fit()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ck = tmp_path_factory.mktemp("composed")
    return spawn(_four_ranks, 4, (str(ck),), timeout_s=420), ck


def test_tp_2_x_pp_2_trains_the_vit_as_one_process_does(four: tuple[list[dict[str, Any]], Path]) -> None:
    """TP 2 x PP 2 (4 micro-batches of 32, checkpointed, prefetched) equals one process on 128 per step."""
    train, test = _subset(512)
    one = TrainConfig(model="vit", epochs=2, batch_size=128, progress=False)
    expected = Trainer(_vit(), train, config=one, test_dataset=test, names=VIT).fit()
    s = four[0][0]["tp_pp"]
    assert (s["world_size"], s["dp"], s["tp"], s["pp"]) == (4, 1, 2, 2)
    assert s["parameters"] == expected["parameters"]  # the whole model, not one shard
    assert s["checkpoint_segments"] >= 1 and s["prefetch"] is True and s["steps"] == expected["steps"] == 8
    assert s["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-3)
    assert s["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-3)
    assert all(r["tp_pp"]["test_loss"] == s["test_loss"] for r in four[0])
    resumed = four[0][0]["resumed"]  # from the dense checkpoint, 1 more epoch under bf16 autocast
    assert resumed["resumed_from_step"] == 8 and resumed["steps"] == 12
    assert resumed["amp"] == "bf16" and resumed["skipped_steps"] == 0 and resumed["final_loss"] < 3


def test_dp_2_x_pp_2_reaches_the_one_process_loss(four: tuple[list[dict[str, Any]], Path]) -> None:
    """DDP per stage (bucket synced during the last micro-batch's backward, or after it, in many
    small buckets with another algorithm) computes the same steps as one process."""
    _, expected = _reference(REGRESSION)
    for r in four[0]:
        assert (r["reg"]["dp"], r["reg"]["pp"], r["reg_buckets"]["overlap"]) == (2, 2, False)
        assert r["reg"]["final_loss"] == pytest.approx(expected, rel=1e-4)
        assert r["reg_buckets"]["final_loss"] == pytest.approx(expected, rel=1e-4)


def test_dp_x_pp_runs_every_dp_option(four: tuple[list[dict[str, Any]], Path]) -> None:
    s = four[0][0]["dp_pp"]
    assert (s["dp"], s["pp"], s["algorithm"], s["compression"]) == (2, 2, "tree", "bf16")
    assert (s["bucket_mb"], s["overlap"], s["accumulate"], s["schedule"]) == (0.01, False, 2, "gpipe")
    assert s["comm_time_s"] > 0 and s["steps"] == 6  # 719 digits per DP rank: 6 runs of 4 x 32, 2 per step
    state = torch.load(four[1] / "mlp" / "last.pt", weights_only=True)
    assert state["step"] == 6 and len(state["optimizer"]["state"]) == 6  # every stage's AdamW state
    assert all(r["dp_pp"]["accuracy"] == s["accuracy"] for r in four[0])  # replicas stayed equal


def test_distillation_and_pipedream_under_pp(four: tuple[list[dict[str, Any]], Path]) -> None:
    distil, pipedream = four[0][0]["distil"], four[0][0]["pipedream"]
    assert distil["distilled_from"].endswith("mlp") and distil["distill_alpha"] == 0.5
    assert pipedream["schedule"] == "pipedream" and pipedream["overlap"] is False
    assert pipedream["steps"] == 23 and pipedream["comm_time_s"] > 0  # a DDP sync every micro-batch
    assert max(pipedream["weight_versions_per_stage"]) > 1


def test_cli_trains_a_users_model_data_and_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "userwork.py").write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\n\n"
        "from torch import nn\n\n"
        "def model():\n    return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 1))\n\n"
        "def data():\n    x = torch.randn(64, 8)\n    return TensorDataset(x, x.sum(1, keepdim=True))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = [
        "train",
        "--nproc",
        "1",
        "--model",
        "userwork:model",
        "--dataset",
        "userwork:data",
        "--loss",
        "mse",
    ]
    out = CliRunner().invoke(
        app, [*args, "--epochs", "1", "--no-progress", "--json", str(tmp_path / "s.json")]
    )
    assert out.exit_code == 0, out.output
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["model"], summary["dataset"], summary["loss"]) == (
        "userwork:model",
        "userwork:data",
        "mse",
    )
    assert (
        summary["accuracy"] is None and summary["parameters"] == 8 * 4 + 4 + 4 + 1 and summary["steps"] == 2
    )


def test_device_plumbing_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device resolves, picks the backend and refuses what cannot run, whatever this machine has."""
    from ringtree.processes import default_backend
    from ringtree.train.config import device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_type(TrainConfig()) == "cpu" and default_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="device=cuda needs a CUDA GPU and this machine has none"):
        TrainConfig(device="cuda")
    with pytest.raises(ValueError, match="amp=fp16 needs a CUDA device"):
        TrainConfig(amp="fp16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_type(TrainConfig()) == "cuda" and default_backend("cuda") == "nccl"
    assert TrainConfig(amp="fp16").amp == "fp16"  # with a GPU, fp16 and its GradScaler are allowed
    assert device_type(TrainConfig(device="cpu")) == "cpu"
    assert TrainConfig(pp=2).pp == 2  # the pipeline runtime keeps its buffers on the stage's device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_trains_on_cuda_with_nccl_and_amp(amp: str) -> None:
    net = _regressor()
    cfg = replace(REGRESSION, device="cuda", amp=amp, prefetch=True)
    summary = Trainer(net, _regression(), nn.MSELoss(), cfg, test_dataset=_regression(64)).fit()
    assert (summary["device"], summary["backend"], summary["amp"]) == ("cuda", "nccl", amp)
    assert all(p.is_cuda for p in net.parameters())
    _, expected = _reference(REGRESSION)
    tolerance = 1e-3 if amp == "off" else 0.2  # half precision moves the loss a little
    assert summary["final_loss"] == pytest.approx(expected, rel=tolerance)


def test_the_step_loop_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """ringtree's host reads (.item, .tolist, .cpu, float()) do not grow with the steps: the loop
    never waits for the device. (torch's AdamW reads its step counter, a host tensor: not counted.)"""
    calls = {"n": 0}
    for name in ("item", "tolist", "cpu", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0].filename
            calls["n"] += Path(caller).is_relative_to(PACKAGE)  # ringtree's code, not torch's
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    reads = []
    for epochs in (1, 3):  # 8 and 24 steps
        calls["n"] = 0
        Trainer(_regressor(), _regression(), nn.MSELoss(), replace(REGRESSION, epochs=epochs)).fit()
        reads.append(calls["n"])
    assert reads[0] == reads[1], reads
