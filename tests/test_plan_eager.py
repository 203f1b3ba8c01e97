"""`plan --elementwise eager` (issue 21): eager PyTorch's elementwise kernels, each a pass through HBM.

The kernel counts of ringtree.sim.training.eager are checked against the aten ops torch's own autograd runs
for torchtitan's code (views and allocations launch no kernel); the pricing against the bytes
counted by hand; the default (fused) against the compute model it had before the option."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.clusters import H100, get
from ringtree.sim.training import compute, eager
from ringtree.sim.training.layout import Training
from ringtree.sim.training.memory import activation_bytes_per_layer
from ringtree.sim.training.predictor import layer_times, plan
from ringtree.sim.training.transformer import Transformer

LLAMA = Transformer(4, 1024, 16, 2048, 32000, 4, 2816, "swiglu")
NO_KERNEL = {"view", "_unsafe_view", "expand", "transpose", "view_as_complex", "view_as_real", "unsqueeze",
             "squeeze", "permute", "slice", "select", "as_strided", "detach", "alias", "_conj",
             "new_empty_strided", "empty_like", "ones_like"}  # fmt: skip


class _Kernels(TorchDispatchMode):
    """The aten ops dispatched inside the block, views and allocations left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ not in NO_KERNEL:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# torchtitan/models/norms.py RMSNorm and models/llama/model.py (d4c86e37), as written there
def _rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    return norm(x.float()).type_as(x) * weight


def _rotary(xq: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)


def _repeat_kv(x: torch.Tensor) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    return torch.unsqueeze(x, dim=3).expand(bs, slen, n_kv_heads, 2, head_dim).reshape(bs, slen, -1, head_dim)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)


def _kernels(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[int, int]:
    with _Kernels() as forward:
        y = fn(*args)
    seed = torch.ones_like(y)
    with _Kernels() as backward:
        y.backward(seed)
    return len(forward.ops), len(backward.ops)


@pytest.mark.parametrize(
    ("op", "fn", "args"),
    [
        (eager.RMSNORM, _rmsnorm, lambda: (_bf16(2, 8, 16), _bf16(16))),
        (
            eager.ROTARY,
            _rotary,
            lambda: (_bf16(2, 8, 4, 16), torch.polar(torch.ones(8, 8), torch.randn(8, 8)).view(1, 8, 1, 8)),
        ),
        (eager.SWIGLU, lambda a, b: F.silu(a) * b, lambda: (_bf16(2, 8, 16), _bf16(2, 8, 16))),
        (eager.GELU, F.gelu, lambda: (_bf16(2, 8, 16),)),
        (eager.REPEAT, _repeat_kv, lambda: (_bf16(2, 8, 2, 16),)),
        (eager.TRANSPOSE, lambda o: o.transpose(1, 2).contiguous(), lambda: (_bf16(2, 4, 8, 16),)),
    ],
)
def test_kernels_per_op_are_the_ones_torchs_autograd_runs(
    op: eager.Op, fn: Callable[..., torch.Tensor], args: Callable[[], tuple[torch.Tensor, ...]]
) -> None:
    assert _kernels(fn, *args()) == (op.forward_kernels, op.backward_kernels)


def test_a_layers_eager_bytes_are_the_ops_passes_over_its_tensors() -> None:
    """h 1024, K/V 256 wide (4 of 16 heads), F 2816: forward per token 2 h (36 + 6) for the norms and
    adds, 20 (h + kv) rotary, 2 x 2 (h + kv) repeat_kv, 4 h transpose, 10 F SwiGLU; the backward
    2 h (92 + 6) + 20 (h + kv) + 4 (h + kv) + 4 h + 18 F. Split over TP 2 with SP, all of it halves."""
    h, kv, f, tokens, gpu = 1024, 256, 2816, 4096, H100
    kernels = 2 * (8 + 1) + 2 * 3 + 2 * 1 + 1 + 2, 2 * (16 + 1) + 2 * 4 + 2 * 1 + 1 + 3
    forward = 2 * h * 42 + 20 * (h + kv) + 4 * (h + kv) + 4 * h + 10 * f
    backward = 2 * h * 98 + 20 * (h + kv) + 4 * (h + kv) + 4 * h + 18 * f
    rate = gpu.hbm_GBps * 1e9
    for tp, sp in ((1, False), (2, True)):
        got = eager.passes_s(LLAMA, tokens, tp, sp, gpu)
        want = (tokens * forward / tp / rate + kernels[0] * compute.KERNEL_S,
                tokens * backward / tp / rate + kernels[1] * compute.KERNEL_S)  # fmt: skip
        assert got == pytest.approx(want, rel=1e-12)
    # without sequence parallelism every TP rank runs the norms and adds on all the tokens
    tp2 = eager.passes_s(LLAMA, tokens, 2, False, gpu)[0] - kernels[0] * compute.KERNEL_S
    assert tp2 * rate == pytest.approx(tokens * (2 * h * 42 + (forward - 2 * h * 42) / 2))


def test_fused_is_the_default_and_prices_as_before() -> None:
    run, gpu = Training(8, 1, dtype="bf16"), H100
    assert run.elementwise == "fused"
    tokens = LLAMA.seq
    mats = compute.matmuls_s(LLAMA, tokens, 1, gpu, "bf16")
    attention = compute.attention_s(LLAMA, 1, 1, 1, gpu, "bf16")
    other = compute.elementwise_s(activation_bytes_per_layer(LLAMA, run, "none"), gpu)
    forward, backward, _ = layer_times(LLAMA, run, gpu)
    assert forward == mats + attention + other
    assert backward == 2 * (mats + other) + compute.FLASH_BACKWARD * attention


def test_eager_costs_more_than_fused_and_only_in_elementwise_time() -> None:
    cluster, gpu = get("dgx-h100").cluster(1), H100
    fused, slow = (plan(LLAMA, Training(8, 1, elementwise=e), cluster, gpu) for e in ("fused", "eager"))
    assert slow.step_s > fused.step_s and slow.compute_s > fused.compute_s
    assert slow.mfu < fused.mfu and slow.memory == fused.memory


def test_cli_eager_is_slower_and_refused_where_it_would_be_ignored(tmp_path: Path) -> None:
    base = ["plan", "--model", "llama3-8b", "--global-batch", "16", "--nodes", "1", "--cluster", "dgx-h100"]
    steps = {}
    for mode in ("fused", "eager"):
        out = tmp_path / f"{mode}.json"
        result = CliRunner().invoke(app, [*base, "--elementwise", mode, "--json", str(out)])
        assert result.exit_code == 0, result.output
        steps[mode] = json.loads(out.read_text())["step_s"]
    assert steps["eager"] > steps["fused"]
    for args, words in (
        (["--elementwise", "lazy"], "unknown --elementwise 'lazy'; choose fused or eager"),
        (["--elementwise", "eager", "--search"], "--elementwise do not apply with --search"),
    ):
        out = tmp_path / "refused.json"
        result = CliRunner().invoke(app, [*base, *args, "--json", str(out)])
        said = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and words in said, result.output
        assert "Traceback" not in result.output and not out.exists()
