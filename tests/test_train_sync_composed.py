"""`ringtree train --sync` composed with what runs inside each replica group: ZeRO-1/2 (the ZeRO
group is the replica's) and DDP with PowerSGD, on 2 emulated nodes of 2 ranks (spawned once):
ZeRO-1/2 train the same model as DDP (fp32 tolerance), every rank holds the same parameters after
an outer sync, and the CLI accepts the combinations (--zero 3 refused, naming it)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_bad_input import _exits_2, _one_sentence
from test_train_sync import fit
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.processes import spawn
from ringtree.train import TrainConfig

# 80 samples, 4 per rank and step on 4 ranks: 5 steps an epoch, 10 in all; syncs after steps 5, 10
BASE = TrainConfig(
    epochs=2, batch_size=4, lr=1e-2, progress=False, bucket_mb=0.0005, straggler_every=0, timeout_s=60
)
DILOCO = replace(BASE, sync="diloco", inner_steps=5)
RUNS = {
    "diloco": DILOCO,
    "diloco-zero1": replace(DILOCO, zero=1),
    "diloco-zero2": replace(DILOCO, zero=2),
    "local-sgd": replace(BASE, sync="local-sgd", inner_steps=5),
    "local-sgd-zero1": replace(BASE, sync="local-sgd", inner_steps=5, zero=1),
    # a fragment every H/F = 2 steps, its all-reduce a step behind: the outer thread beside ZeRO's
    "streaming": replace(BASE, sync="streaming-diloco", inner_steps=4, fragments=2, overlap_steps=1),
    "streaming-zero2": replace(
        BASE, sync="streaming-diloco", inner_steps=4, fragments=2, overlap_steps=1, zero=2
    ),
    # PowerSGD inside each replica from the first step (rank 2 on the 128 x 8 and 1 x 128 weights)
    "diloco-powersgd": replace(DILOCO, compression="powersgd", powersgd_rank=2, powersgd_start_iter=1),
}


def world(rank: int, folder: str) -> dict[str, Any]:
    out = {name: fit(cfg) for name, cfg in RUNS.items()}
    resumable = replace(RUNS["streaming-zero2"], zero=1, checkpoint_every=3, checkpoint_dir=folder)
    out["straight"] = fit(resumable)  # saves after steps 3, 6, 9
    out["resumed"] = fit(replace(resumable, resume=True))  # from 9: a fragment's all-reduce in flight
    dist.barrier()
    return out


_WORLD: list[dict[str, Any]] = []


def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not _WORLD:
        folder = str(tmp_path_factory.mktemp("sync-zero-ck"))
        _WORLD.extend(spawn(world, 4, (folder,), timeout_s=420, local_world_size=2))
    return _WORLD


@pytest.mark.parametrize(
    ("zero", "plain"),
    [("diloco-zero1", "diloco"), ("diloco-zero2", "diloco"), ("local-sgd-zero1", "local-sgd"),
     ("streaming-zero2", "streaming")],
)  # fmt: skip
def test_zero_inside_the_replicas_trains_what_ddp_does(
    tmp_path_factory: pytest.TempPathFactory, zero: str, plain: str
) -> None:
    for run in results(tmp_path_factory):
        assert (run[zero]["zero"], run[zero]["replicas"], run[zero]["steps"]) == (int(zero[-1]), 2, 10)
        assert run[zero]["outer_syncs"] == run[plain]["outer_syncs"]
        # the reduce-scatter sums in another order than DDP's all-reduce: fp32 rounding apart
        torch.testing.assert_close(run[zero]["params"], run[plain]["params"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_holds_the_same_model_after_the_sync(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> None:
    first, *others = results(tmp_path_factory)
    for run in others:  # step 10 ends a sync (the end's synchronisation): the outer parameters
        assert torch.equal(run[name]["params"], first[name]["params"]), name


def test_powersgd_inside_diloco_compresses_and_syncs(tmp_path_factory: pytest.TempPathFactory) -> None:
    runs = results(tmp_path_factory)[0]
    run = runs["diloco-powersgd"]
    assert (run["sync"], run["compression"], run["outer_syncs"], run["steps"]) == (
        "diloco",
        "powersgd",
        2,
        10,
    )
    assert run["powersgd_rank"] == 2
    assert run["powersgd_compute_s"] > 0  # its own work, timed on the host
    assert runs["diloco"]["powersgd_compute_s"] is None
    # a rank-2 approximation of the gradients: not DDP's model, but trained
    assert not torch.equal(run["params"], runs["diloco"]["params"])
    assert math.isfinite(run["final_loss"])


def test_the_cli_runs_powersgd_inside_diloco_and_the_planner_names_what_it_cannot_price(
    tmp_path: Path,
) -> None:
    """4 ranks, 2 replicas: `ringtree train` accepts and completes it; `plan --from-run` on its
    summary exits 2 naming the file (PowerSGD inside DiLoCo's groups is not priced together)."""
    summary = tmp_path / "run.json"
    args = ["train", "--model", "mlp-tiny", "--nproc", "4", "--replicas", "2", "--epochs", "1"]
    args += ["--batch-size", "64", "--sync", "diloco", "--inner-steps", "3", "--compression", "powersgd"]
    args += ["--powersgd-rank", "2", "--powersgd-start-iter", "1", "--no-progress", "--json", str(summary)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    run = json.loads(summary.read_text())
    assert (run["sync"], run["replicas"], run["compression"], run["steps"]) == ("diloco", 2, "powersgd", 6)
    assert run["outer_syncs"] == 2
    plan = ["plan", "--from-run", str(summary), "--nodes", "2", "--intra", "pcie-gen3", "--inter", "eth-1g"]
    result = CliRunner().invoke(app, plan)
    assert result.exit_code == 2, result.output
    assert "does not price together" in _one_sentence(result.output)


def test_a_resumed_zero_run_is_bit_identical(tmp_path_factory: pytest.TempPathFactory) -> None:
    for run in results(tmp_path_factory):
        assert run["resumed"]["resumed_from_step"] == 9
        assert torch.equal(run["straight"]["params"], run["resumed"]["params"])


ACCEPTED = [
    {"sync": "diloco", "zero": 1},
    {"sync": "local-sgd", "zero": 2},
    {"sync": "streaming-diloco", "zero": 2, "inner_steps": 4, "fragments": 2, "overlap_steps": 1},
    {"sync": "diloco", "compression": "powersgd", "powersgd_rank": 2},
]


@pytest.mark.parametrize("words", ACCEPTED, ids=[str(w) for w in ACCEPTED])
def test_the_config_accepts_the_compositions(words: dict[str, Any]) -> None:
    from ringtree.train.config import validate

    validate(TrainConfig(**words), 4)  # what `ringtree train` checks before any worker starts


def test_zero_3_is_refused_naming_the_flag(tmp_path: Path) -> None:
    _exits_2(tmp_path, ["train", "--sync", "diloco", "--zero", "3"], "which --zero 3 holds only as shards")
