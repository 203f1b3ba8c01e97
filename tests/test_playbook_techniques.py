"""The playbook's building blocks alone: checkpointing, mixed precision, distillation, loaders."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ringtree.train import checkpoint
from ringtree.train.models import ViT, build_model
from ringtree.train.techniques import (
    MixedPrecision,
    PrefetchLoader,
    ShardedStream,
    default_segments,
    distillation_loss,
    load_teacher,
    run_blocks,
)


@pytest.mark.parametrize(("n", "segments"), [(1, 1), (2, 1), (4, 2), (9, 3), (16, 4), (24, 5)])
def test_default_segments_is_about_sqrt_n(n: int, segments: int) -> None:
    assert default_segments(n) == segments


def test_checkpointed_blocks_give_the_same_gradients_and_recompute() -> None:
    torch.manual_seed(0)
    plain = ViT(depth=6)
    ckpt = copy.deepcopy(plain)
    x, y = torch.rand(8, 64), torch.randint(0, 10, (8,))
    calls = [0] * 6
    for j, block in enumerate(ckpt.blocks):
        block.register_forward_pre_hook(lambda *_, j=j: calls.__setitem__(j, calls[j] + 1))
    for model, segments in ((plain, 0), (ckpt, 3)):
        h = run_blocks(model.blocks, model.tokens(x), segments)
        F.cross_entropy(model.head(model.norm(h[:, 0])), y).backward()
    assert calls == [2, 2, 2, 2, 1, 1]  # segments 1, 2 entered again in backward; torch keeps the last
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_checkpoint_segments_out_of_range_raise() -> None:
    with pytest.raises(ValueError, match="between 0 \\(off\\) and the 2 blocks, got 3"):
        run_blocks(ViT(depth=2).blocks, torch.rand(1, 17, 64), 3)


def test_bf16_autocast_runs_linears_in_bf16_on_cpu() -> None:
    amp = MixedPrecision("bf16")
    with amp.autocast():
        out = nn.Linear(4, 4)(torch.rand(2, 4))
    assert out.dtype == torch.bfloat16
    with MixedPrecision("off").autocast():
        assert nn.Linear(4, 4)(torch.rand(2, 4)).dtype == torch.float32


def test_fp16_on_cpu_explains_why_not() -> None:
    with pytest.raises(ValueError, match=r"fp16 needs a CUDA device.*use --amp bf16"):
        MixedPrecision("fp16", "cpu")
    with pytest.raises(ValueError, match="unknown amp 'fp8'"):
        MixedPrecision("fp8")


def _model_with_grad(value: float) -> tuple[nn.Linear, torch.optim.Optimizer]:
    net = nn.Linear(2, 1)
    for p in net.parameters():
        p.grad = torch.full_like(p, value)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def test_non_finite_steps_are_skipped_and_counted() -> None:
    amp = MixedPrecision("bf16")
    net, opt = _model_with_grad(float("nan"))
    before = net.weight.detach().clone()
    assert not amp.step(opt) and amp.skipped_steps == 1
    assert torch.equal(net.weight, before)  # nothing applied
    net, opt = _model_with_grad(1.0)
    assert amp.step(opt) and amp.skipped_steps == 1
    assert (
        not amp.step(opt, agree=lambda ok: False) and amp.skipped_steps == 2
    )  # the ranks' joint verdict wins


def test_loss_scaling_skips_inf_gradients_and_lowers_the_scale() -> None:
    amp = MixedPrecision("bf16")
    amp.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the fp16 path, exercised on CPU
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.backward(net(torch.full((1, 2), 1e38)).sum() * 1e10)  # overflows to inf
    before = net.weight.detach().clone()
    assert not amp.step(opt) and amp.skipped_steps == 1 and amp.scaler.get_scale() == 512.0
    assert torch.equal(net.weight, before)
    opt.zero_grad()
    amp.backward(net(torch.ones(1, 2)).sum())
    assert amp.step(opt) and amp.skipped_steps == 1
    torch.testing.assert_close(net.weight, before - 0.1)  # unscaled: the true gradient is 1


def test_distillation_loss_matches_its_formula() -> None:
    torch.manual_seed(0)
    s, t, y = torch.randn(6, 10), torch.randn(6, 10), torch.randint(0, 10, (6,))
    temp, alpha = 3.0, 0.7
    p_t = F.softmax(t / temp, dim=1)
    kl = (p_t * (p_t.log() - F.log_softmax(s / temp, dim=1))).sum(dim=1).mean()
    expected = alpha * temp**2 * kl + (1 - alpha) * F.cross_entropy(s, y)
    torch.testing.assert_close(distillation_loss(s, t, y, temp, alpha), expected)
    torch.testing.assert_close(distillation_loss(s, t, y, temp, 0.0), F.cross_entropy(s, y))
    assert float(distillation_loss(s, s, y, temp, 1.0)) == pytest.approx(0.0, abs=1e-6)


def test_load_teacher_from_the_folder_or_the_file(tmp_path: Path) -> None:
    torch.manual_seed(1)
    net = build_model("vit")
    checkpoint.save(tmp_path, {"step": 5, "model_name": "vit", "model": net.state_dict()})
    x = torch.rand(3, 64)
    for path in (tmp_path, tmp_path / "last.pt"):
        teacher, name = load_teacher(path, build_model)
        assert name == "vit" and not teacher.training
        assert all(not p.requires_grad for p in teacher.parameters())
        torch.testing.assert_close(teacher(x), net.eval()(x))


def test_load_teacher_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no teacher checkpoint at .*--checkpoint-dir"):
        load_teacher(tmp_path, build_model)
    torch.save({"step": 1, "model": {}}, tmp_path / "last.pt")
    with pytest.raises(ValueError, match="records no model kind"):
        load_teacher(tmp_path, build_model)
    torch.save({"step": 1, "model_name": "mlp", "model": build_model("vit").state_dict()}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="does not fit a fresh 'mlp' model"):
        load_teacher(tmp_path / "x.pt", build_model)


def _epoch_stream(epoch: int) -> Iterator[int]:
    order = torch.randperm(23, generator=torch.Generator().manual_seed(epoch))
    yield from order.tolist()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores, on purpose
def test_sharded_stream_reads_every_sample_once_for_1_to_4_ranks_and_0_to_3_workers() -> None:
    for world in range(1, 5):
        for workers in range(4):
            for epoch in (0, 1):
                seen: list[int] = []
                counts = []
                for rank in range(world):
                    stream = ShardedStream(_epoch_stream, rank, world)
                    stream.set_epoch(epoch)
                    mine = [int(s) for s in DataLoader(stream, batch_size=None, num_workers=workers)]
                    seen += mine
                    counts.append(len(mine))
                assert sorted(seen) == list(range(23)), (world, workers, epoch)
                assert max(counts) - min(counts) <= max(1, workers), (world, workers, counts)


def test_sharded_stream_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        ShardedStream(_epoch_stream, 2, 2)


def test_prefetch_prepares_the_next_batch_while_this_one_computes() -> None:
    produced = [threading.Event() for _ in range(3)]

    def source() -> Iterator[torch.Tensor]:
        for i in range(3):
            produced[i].set()
            yield torch.full((2,), float(i))

    batches = []
    for i, batch in enumerate(PrefetchLoader(source())):
        if i < 2:  # while batch i "computes", batch i + 1 is already being made
            assert produced[i + 1].wait(timeout=10.0)
        batches.append(batch)
    assert [b.tolist() for b in batches] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_prefetch_reraises_the_loaders_error_and_stops_on_break() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(PrefetchLoader(broken()))
    loader = DataLoader(list(range(100)), batch_size=4)
    it = iter(PrefetchLoader(loader, depth=1))
    assert next(it).tolist() == [0, 1, 2, 3]
    it.close()  # as a `break` does: the thread ends
    assert len(PrefetchLoader(loader)) == 25
    with pytest.raises(ValueError, match="depth must be at least 1"):
        PrefetchLoader(loader, depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_pins_and_copies_to_cuda() -> None:
    loader = DataLoader(torch.arange(8.0), batch_size=4)
    batches = list(PrefetchLoader(loader, "cuda"))
    assert all(b.is_cuda for b in batches) and torch.cat(batches).cpu().tolist() == list(range(8))


def test_checkpointing_benchmark_sees_the_memory_saving() -> None:
    from benchmarks import checkpointing

    off, on = checkpointing.in_subprocess(0, "cpu", 256), checkpointing.in_subprocess(4, "cpu", 256)
    assert off["step_time_s"] > 0 and on["step_time_s"] > 0
    assert 0 < on["peak_bytes"] < 0.7 * off["peak_bytes"]  # the bar, at half the batch
