"""Interleaved 1F1B as data: its order, the checker's verdicts, its replayed bubble, `ringtree show`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.processes import spawn
from ringtree.schedules.pipeline import build, interleaved, one_f_one_b, theoretical_bubble_fraction
from ringtree.schedules.pipeline_verify import dry_run, peak_in_flight
from ringtree.show.pipeline import timeline
from ringtree.train import TrainConfig, Trainer


def test_two_stages_two_chunks_follow_megatrons_order() -> None:
    s = interleaved(2, 4, 2)
    assert s.describe(0) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3 S"
    assert s.describe(1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3 S"


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4), (4, 16, 2)])
def test_every_dependency_is_met_without_deadlock_and_memory_is_bounded(p: int, m: int, v: int) -> None:
    s = interleaved(p, m, v)
    dry_run(s)  # raises DeadlockError or ValueError otherwise
    for j in range(p):  # Megatron's warm-up plus one: units of 1/v of a stage's activations
        assert peak_in_flight(s, j) == min(2 * (p - 1 - j) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 2), (4, 8, 2), (4, 16, 4)])
def test_replayed_bubble_is_the_theory_and_below_1f1b(p: int, m: int, v: int) -> None:
    t = timeline("interleaved", p, m, v)
    assert (
        t.bubble_fraction == pytest.approx(theoretical_bubble_fraction(p, m, v)) == (p - 1) / (v * m + p - 1)
    )
    assert t.bubble_fraction < timeline("1f1b", p, m).bubble_fraction


def test_one_chunk_is_1f1b_and_bad_shapes_are_refused() -> None:
    assert interleaved(4, 8, 1).actions == one_f_one_b(4, 8).actions
    with pytest.raises(ValueError, match="not a multiple of 2; use --micro-batches 6"):
        interleaved(2, 5, 2)
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        build("1f1b", 2, 4, virtual_stages=2)


def test_show_interleaved_prints_chunks_and_the_bubble(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = ["show", "interleaved", "--stages", "2", "--micro-batches", "8", "--virtual-stages", "2"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines at the terminal's width
    assert "F0.1" in text and "(p-1)/(v m+p-1) = 1/17 = 0.059" in text
    data = json.loads(out.read_text())
    assert data["virtual_stages"] == 2 and data["bubble_fraction"] == pytest.approx(1 / 17)
    refused = CliRunner().invoke(app, ["show", "1f1b", "--virtual-stages", "2"])
    assert refused.exit_code == 2 and "--virtual-stages 2 cuts each stage" in " ".join(refused.output.split())


# -- the runtime: 2 ranks, 2 chunks each, against the same model run plainly --------------------


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)))


def _interleaved_grads(rank: int) -> dict[str, Any]:
    model = _layers()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(3, 6, generator=g), torch.randint(0, 6, (3,), generator=g)) for _ in range(4)]
    chunks = [model[rank], model[2 + rank]]  # virtual stages rank and 2 + rank
    runner = InterleavedStage(chunks, rank, [0, 1], timeout_s=30)
    out: dict[str, Any] = {}
    for run in range(2):  # the second run posts its receives early (shapes known)
        model.zero_grad()
        result = runner.run(interleaved(2, 4, 2), batches)
        out[f"losses{run}"] = result.losses
    out["grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    reference = _layers()
    total = sum(len(y) for _, y in batches)
    for x, y in batches:
        (F.cross_entropy(reference(x), y) * len(y) / total).backward()  # type: ignore[no-untyped-call]
    out["reference"] = {n: p.grad for n, p in reference.named_parameters()}
    out["ref_losses"] = [float(F.cross_entropy(reference(x), y)) for x, y in batches]
    return out


def test_interleaved_runtime_gives_the_plain_models_gradients() -> None:
    results = spawn(_interleaved_grads, 2, timeout_s=60)
    last = results[1]  # rank 1 holds the last virtual stage: the losses
    assert last["losses0"] == pytest.approx(last["ref_losses"], rel=1e-6)
    assert last["losses1"] == pytest.approx(last["ref_losses"], rel=1e-6)
    for rank, r in enumerate(results):
        mine = {f"{k}.{n}" for k in (rank, 2 + rank) for n in ("0.weight", "0.bias")}
        assert set(r["grads"]) == mine
        for name in mine:
            torch.testing.assert_close(r["grads"][name], r["reference"][name], rtol=1e-5, atol=1e-6)


# -- the trainer: interleaved steps to 1f1b's parameters ---------------------------------------


def _train(rank: int) -> dict[str, Any]:
    out = {}
    for schedule in ("1f1b", "interleaved"):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 6, generator=g)
        data = TensorDataset(x, x[:, :3].argmax(dim=1))
        cfg = TrainConfig(
            pp=2,
            schedule=schedule,
            micro_batches=4,
            batch_size=8,
            epochs=1,
            progress=False,
            straggler_every=0,
        )
        out[schedule] = Trainer(_layers(), data, F.cross_entropy, cfg, test_dataset=data).fit()
    return out


def test_trainer_interleaved_trains_as_1f1b_does() -> None:
    result = spawn(_train, 2, timeout_s=120)[0]
    plain, chunked = result["1f1b"], result["interleaved"]
    assert chunked["schedule"] == "interleaved" and chunked["virtual_stages"] == 2
    assert "virtual_stages" not in plain
    assert chunked["theoretical_bubble_fraction"] == pytest.approx(1 / 9)  # (p-1)/(v m+p-1), m = 4
    assert chunked["steps"] == plain["steps"] == 2
    for key in ("final_loss", "test_loss", "accuracy"):
        assert chunked[key] == pytest.approx(plain[key], rel=1e-5), key


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pp": 2, "virtual_stages": 2}, "virtual_stages needs schedule=interleaved"),
        (
            {"pp": 2, "schedule": "interleaved", "micro_batches": 3},
            "micro_batches=3 is not a multiple of 2",
        ),
    ],
)
def test_interleaved_options_are_refused_when_they_cannot_apply(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):  # the library's words: the fields
        TrainConfig(**options)
