"""`plan --grad-dtype` (gradients accumulated and reduced in fp32 under bf16), `--no-dropout` (no masks
stored) and `--recompute op` (torchtitan's per-op selective AC) for the transformer (issue 21).

Megatron-LM, torchtitan's FSDP2, Apex's DistributedFusedAdam and Llama 3 reduce bf16 runs' gradients
in fp32 (ringtree/sim/training/layout.py); the planner prices that in the data-parallel reduction's bytes and
in the gradient buffers, while ZeRO's parameter all-gathers keep moving 16-bit weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.clusters import H100
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.layout import Training
from ringtree.sim.training.memory import activation_bytes_per_layer, states_bytes
from ringtree.sim.training.plan import Layout, StepWork, predict
from ringtree.sim.training.predictor import layer_times, work
from ringtree.sim.training.search import candidates
from ringtree.sim.training.transformer import MODELS, SEARCHED, Transformer

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
    assert default["step_s"] == fp32["step_s"] and default["details"]["training"]["grad_dtype"] == "fp32"
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


def test_a_model_without_dropout_stores_no_masks() -> None:
    """Korthikanti et al.'s 10 s b h replicated bytes hold two 1-byte dropout masks: 8 without them;
    unfused attention keeps its softmax output (2 a s^2 b) but not the mask and dropout output."""
    gpt = Transformer(2, 64, 4, 16, 100)
    llama = Transformer(2, 64, 4, 16, 100, dropout=False)
    sbh = 16 * 2 * 64
    run = Training(8, 2)
    assert activation_bytes_per_layer(gpt, run) - activation_bytes_per_layer(llama, run) == 2 * sbh
    unfused = Training(8, 2, flash_attention=False)
    scores = 4 * 16 * 16 * 2  # a s^2 b
    assert activation_bytes_per_layer(llama, unfused) == sbh * (8 + 24) + 2 * scores
    assert activation_bytes_per_layer(gpt, unfused) == sbh * (10 + 24) + 5 * scores
    assert not MODELS["llama3-8b"].dropout and MODELS["gpt3-175b"].dropout


def test_cli_no_dropout_shrinks_the_activations(tmp_path: Path) -> None:
    base = ["plan", "--model", "gpt3-175b", "--global-batch", "64", "--tp", "8", "--pp", "8", "--nodes", "8",
            "--cluster", "dgx-h100"]  # fmt: skip
    memory = {}
    for flag in ("--dropout", "--no-dropout"):
        out = tmp_path / f"{flag}.json"
        result = CliRunner().invoke(app, [*base, flag, "--json", str(out)])
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert data["details"]["model"]["dropout"] is (flag == "--dropout")
        memory[flag] = data["memory"]["activations_GiB"]
    # the first stage's layers, TP 8 without SP: (8 + 24 / 8) s b h a layer instead of (10 + 24 / 8)
    assert memory["--no-dropout"] == pytest.approx(memory["--dropout"] * 11 / 13)


def test_op_recompute_reruns_every_second_matmul_and_the_tp_all_gathers() -> None:
    """torchtitan's policy saves every mm output but the 2nd, 4th and 6th of a block (K, the output
    projection, w3), the attention and the reduce-scatters; all-gathers and elementwise ops rerun."""
    h, kv, f, tokens = MODEL.hidden, MODEL.kv_hidden, MODEL.ffn_hidden, 1000
    assert MODEL.op_recomputed() == [(h, kv), (h, h), (h, f)]
    assert MODEL.recompute_flops(tokens, "op") == 2 * tokens * (h * kv + h * h + h * f)
    assert MODEL.step_flops(8, "op") > MODEL.step_flops(8, "none")
    tp = {r: work(MODEL, Training(8, tp=4, sequence_parallel=True, recompute=r), H100, 2) for r in SEARCHED}
    op = work(MODEL, Training(8, tp=4, sequence_parallel=True, recompute="op"), H100, 2)
    layers = MODEL.layers
    assert (tp["none"].tp_backward, op.tp_backward, tp["full"].tp_backward) == (
        2 * layers,
        3 * layers,
        4 * layers,
    )
    forward, back_op, _ = layer_times(MODEL, Training(8, recompute="op"), H100)
    _, back_none, attention = layer_times(MODEL, Training(8), H100)
    assert 0 < back_op - back_none < forward - attention  # part of the forward, not the attention core


def test_op_recompute_stores_what_the_save_list_keeps() -> None:
    sbh, t = 2048 * 2 * MODEL.hidden, 4
    tokens = sbh // MODEL.hidden
    run = Training(8, 2, tp=t, sequence_parallel=True, recompute="op")
    h, kv, f, a = MODEL.hidden, MODEL.kv_hidden, MODEL.ffn_hidden, MODEL.heads
    # the input (SP: 1/t), Q, V and w1 (column-parallel: 1/t), w2's partial sums (full width), the
    # attention output and fp32 log-sum-exp, and the two reduce-scatters' outputs
    saved = (
        2 * sbh / t
        + 2 * tokens * (h / t + kv / t + f / t + h)
        + 2 * sbh / t
        + 4 * tokens * a / t
        + 4 * sbh / t
    )
    assert activation_bytes_per_layer(MODEL, run) == pytest.approx(saved)
    assert activation_bytes_per_layer(MODEL, run) < activation_bytes_per_layer(
        MODEL, Training(8, 2, tp=t, sequence_parallel=True, recompute="selective")
    )


def test_search_tries_megatrons_three_recompute_modes_only() -> None:
    found = {
        r.recompute
        for group in candidates(MODEL, 8, Cluster(1, 8, Link("a", 0, 1), Link("b", 0, 1)), "bf16", SEARCHED)
        for r in group
    }
    assert found == set(SEARCHED) and "op" not in found


def test_dots_recompute_reruns_the_mlp_input_projections_and_the_attention() -> None:
    """MaxText's save_dot_except_mlpwi saves the Q, K, V, output-projection and down-projection
    outputs ("query_proj", "value_proj", "key_proj", "out_proj", "mlpwo"); the MLP's input
    projections (w1, w3), the attention and the elementwise ops rerun."""
    h, kv, f, tokens = MODEL.hidden, MODEL.kv_hidden, MODEL.ffn_hidden, 1000
    assert MODEL.dots_recomputed() == [(h, f), (h, f)]
    assert MODEL.recompute_flops(tokens, "dots") == 2 * tokens * 2 * h * f + MODEL.attention_flops(tokens)
    forward, back_dots, attention = layer_times(MODEL, Training(8, recompute="dots"), H100)
    _, back_none, _ = layer_times(MODEL, Training(8), H100)
    _, back_full, _ = layer_times(MODEL, Training(8, recompute="full"), H100)
    assert attention < back_dots - back_none < back_full - back_none == pytest.approx(forward)
    sbh = 2048 * 2 * h
    stored = activation_bytes_per_layer(MODEL, Training(8, 2, recompute="dots"))
    assert stored == pytest.approx((8 + 4 * kv / h) * sbh)  # the input, Q, K, V and two h-wide outputs
    full, none = (activation_bytes_per_layer(MODEL, Training(8, 2, recompute=r)) for r in ("full", "none"))
    assert full < stored < none
    sp = {
        r: work(MODEL, Training(8, tp=4, sequence_parallel=True, recompute=r), H100, 2)
        for r in ("none", "dots")
    }
    assert sp["dots"].tp_backward == 2 * MODEL.layers + round(
        0.5 * MODEL.layers
    )  # the MLP input's all-gather
