"""Checkpoints of expert-parallel runs: a run saved at step 4 and resumed ends bit-identical to one
never stopped (EP 2 on 4 ranks, --zero 0 and 1); an EP 4 checkpoint (--zero 2) resumes at EP 2,
without EP and at EP 2 on 2 ranks with the same gathered experts, each expert stored once under
its global index; a dense checkpoint without EP resumes at EP 2."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ringtree.processes import spawn
from ringtree.train import TrainConfig, Trainer

SMALL = {"model": "moe", "dataset": "tests.moe_data:small", "progress": False, "straggler_every": 0}
EXPERT = "blocks.0.mlp.experts.w_gate"


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, the experts gathered to all E of them (EP groups are consecutive ranks)."""
    ep, out = trainer.cfg.ep, {}
    for name, p in trainer.net.named_parameters():
        value = p.detach().clone()
        if ".experts." in name and ep > 1:
            got = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(got, value)
            value = torch.cat(got[:ep])
        out[name] = value
    return out


def _fit(folder: str, **options: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    options = {"batch_size": 16} | options
    trainer = Trainer.from_config(TrainConfig(**SMALL, checkpoint_dir=folder, **options))
    return trainer.fit(), _params(trainer)


def _keep_only_step_4(rank: int, source: str, target: str) -> None:
    if rank == 0:
        shutil.copytree(source, target)
        for p in Path(target).glob("step-00000008*"):
            shutil.rmtree(p)
    dist.barrier()


def _runs(rank: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for zero in (0, 1):  # 2 epochs of 4 steps, saved after each; then resumed from step 4
        whole = _fit(f"{root}/z{zero}", epochs=2, ep=2, zero=zero)
        _keep_only_step_4(rank, f"{root}/z{zero}", f"{root}/z{zero}-resumed")
        out[f"zero{zero}"] = (whole, _fit(f"{root}/z{zero}-resumed", epochs=2, ep=2, zero=zero, resume=True))
    out["ep4"] = _fit(f"{root}/ep4", epochs=1, ep=4, zero=2)
    for ep in (2, 1):  # nothing left to train: the parameters are the checkpoint's
        if rank == 0:
            shutil.copytree(f"{root}/ep4", f"{root}/ep4-at-{ep}")
        dist.barrier()
        out[f"at{ep}"] = _fit(f"{root}/ep4-at-{ep}", epochs=1, ep=ep, zero=0, resume=True)
    out["dense"] = _fit(f"{root}/dense", epochs=1)  # no EP, --zero 0: a dense step-<N>.pt
    out["dense-at2"] = _fit(f"{root}/dense", epochs=1, ep=2, resume=True)
    return out


def _two_ranks(rank: int, root: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return _fit(f"{root}/ep4-on-2", epochs=1, ep=2, zero=1, batch_size=32, resume=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe-ck")
    return root, spawn(_runs, 4, (str(root),), timeout_s=240)[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_resumed_at_step_4_ends_bit_identical_to_an_uninterrupted_run(
    runs: tuple[Path, dict[str, Any]], zero: int
) -> None:
    (whole, at_end), (resumed, resumed_at_end) = runs[1][f"zero{zero}"]
    assert (whole["ep"], whole["dp"], whole["zero"], whole["steps"]) == (2, 4, zero, 8)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 8
    for key in ("final_loss", "train_loss", "test_loss", "accuracy", "expert_load", "tokens_dropped"):
        assert resumed[key] == whole[key], key
    assert at_end.keys() == resumed_at_end.keys() and EXPERT in at_end
    for name, value in at_end.items():
        torch.testing.assert_close(resumed_at_end[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("ep", [2, 1])
def test_an_ep4_checkpoint_resumes_at_another_ep_with_the_same_experts(
    runs: tuple[Path, dict[str, Any]], ep: int
) -> None:
    saved_summary, saved = runs[1]["ep4"]
    summary, params = runs[1][f"at{ep}"]
    assert (saved_summary["ep"], summary["ep"]) == (4, ep)
    assert summary["resumed_from_step"] == saved_summary["steps"] == summary["steps"] == 4
    assert saved[EXPERT].shape[0] == 8
    for name, value in saved.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)


def test_an_ep4_checkpoint_resumes_on_2_ranks_at_ep2(runs: tuple[Path, dict[str, Any]]) -> None:
    root, out = runs
    shutil.copytree(root / "ep4", root / "ep4-on-2")
    summary, params = spawn(_two_ranks, 2, (str(root),), timeout_s=120)[0]
    assert (summary["dp"], summary["ep"], summary["resumed_from_step"], summary["steps"]) == (2, 2, 4, 4)
    for name, value in out["ep4"][1].items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)


def test_a_dense_checkpoint_without_ep_resumes_at_ep2(runs: tuple[Path, dict[str, Any]]) -> None:
    root, out = runs
    assert any((root / "dense").glob("step-*.pt"))
    (saved_summary, saved), (summary, params) = out["dense"], out["dense-at2"]
    assert (saved_summary["ep"], summary["ep"], summary["resumed_from_step"]) == (1, 2, 4)
    for name, value in saved.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("run", "offsets"), [("z1", [0, 4]), ("ep4", [0, 2, 4, 6])])
def test_each_expert_is_stored_once_under_its_global_index(
    runs: tuple[Path, dict[str, Any]], run: str, offsets: list[int]
) -> None:
    """EP 2 on 4 ranks: each expert box is held by two EDP replicas and written once; EP 4: once each."""
    root, _ = runs
    folder = sorted((root / run).glob("step-*.dcp"))[-1]
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    stored = meta[f"model.{EXPERT}"]
    assert isinstance(stored, TensorStorageMetadata) and stored.size[0] == 8
    assert sorted(c.offsets[0] for c in stored.chunks) == offsets
    assert f"optim.exp_avg.{EXPERT}" in meta and "buffer.blocks.0.mlp.router.expert_bias" in meta


COMPOSED = {  # 4 ranks: EP 2 over the 2 data-parallel ranks left
    "tp2_zero1": {"tp": 2, "zero": 1, "batch_size": 32},
    "pp2_zero0": {"pp": 2, "zero": 0, "micro_batches": 2},
    "cp2_zero3": {"cp": 2, "zero": 3, "batch_size": 32},
}


def _composed(rank: int, root: str) -> dict[str, Any]:
    out = {}
    for name, options in COMPOSED.items():
        whole = _fit(f"{root}/{name}", epochs=2, ep=2, **options)
        _keep_only_step_4(rank, f"{root}/{name}", f"{root}/{name}-resumed")
        resumed = _fit(f"{root}/{name}-resumed", epochs=2, ep=2, resume=True, **options)
        out[name] = (whole[0], resumed[0])
    return out


@pytest.mark.slow
def test_ep_with_tp_pp_and_cp_resumes_bit_identical(tmp_path: Path) -> None:
    for name, (whole, resumed) in spawn(_composed, 4, (str(tmp_path),), timeout_s=300)[0].items():
        assert resumed["resumed_from_step"] == 4 and resumed["steps"] == whole["steps"] == 8, name
        for key in ("final_loss", "test_loss", "accuracy", "expert_load"):
            assert resumed[key] == whole[key], (name, key)


def test_consolidate_gives_the_plain_model_every_expert(
    runs: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from ringtree.train import checkpointer
    from ringtree.train.models import build_model

    root, out = runs
    plain = build_model("moe")
    plain.load_state_dict(
        torch.load(checkpointer.consolidate(root / "ep4", tmp_path / "moe.pt"), weights_only=True)
    )
    for name, value in out["ep4"][1].items():
        torch.testing.assert_close(
            dict(plain.named_parameters())[name].detach(), value, rtol=0, atol=0, msg=name
        )


def test_the_loss_scale_and_the_token_counts_survive_a_checkpoint(tmp_path: Path) -> None:
    """--amp fp16's scaler (a CUDA run's; torch's CPU scaler here) and the dropped-token counts."""
    from ringtree.parallel import ExpertParallel, MoE
    from ringtree.train import expert_checkpoint, sharded_checkpoint
    from ringtree.train.layout import whole

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:

        def share(scale: float) -> expert_checkpoint.Share:
            torch.manual_seed(0)
            layer = MoE(8, 8, 4, top_k=1)
            experts = ExpertParallel(1)
            experts.apply(layer)
            optimizer = torch.optim.AdamW(layer.parameters())
            scaler = torch.amp.GradScaler("cpu", init_scale=scale)
            buffers = dict(layer.named_buffers())
            dense = list(layer.parameters())
            return expert_checkpoint.Share(experts, optimizer, whole(layer), None, dense, buffers, 0, scaler)

        saved = share(1024.0)
        saved.experts.copies += torch.tensor([3.0, 40.0], dtype=torch.float64)
        assert saved.scaler is not None
        saved.scaler.scale(torch.ones(()))
        saved.scaler.update(512.0)
        state = expert_checkpoint.state(saved, None)
        sharded_checkpoint.save_state(tmp_path, 1, "moe", state, keep=1)
        loaded = share(2.0)
        expert_checkpoint.load(loaded, next(tmp_path.glob("step-*.dcp")))
        assert loaded.scaler is not None and loaded.scaler.get_scale() == 512.0
        assert loaded.experts.copies.tolist() == [3.0, 40.0] and loaded.experts.dropped_fraction() == 3 / 40
    finally:
        dist.destroy_process_group()
