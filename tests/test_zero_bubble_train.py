"""`ringtree train --schedule zb-h1|zb-h2|zb-v|dualpipev`: the same losses as 1F1B, composed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.processes import spawn
from ringtree.schedules.pipeline import ZERO_BUBBLE
from ringtree.train import TrainConfig, Trainer
from ringtree.train.data import digits
from ringtree.train.factories import cross_entropy, make_model
from ringtree.train.gpt import GPT, GPTConfig
from ringtree.train.language import sort_task

SMALL = GPTConfig(dim=16, depth=2, heads=2, kv_heads=2, hidden=32, max_len=16)  # 4 layers: 2p chunks
NAMES = {"model": "gpt", "dataset": "sort", "loss": "cross_entropy"}
KEYS = ("final_loss", "test_loss", "accuracy")


def _data() -> tuple[TensorDataset, TensorDataset]:
    x, y = sort_task(96, length=4)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def _fit(cfg: TrainConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    train, test = _data()
    return Trainer(GPT(SMALL), train, cross_entropy, cfg, test_dataset=test, names=NAMES).fit()


def _schedules(rank: int, base: TrainConfig) -> dict[str, Any]:
    out = {name: _fit(replace(base, schedule=name)) for name in ("1f1b", *ZERO_BUBBLE)}
    out["zb-v, checkpointed"] = _fit(replace(base, schedule="zb-v", checkpoint_activations=True))
    out["1f1b, bf16"] = _fit(replace(base, schedule="1f1b", amp="bf16"))
    out["zb-v, bf16"] = _fit(replace(base, schedule="zb-v", amp="bf16"))  # W outside autocast
    return out


BASE = TrainConfig(
    pp=2, micro_batches=4, batch_size=4, epochs=1, lr=1e-2, progress=False, straggler_every=0
)  # fmt: skip


def test_every_zero_bubble_schedule_trains_to_1f1bs_losses() -> None:
    results = spawn(_schedules, 2, (BASE,), timeout_s=240)[0]
    plain = results["1f1b"]
    assert plain["steps"] == 4
    for name in ZERO_BUBBLE:
        got = results[name]
        assert got["schedule"] == name and got["steps"] == plain["steps"], name
        for key in KEYS:
            assert got[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-7), (name, key)
        assert 0.0 <= got["theoretical_bubble_fraction"] < plain["theoretical_bubble_fraction"], name
    assert results["zb-h1"]["theoretical_bubble_fraction"] == pytest.approx(1 / 13)  # (p-1)/(3m+p-1)
    for key in KEYS:  # W computed in B under activation checkpointing: the same training
        assert results["zb-v, checkpointed"][key] == pytest.approx(plain[key], rel=1e-6, abs=1e-7), key
        assert results["zb-v, bf16"][key] == pytest.approx(results["1f1b, bf16"][key], rel=1e-6, abs=1e-7)


def _models(rank: int) -> dict[str, Any]:
    """moe (the sort task) and vit (digits), 64 samples each, under 1f1b, zb-h1 and zb-v."""
    x, y = sort_task(96, length=4)
    digits_train, digits_test = digits()
    data = {
        "moe": (TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:]), "sort"),
        "vit": (
            TensorDataset(*(t[:64] for t in digits_train.tensors)),
            TensorDataset(*(t[:64] for t in digits_test.tensors)),
            "digits",
        ),
    }
    out = {}
    for model, (train, test, dataset) in data.items():
        cfg = replace(BASE, model=model, dataset=dataset, experts=4 if model == "moe" else None)
        for name in ("1f1b", "zb-h1", "zb-v"):
            torch.manual_seed(0)
            net = make_model(model, cfg)
            names = {"model": model, "dataset": dataset, "loss": "cross_entropy"}
            run = replace(cfg, schedule=name)
            out[f"{model}-{name}"] = Trainer(
                net, train, cross_entropy, run, test_dataset=test, names=names
            ).fit()
    return out


@pytest.mark.slow
def test_moe_and_vit_train_under_zb_h1_and_zb_v_to_1f1bs_losses() -> None:
    r = spawn(_models, 2, timeout_s=240)[0]
    for model in ("moe", "vit"):
        for name in ("zb-h1", "zb-v"):
            for key in KEYS:
                assert r[f"{model}-{name}"][key] == pytest.approx(
                    r[f"{model}-1f1b"][key], rel=1e-6, abs=1e-7
                ), (
                    model,
                    name,
                    key,
                )


def _composed(rank: int) -> dict[str, Any]:
    out = {}
    dp = replace(BASE, batch_size=2, accumulate=2)  # DP 2 x 2 samples x 2 runs: 1F1B's step above
    for name in ("1f1b", "zb-h1", "zb-v"):
        out[f"dp-{name}"] = _fit(replace(dp, schedule=name))
        out[f"zero2-{name}"] = _fit(replace(dp, schedule=name, zero=2))
        out[f"zero3-{name}"] = _fit(replace(dp, schedule=name, zero=3))
    x, y = sort_task(96, length=4)
    moe = replace(dp, model="moe", dataset="sort", experts=4)  # DP 2: the routers' counts are buffers
    for name in ("1f1b", "zb-v"):
        torch.manual_seed(0)
        names = {"model": "moe", "dataset": "sort", "loss": "cross_entropy"}
        out[f"moe-{name}"] = Trainer(
            make_model("moe", moe), TensorDataset(x[:64], y[:64]), cross_entropy, replace(moe, schedule=name),
            test_dataset=TensorDataset(x[64:], y[64:]), names=names,
        ).fit()  # fmt: skip
    tp = replace(BASE, tp=2, sequence_parallel=True, checkpoint_activations=True)
    for name in ("1f1b", "zb-v", "dualpipev"):
        out[f"tp-{name}"] = _fit(replace(tp, schedule=name))
    return out


@pytest.mark.slow
def test_zero_bubble_composes_with_dp_zero_accumulation_tp_sp_and_checkpointing() -> None:
    r = spawn(_composed, 4, timeout_s=600)[0]
    for prefix, names in (
        ("dp", ("zb-h1", "zb-v")),
        ("zero2", ("zb-h1", "zb-v")),
        ("zero3", ("zb-h1", "zb-v")),
        ("tp", ("zb-v", "dualpipev")),
        ("moe", ("zb-v",)),
    ):
        plain = r[f"{prefix}-1f1b"]
        for name in names:
            for key in KEYS:
                assert r[f"{prefix}-{name}"][key] == pytest.approx(plain[key], rel=1e-6, abs=1e-7), (
                    prefix,
                    name,
                )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--schedule", "zb-v", "--micro-batches", "3"],
            "needs at least 4 micro-batches, got 3; use --micro-batches 4",
        ),
        (
            ["--schedule", "zb-h1", "--micro-batches", "1"],
            "needs at least 2 micro-batches, got 1; use --micro-batches 2",
        ),
        (
            ["--schedule", "dualpipev", "--model", "three_layers:factory"],
            "--schedule dualpipev on --pp 2 cuts the model into 4 chunks, but it has 3 layers",
        ),
    ],
)
def test_too_few_micro_batches_or_layers_exit_2_naming_the_fix(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "three_layers.py").write_text(
        "from torch import nn\n\n\ndef factory():\n"
        "    return nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(app, ["train", "--pp", "2", *args])
    text = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, result.output
    assert message in text and "Traceback" not in text
