"""PowerSGD: ringtree's DDP and hook give torch's powerSGD_hook's gradients; rank 1 passes exactly."""

from __future__ import annotations

import io
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import ringtree
from ringtree.comm.powersgd import PowerSGD, orthogonalize
from ringtree.parallel import DistributedDataParallel
from ringtree.processes import spawn

STEPS = 5  # start_iter 2: two plain all-reduces, then three compressed steps

# (rank, start_iter, min_compression_rate, error_feedback, warm_start): every switch torch has,
# QR's path (rank 3) beside Gram-Schmidt's, and a rate below 1 at which torch compresses biases too
OPTIONS: list[tuple[int, int, float, bool, bool]] = [
    (2, 2, 2.0, True, True),
    (1, 2, 2.0, False, False),
    (3, 2, 0.5, True, False),
    (2, 3, 2.0, False, True),
]


def net() -> nn.Module:
    """Layers of three shapes, one shape coming back after another (torch orders P and Q by
    shape, first seen first), a wide input and a narrow output (uncompressed at rate 2)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 24),
        nn.Tanh(),
        nn.Linear(24, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


PARAMETERS = 10


def torch_hook_in_order(
    state: torch_powersgd.PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, each bucket finished before the next starts: on gloo its chained
    callbacks of two buckets run on the backend's threads in any order, and the ranks' P and Q
    all-reduces then pair up wrongly (gloo aborts: "Received data size doesn't match")."""
    fut = torch_powersgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


# torch checks a hook's annotations as objects; this module's are strings (future import)
torch_hook_in_order.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
)


def train(kind: str, options: tuple[int, int, float, bool, bool], bucket_mb: float) -> list[torch.Tensor]:
    """Every step's gradients of `kind`: torch's hook, ringtree's hook in torch's DDP, ringtree's DDP."""
    rank, start, rate, feedback, warm = options
    model = net()
    if kind == "ringtree-ddp":
        state = PowerSGD(rank, start, rate, feedback, warm, seed=0)
        ddp: nn.Module = DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, compression=state, algorithm="ring"
        )
    else:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        if kind == "torch":
            torch_state = torch_powersgd.PowerSGDState(None, rank, start, rate, feedback, warm, random_seed=0)
            ddp.register_comm_hook(torch_state, torch_hook_in_order)
        else:
            ddp.register_comm_hook(
                PowerSGD(rank, start, rate, feedback, warm), ringtree.powersgd_hook("ring")
            )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads += [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
    return grads


def compare_with_torch(
    rank: int, bucket_mb: float, options: list[tuple[int, int, float, bool, bool]]
) -> dict[str, list[list[torch.Tensor]]]:
    return {
        kind: [train(kind, o, bucket_mb) for o in options]
        for kind in ("torch", "ringtree-hook", "ringtree-ddp")
    }


def _assert_torch_equal(
    ranks: list[dict[str, list[list[torch.Tensor]]]], options: list[tuple[int, int, float, bool, bool]]
) -> None:
    for runs in ranks:
        for kind in ("ringtree-hook", "ringtree-ddp"):
            for option, got, want in zip(options, runs[kind], runs["torch"], strict=True):
                for k, (a, b) in enumerate(zip(got, want, strict=True)):
                    msg = f"{kind} {option}: step {k // PARAMETERS}, parameter {k % PARAMETERS}"
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)
    # compression really ran: a compressed step's gradients are not the plain average's
    plain, compressed = ranks[0]["torch"][0][:PARAMETERS], ranks[0]["torch"][0][-PARAMETERS:]
    assert not any(torch.allclose(a, b) for a, b in zip(plain, compressed, strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_powersgd_gives_torch_powersgd_hook_gradients(world: int) -> None:
    """One bucket (the default cap) on 2 gloo ranks with every option of torch's state; on 4 with
    error feedback and warm start, and with QR's rank and the low rate."""
    options = OPTIONS if world == 2 else [OPTIONS[0], OPTIONS[2]]
    _assert_torch_equal(spawn(compare_with_torch, world, (25.0, options), timeout_s=300), options)


def test_powersgd_matches_torch_bucket_by_bucket() -> None:
    """Small buckets (several per step: each its own error, P and Q memories and random seed)."""
    _assert_torch_equal(spawn(compare_with_torch, 2, (0.004, OPTIONS), timeout_s=300), OPTIONS)


def rank_one_runs(rank: int) -> dict[str, list[torch.Tensor]]:
    """A bias-free layer fed one input x shared by every rank and step: each rank's gradient
    w_r x^T, their sum and every error PowerSGD feeds back are rank 1, along the same x."""
    runs = {}
    for kind in ("plain", "powersgd"):
        torch.manual_seed(0)
        layer = nn.Linear(12, 10, bias=False)
        state = PowerSGD(rank=1, start_iter=2) if kind == "powersgd" else None
        ddp = DistributedDataParallel(layer, compression=state)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        x = torch.randn(1, 12, generator=torch.Generator().manual_seed(100))  # every rank's, every step
        c = torch.Generator().manual_seed(rank)  # a different output weighting on each rank and step
        grads = []
        for _ in range(STEPS):
            w = torch.randn(1, 10, generator=c)
            opt.zero_grad()
            (ddp(x) * w).sum().backward()
            grads.append(layer.weight.grad.detach().clone())  # type: ignore[union-attr]
            opt.step()
        runs[kind] = grads
        assert state is None or (state.iter == STEPS and state.numel_before > 0)  # it did compress
    return runs


def test_a_rank_one_gradient_passes_powersgd_exactly() -> None:
    for runs in spawn(rank_one_runs, 2, timeout_s=120):
        for step, (got, want) in enumerate(zip(runs["powersgd"], runs["plain"], strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")


def checkpoint_runs(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train 3 steps, save model, optimizer and PowerSGD state; a fresh run loads them: its next
    3 steps equal the uninterrupted run's, bitwise."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer, DistributedDataParallel]:
        model = net()
        ddp = DistributedDataParallel(model, compression=PowerSGD(rank=2, start_iter=1))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), ddp

    def steps(model: nn.Module, opt: torch.optim.Optimizer, ddp: nn.Module, first: int) -> list[torch.Tensor]:
        out = []
        for k in range(first, first + 3):
            g = torch.Generator().manual_seed(1000 * k + rank)
            x, y = torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            out += [p.detach().clone() for p in model.parameters()]
        return out

    default = DistributedDataParallel(net(), compression="powersgd").powersgd  # is PowerSGD()
    assert default is not None and default.state_dict()["options"] == PowerSGD().state_dict()["options"]
    model, opt, ddp = make()
    steps(model, opt, ddp, 0)
    buffer = io.BytesIO()
    assert ddp.powersgd is not None and ddp.powersgd.error  # error buffers to save
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "psgd": ddp.powersgd.state_dict()}, buffer
    )
    straight = steps(model, opt, ddp, 3)
    buffer.seek(0)
    saved: dict[str, Any] = torch.load(buffer, weights_only=True)
    model, opt, ddp = make()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert ddp.powersgd is not None
    ddp.powersgd.load_state_dict(saved["psgd"])
    return straight, steps(model, opt, ddp, 3)


def test_powersgd_state_round_trips_through_a_checkpoint() -> None:
    for straight, resumed in spawn(checkpoint_runs, 2, timeout_s=120):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_orthogonalize_is_torchs_and_goes_through_fp32_in_half_precision() -> None:
    g = torch.Generator().manual_seed(0)
    for r in (1, 2, 4):  # Gram-Schmidt, then QR
        m = torch.randn(3, 20, r, generator=g)
        want = m.clone()
        torch_powersgd._orthogonalize(want)
        assert torch.equal(orthogonalize(m.clone()), want)
    half = torch.randn(2, 64, 2, generator=g).bfloat16()
    ours = orthogonalize(half.clone())
    wide = half.float()
    torch_powersgd._orthogonalize(wide)
    assert torch.equal(ours, wide.bfloat16())  # fp32's result, rounded once


@pytest.mark.parametrize(
    ("options", "word"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 1.5}, "rank"),
        ({"start_iter": -1}, "start_iter"),
        ({"min_compression_rate": 0}, "min_compression_rate"),
        ({"epsilon": -1e-8}, "epsilon"),
    ],
)
def test_bad_powersgd_options_are_refused_by_name(options: dict[str, Any], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        PowerSGD(**options)


def test_the_hook_takes_a_powersgd_state_that_survives_torchs_bucket_rebuild() -> None:
    from ringtree.comm.hook import _check_hook_state

    with pytest.raises(TypeError, match="ringtree PowerSGD"):
        _check_hook_state(torch_powersgd.PowerSGDState(None))
    with pytest.raises(ValueError, match="start_iter 2 or more"):
        _check_hook_state(PowerSGD(start_iter=1))
    _check_hook_state(PowerSGD(start_iter=1, error_feedback=False, warm_start=False))


def test_one_powersgd_state_serves_one_model() -> None:
    state = PowerSGD()
    state.bind()
    with pytest.raises(ValueError, match="its own PowerSGD"):
        state.bind()


def trainer_runs(rank: int, ck: str) -> dict[str, Any]:
    """`ringtree train --compression powersgd`: 46 steps straight, and 21 + a resume to 46."""
    from dataclasses import replace

    from ringtree.train import TrainConfig, Trainer

    cfg = TrainConfig(
        epochs=2, progress=False, compression="powersgd", powersgd_rank=2, powersgd_start_iter=3
    )
    out = {"full": Trainer.from_config(replace(cfg, checkpoint_dir=f"{ck}/full")).run().summary}
    first = replace(cfg, epochs=1, checkpoint_dir=f"{ck}/part", checkpoint_every=7)
    Trainer.from_config(first).run()  # its last checkpoint: step 21 of 23
    out["resumed"] = Trainer.from_config(replace(cfg, checkpoint_dir=f"{ck}/part", resume=True)).run().summary
    if rank == 0:  # other buckets (--bucket-mb): the model resumes, PowerSGD's memories start afresh
        shutil.copytree(f"{ck}/full", f"{ck}/rebucketed")
    dist.barrier()
    other = replace(cfg, epochs=3, bucket_mb=0.01, checkpoint_dir=f"{ck}/rebucketed", resume=True)
    out["rebucketed"] = Trainer.from_config(other).run().summary
    return out


def test_train_with_powersgd_resumes_bit_identical(tmp_path: Any) -> None:
    results = spawn(trainer_runs, 2, (str(tmp_path),), timeout_s=300)
    summary = results[0]["full"]
    assert summary["compression"] == "powersgd" and summary["powersgd_rank"] == 2
    assert results[0]["resumed"]["resumed_from_step"] == 21
    assert results[0]["rebucketed"]["resumed_from_step"] == 46 and results[0]["rebucketed"]["steps"] == 69
    full, resumed = (torch.load(tmp_path / f"{run}/last.pt", weights_only=True) for run in ("full", "part"))
    assert full["step"] == resumed["step"] == 46
    for name, tensor in full["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), f"{name} differs after resuming"
    errors = [ranks[0]["state"]["error"] for ranks in full["powersgd"]]  # every rank's own
    assert len(errors) == 2 and errors[0] and not torch.equal(errors[0]["0"], errors[1]["0"])
    assert all(ranks[0]["state"]["iter"] == 46 for ranks in resumed["powersgd"])


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"compression": "powersgd", "amp": "fp16"}, "use --amp bf16"),
        ({"compression": "powersgd", "zero": 1}, "not supported with --zero 1"),
        ({"compression": "powersgd", "mode": "dp"}, "options of DDP's buckets"),
        ({"compression": "fp16", "powersgd_start_iter": 5}, "configures --compression powersgd"),
    ],
)
def test_train_refuses_powersgd_where_it_cannot_apply(options: dict[str, Any], words: str) -> None:
    from ringtree.train.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError) as refused:
        TrainConfig(**options)
    assert words in refused.value.cli


def every_algorithm(rank: int) -> dict[str, list[torch.Tensor]]:
    """Two steps (the second compressed) of small buckets, P and Q summed by each algorithm."""
    from ringtree import comm

    out = {}
    for algorithm in comm.algorithms("all_reduce"):
        model = net()
        state = PowerSGD(rank=2, start_iter=1, error_feedback=False, warm_start=False)
        ddp = DistributedDataParallel(model, algorithm=algorithm, compression=state, bucket_cap_mb=0.004)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x, y = torch.randn(16, 24, generator=g), torch.randint(0, 4, (16,), generator=g)
            model.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
        ddp.close()
        out[algorithm] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    return out


def test_powersgd_sums_on_every_ringtree_algorithm() -> None:
    """3 ranks (no power of two): every algorithm's P, Q and plain sums give native's gradients."""
    runs = spawn(every_algorithm, 3, timeout_s=300)[0]
    for algorithm, grads in runs.items():
        for a, b in zip(grads, runs["native"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=algorithm)


def test_the_benchmark_counts_the_bytes_each_powersgd_sends(tmp_path: Any) -> None:
    """benchmarks/powersgd.py: every PowerSGD variant hands the all-reduce the same P, Q and
    biases: (1024+256)2 + 2(1024+1024)2 + (10+1024)2 + 3082 bias elements = 15,902 fp32 numbers."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks/powersgd.py"),
            "--steps",
            "1",
            "--rounds",
            "1",
            "--json",
            "out.json",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    variants = json.loads((tmp_path / "out.json").read_text())["variants"]
    for name, v in variants.items():
        want = 4 * 15_902 if "powersgd" in name else 4 * 2_372_618
        assert v["allreduced_bytes_per_step"] == want, name
        assert v["samples_per_s"] > 0


def test_powersgd_times_its_own_work_and_leaves_the_all_reduces_out() -> None:
    """work_s_per_step: None before a compressed step; then the seconds of its own work per
    compressed step, which a sum that takes 0.1 s each time does not reach."""
    import time

    state = PowerSGD(rank=2, start_iter=1)
    flat = torch.randn(64 * 32 + 32)
    grads = [flat[: 64 * 32].view(64, 32), flat[64 * 32 :]]

    def slow_sum(t: torch.Tensor) -> None:
        time.sleep(0.1)

    state.reduce(0, flat, grads, 2, slow_sum)  # a plain all-reduce: no work of its own
    state.step_done()
    assert state.work_s_per_step() is None
    began = time.perf_counter()
    for _ in range(2):
        state.reduce(0, flat, grads, 2, slow_sum)  # three sums: plain, P, Q
        state.step_done()
    elapsed = time.perf_counter() - began
    work = state.work_s_per_step()
    assert state.compressed_steps == 2 and work is not None
    assert 0 < work < 0.05 and elapsed > 0.6
    assert work == pytest.approx(state.work_s / 2)
