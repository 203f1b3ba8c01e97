"""`ringtree train --sync`: local SGD, DiLoCo and Streaming DiLoCo in the trainer, on two emulated
nodes of one rank (spawned once): the summary's keys, the inter-node bytes against DDP's, the
replicas equal after a synchronisation, a resume bit-identical to the straight run; bad input."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_bad_input import _exits_2
from torch import nn
from torch.utils.data import TensorDataset

from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer

# 80 samples, 8 per rank and step on 2 ranks: 5 steps an epoch, 10 in all
BASE = TrainConfig(epochs=2, batch_size=8, lr=1e-2, progress=False, bucket_mb=0.0005, straggler_every=0)
PARAMS = 8 * 128 + 128 + 128 + 1
LATE_S = 0.2


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, 1, generator=g))


def fit(cfg: TrainConfig) -> dict[str, Any]:
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 1))
    summary = Trainer(net, data(), nn.MSELoss(), cfg).fit()
    summary["params"] = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    return summary


def fit_with_a_skipped_step(cfg: TrainConfig) -> dict[str, Any]:
    """Step 3 skipped on every rank, as the fp16 scaler's agreed skip does (the optimizer never steps)."""
    from ringtree.train.techniques.amp import MixedPrecision

    step, calls = MixedPrecision.step, [0]

    def skips_the_third(self: MixedPrecision, optimizer: Any, agree: Any = None) -> bool:
        calls[0] += 1
        if calls[0] == 3:
            self.skipped_steps += 1
            return False
        return step(self, optimizer, agree)

    MixedPrecision.step = skips_the_third  # type: ignore[method-assign]
    try:
        return fit(cfg)
    finally:
        MixedPrecision.step = step  # type: ignore[method-assign]


def fit_with_rank_one_late(cfg: TrainConfig, late_s: float) -> dict[str, Any]:
    """Rank 1 reaches every outer synchronisation `late_s` after rank 0."""
    from ringtree.parallel.diloco import DiLoCo

    send = DiLoCo._send

    def late(self: DiLoCo, sync: Any) -> None:
        if dist.get_rank() == 1:
            time.sleep(late_s)
        send(self, sync)

    DiLoCo._send = late  # type: ignore[method-assign]
    try:
        return fit(cfg)
    finally:
        DiLoCo._send = send  # type: ignore[method-assign]


def world(rank: int, folder: str) -> dict[str, Any]:
    out = {
        "ddp": fit(BASE),
        "local-sgd": fit(replace(BASE, sync="local-sgd", inner_steps=4)),
        "diloco": fit(replace(BASE, sync="diloco", inner_steps=5)),
        "streaming": fit(
            replace(
                BASE, sync="streaming-diloco", inner_steps=4, fragments=2, overlap_steps=1, outer_dtype="int8"
            )
        ),
    }
    out["skipped"] = fit_with_a_skipped_step(replace(BASE, sync="diloco", inner_steps=3))
    out["late"] = fit_with_rank_one_late(replace(BASE, sync="diloco", inner_steps=5), LATE_S)
    resumable = replace(
        BASE, sync="streaming-diloco", inner_steps=4, fragments=2, overlap_steps=1, checkpoint_every=3
    )
    out["straight"] = fit(replace(resumable, checkpoint_dir=folder))  # saves after steps 3, 6, 9
    out["resumed"] = fit(replace(resumable, checkpoint_dir=folder, resume=True))  # from 9: in flight
    dist.barrier()
    return out


_WORLD: list[dict[str, Any]] = []


def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not _WORLD:
        folder = str(tmp_path_factory.mktemp("sync-ck"))
        _WORLD.extend(spawn(world, 2, (folder,), timeout_s=300, local_world_size=1))
    return _WORLD


def test_summary_keys_for_every_sync(tmp_path_factory: pytest.TempPathFactory) -> None:
    ddp, local, diloco, streaming = (
        results(tmp_path_factory)[0][k] for k in ("ddp", "local-sgd", "diloco", "streaming")
    )
    assert (ddp["sync"], ddp["replicas"], ddp["inner_steps"], ddp["outer_syncs"]) == ("ddp", 1, 1, None)
    assert ddp["outer_comm_exposed_s"] is None
    assert (local["sync"], local["replicas"], local["inner_steps"]) == ("local-sgd", 2, 4)
    assert local["outer_syncs"] == 4  # torch's averager: after steps k = 0, 4, 8 (of 0..9), and the end
    assert (diloco["sync"], diloco["outer_syncs"], diloco["steps"]) == ("diloco", 2, 10)
    assert streaming["outer_syncs"] == 6  # one fragment every H/F = 2 steps, fragment 0 at the end
    assert diloco["outer_comm_exposed_s"] >= 0
    assert ddp["outer_sync_wait_s"] is None and local["outer_sync_wait_s"] >= 0


def test_the_wait_for_a_late_replica_is_measured(tmp_path_factory: pytest.TempPathFactory) -> None:
    # rank 0 waits LATE_S at each of the two syncs, rank 1 (the late one) hardly at all: LATE_S / 2
    for run in results(tmp_path_factory):
        assert run["late"]["outer_syncs"] == 2
        assert 0.7 * LATE_S / 2 < run["late"]["outer_sync_wait_s"] < 1.5 * LATE_S / 2
        assert run["late"]["outer_sync_wait_s"] == results(tmp_path_factory)[0]["late"]["outer_sync_wait_s"]
        assert run["diloco"]["outer_sync_wait_s"] < LATE_S / 4  # the same run on time


def test_a_skipped_step_still_counts_for_the_schedule(tmp_path_factory: pytest.TempPathFactory) -> None:
    for run in results(tmp_path_factory):
        skipped = run["skipped"]
        assert skipped["skipped_steps"] == 1 and skipped["steps"] == 10
        # after steps 3 (the skipped one, counted), 6 and 9, and the last one after step 10; without
        # counting the skipped step: after steps 4, 7 and 10 only
        assert skipped["outer_syncs"] == 4
    a, b = results(tmp_path_factory)
    assert torch.equal(a["skipped"]["params"], b["skipped"]["params"])


def test_inter_node_bytes_diloco_is_ddp_s_over_h(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = results(tmp_path_factory)[0]
    # two nodes, one rank each: the ring sends every gradient byte once to the other node
    assert run["ddp"]["inter_node_bytes_per_step"] == PARAMS * 4
    assert run["diloco"]["inter_node_bytes_per_step"] == pytest.approx(PARAMS * 4 / 5, rel=0.1)
    # int8 (and a scale a block) instead of fp32, each fragment every H = 4 steps, padded to blocks
    assert run["streaming"]["inter_node_bytes_per_step"] < 0.5 * PARAMS * 4 / 4


def test_every_replica_ends_with_the_same_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    a, b = results(tmp_path_factory)
    for sync in ("ddp", "local-sgd", "diloco", "streaming"):  # local-sgd: averaged once more at the end
        assert torch.equal(a[sync]["params"], b[sync]["params"]), sync


def test_a_resumed_run_is_bit_identical(tmp_path_factory: pytest.TempPathFactory) -> None:
    for run in results(tmp_path_factory):
        assert run["resumed"]["resumed_from_step"] == 9
        assert torch.equal(run["straight"]["params"], run["resumed"]["params"])


BAD = [
    (["--sync", "diloco", "--inner-steps", "0"], "--inner-steps must be at least 1"),
    (["--sync", "diloco", "--replicas", "3", "--nproc", "4"], "--replicas 3 must divide the 4 ranks"),
    (
        ["--sync", "diloco", "--replicas", "2", "--pp", "2", "--nproc", "2"],
        "would cut a tensor- or pipeline-parallel group",
    ),
    (["--sync", "streaming-diloco", "--fragments", "3", "--inner-steps", "4"], "--fragments 3 must divide"),
    (
        ["--sync", "streaming-diloco", "--fragments", "4", "--inner-steps", "4"],
        "more than the model's 3 layers",
    ),
    (
        ["--sync", "streaming-diloco", "--fragments", "2", "--inner-steps", "4", "--overlap-steps", "2"],
        "--overlap-steps 2 must be in [0, H/F) = [0, 2)",
    ),
    (["--sync", "streaming-diloco", "--merge-alpha", "1.5"], "--merge-alpha must be in [0, 1]"),
    (
        ["--sync", "streaming-diloco", "--pp", "2", "--nproc", "4", "--fragments", "2", "--inner-steps", "4"],
        "so that the fragments follow the stages",
    ),
    (["--inner-steps", "5"], "--inner-steps configures --sync local-sgd, diloco or streaming-diloco"),
    (["--sync", "gossip"], "unknown --sync 'gossip'"),
    (["--sync", "local-sgd", "--outer-lr", "0.5"], "local-sgd averages"),
    (["--sync", "diloco", "--fragments", "2"], "--fragments configures --sync streaming-diloco"),
    (["--sync", "diloco", "--zero", "3"], "which --zero 3 holds only as shards"),
]


@pytest.mark.parametrize(("args", "fragment"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_sync_input_exits_2_naming_the_flag(tmp_path: Path, args: list[str], fragment: str) -> None:
    _exits_2(tmp_path, ["train", *args], fragment)


def hierarchical(rank: int) -> dict[str, Any]:
    """2 nodes of 2 ranks: DDP inside each node's replica, DiLoCo across (6 steps, H = 3)."""
    return fit(replace(BASE, sync="diloco", inner_steps=3))


@pytest.mark.slow  # four ranks on a loaded 2-core host: about 20-40 s
def test_ddp_inside_each_node_diloco_across() -> None:
    runs = spawn(hierarchical, 4, timeout_s=300, local_world_size=2)
    assert runs[0]["replicas"] == 2 and runs[0]["outer_syncs"] == 2 and runs[0]["steps"] == 6
    for run in runs[1:]:  # step 6 ends a sync: every rank holds the global copy
        assert torch.equal(run["params"], runs[0]["params"])
    # DDP stays inside the node; each rank of a replica averages half the model across the nodes
    half = -(-PARAMS // 2)
    assert runs[0]["inter_node_bytes_per_step"] == pytest.approx(4 * half * 2 / 6)
