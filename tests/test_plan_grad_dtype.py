"""`plan --grad-dtype` for the transformer (issue 21): gradients accumulated and reduced in fp32 under bf16.

Megatron-LM, torchtitan's FSDP2, Apex's DistributedFusedAdam and Llama 3 reduce bf16 runs' gradients
in fp32 (ringtree/sim/layout.py); the planner prices that in the data-parallel reduction's bytes and
in the gradient buffers, while ZeRO's parameter all-gathers keep moving 16-bit weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.clusters import H100
from ringtree.sim.hardware import Cluster, Link
from ringtree.sim.layout import Training
from ringtree.sim.memory import states_bytes
from ringtree.sim.plan import Layout, StepWork, predict
from ringtree.sim.predictor import work
from ringtree.sim.transformer import Transformer

MODEL = Transformer(4, 1024, 16, 2048, 32000, 4, 2816, "swiglu")
# bandwidth only (no latency): a collective's time is exactly proportional to its bytes
LINEAR = Cluster(2, 4, Link("nv", 0.0, 1e11), Link("net", 0.0, 1e10))


def test_the_default_is_fp32_under_bf16_and_fp16_under_fp16() -> None:
    assert Training(8).gradients == "fp32" and Training(8).grad_itemsize == 4
    assert Training(8, dtype="fp16").gradients == "fp16" and Training(8, dtype="fp16").grad_itemsize == 2
    assert Training(8, grad_dtype="bf16").grad_itemsize == 2
    assert Training(8, dtype="fp16", grad_dtype="fp32").grad_itemsize == 4


def test_fp32_gradients_double_the_reduction_and_leave_the_parameter_gathers() -> None:
    fp32, bf16 = (work(MODEL, Training(8, zero=1, grad_dtype=g), H100, 8) for g in ("fp32", "bf16"))
    assert fp32.grad_bytes == 2 * bf16.grad_bytes and (fp32.itemsize, bf16.itemsize) == (4, 2)
    assert fp32.param_bytes == bf16.param_bytes == bf16.grad_bytes  # the weights stay 16-bit
    for zero in (0, 1, 2):
        a, b = (predict(w, LINEAR, "ring", Layout(zero=zero)) for w in (fp32, bf16))
        assert a.dp_allreduce_s == pytest.approx(2 * b.dp_allreduce_s) and b.dp_allreduce_s > 0
        if zero:  # ZeRO-1/2 all-gather the stepped 16-bit weights: the same bytes either way
            assert a.exposed_zero_gather_s == pytest.approx(b.exposed_zero_gather_s)
            assert b.exposed_zero_gather_s > 0
    # ZeRO-3 gathers each layer's 16-bit weights in forward and backward: unchanged by the gradients
    slow = Cluster(2, 4, Link("nv", 0.0, 1e9), Link("net", 0.0, 1e8))
    gathers = [
        predict(
            StepWork(1e-3, 2e-3, 1, (1 << 20) * i, i, layers=4, param_itemsize=2),
            slow,
            "ring",
            Layout(zero=3),
        )
        for i in (4, 2)  # 1 Mi gradients in fp32 or bf16: the same 2 MiB of 16-bit weights
    ]
    assert gathers[0].exposed_zero_gather_s == pytest.approx(gathers[1].exposed_zero_gather_s)
    assert gathers[1].exposed_zero_gather_s > 0


def test_fp32_gradients_take_their_bytes_in_memory_sharded_by_zero_2() -> None:
    n, params = 8, 1e9
    for zero, extra in ((0, 2.0), (1, 2.0), (2, 2.0 / n), (3, 0.0)):
        fp32, bf16 = (
            states_bytes(params, Training(64, zero=zero, grad_dtype=g), n) for g in ("fp32", "bf16")
        )
        assert fp32 - bf16 == pytest.approx(extra * params)


def test_cli_grad_dtype_moves_the_reduction_and_the_memory(tmp_path: Path) -> None:
    base = ["plan", "--model", "llama3-8b", "--global-batch", "32", "--nodes", "2", "--cluster", "dgx-h100",
            "--zero", "1"]  # fmt: skip
    plans = {}
    for dtype in ("fp32", "bf16", None):
        out = tmp_path / f"{dtype}.json"
        flag = ["--grad-dtype", dtype] if dtype else []
        result = CliRunner().invoke(app, [*base, *flag, "--json", str(out)])
        assert result.exit_code == 0, result.output
        plans[dtype] = json.loads(out.read_text())
    fp32, bf16, default = plans["fp32"], plans["bf16"], plans[None]
    assert default["step_s"] == fp32["step_s"] and default["details"]["training"]["grad_dtype"] is None
    assert fp32["dp_allreduce_s"] > 1.5 * bf16["dp_allreduce_s"]
    grown = fp32["memory"]["weights_grads_optimizer_GiB"] - bf16["memory"]["weights_grads_optimizer_GiB"]
    assert grown * 2**30 == pytest.approx(2 * 8.03e9, rel=0.01)  # 2 more bytes per parameter, unsharded


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--grad-dtype", "fp8"], "unknown --grad-dtype 'fp8'; choose fp32, bf16 or fp16"),
        (["--grad-dtype", "fp16"], "--grad-dtype fp16 does not match --dtype bf16"),
        (["--grad-dtype", "fp16", "--search"], "--grad-dtype fp16 does not match --dtype bf16"),
    ],
)
def test_cli_refuses_a_bad_grad_dtype_in_one_sentence(tmp_path: Path, args: list[str], words: str) -> None:
    out = tmp_path / "refused.json"
    base = ["plan", "--model", "llama3-8b", "--global-batch", "32", "--nodes", "1", "--cluster", "dgx-h100"]
    result = CliRunner().invoke(app, [*base, *args, "--json", str(out)])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and words in said, result.output
    assert "Traceback" not in result.output and not out.exists()
