"""ThreadedDataParallel: the plain module's gradients in both variants, and the balanced one is balanced.

On CPU the "devices" are copies of the module run in threads; on CUDA (marked gpu) the real thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringtree.parallel.dp_threads import ThreadedDataParallel


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 5))


def _data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _plain_grads(x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    net = _net()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in net.parameters() if p.grad is not None]


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_gradients_equal_the_plain_module(balanced: bool, n: int) -> None:
    x, y = _data(10)  # 10 over 3 devices: unequal chunks 4, 3, 3
    expected_loss, expected = _plain_grads(x, y)
    net = _net()
    dp = ThreadedDataParallel(net, [torch.device("cpu")] * n, balanced=balanced, loss_fn=F.cross_entropy)
    loss = dp.forward_backward(x, y)
    assert not loss.requires_grad
    assert float(loss) == pytest.approx(expected_loss, rel=1e-6)
    got = [p.grad for p in net.parameters()]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_device_zero_carries_the_unbalanced_variant() -> None:
    x, y = _data(12)
    figures = {}
    for balanced in (False, True):
        dp = ThreadedDataParallel(
            _net(), [torch.device("cpu")] * 3, balanced=balanced, loss_fn=F.cross_entropy
        )
        dp.forward_backward(x, y)
        figures[balanced] = dp.stats()
    unbalanced, balanced_ = figures[False], figures[True]
    assert unbalanced["imbalance"] > balanced_["imbalance"] + 0.5, figures
    assert balanced_["imbalance"] < 1.2
    assert unbalanced["held_bytes"][0] > 2 * unbalanced["held_bytes"][1]  # its chunk and every output
    assert len(unbalanced["seconds"]) == 3 and all(s >= 0 for s in unbalanced["seconds"])


def test_an_error_in_a_device_thread_is_raised_in_the_caller() -> None:
    dp = ThreadedDataParallel(_net(), [torch.device("cpu")] * 2, balanced=True, loss_fn=F.cross_entropy)
    with pytest.raises(RuntimeError):
        dp.forward_backward(torch.randn(4, 7), torch.zeros(4, dtype=torch.long))  # wrong feature count


def test_mixed_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="all CUDA or all CPU"):
        ThreadedDataParallel(
            _net(), [torch.device("cpu"), torch.device("meta")], balanced=True, loss_fn=F.mse_loss
        )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("balanced", [False, True])
def test_cuda_gradients_equal_the_plain_module(balanced: bool) -> None:
    x, y = _data(16)
    _, expected = _plain_grads(x, y)
    net = _net()
    devices = [torch.device("cuda", k) for k in range(torch.cuda.device_count())]
    dp = ThreadedDataParallel(net, devices, balanced=balanced, loss_fn=F.cross_entropy)
    dp.forward_backward(x, y)
    for p, b in zip(net.parameters(), expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad.cpu(), b, rtol=1e-4, atol=1e-5)
    assert "peak_memory_bytes" in dp.stats()
