"""Uneven pipeline layouts in the planner: Megatron-Core's layout strings, --first/--last-stage-layers,
their refusals, and a step priced by its heaviest stage (V = 1) or chunk (interleaved)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.clusters import get
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training import compute
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import stages
from ringtree.sim.training.plan import predict
from ringtree.sim.training.predictor import layer_times, plan, work
from ringtree.sim.training.stage_layout import Chunk, edges, expand, parse
from ringtree.sim.training.transformer import Transformer

GPU = get("dgx-h100").gpu
SMALL = Transformer(8, 1024, 16, 2048, 32000, kv_heads=4, ffn_hidden=2816, mlp="swiglu")
FREE = Link("free", 0.0, 1e30)


def test_megatron_layout_strings_unroll_as_megatron_core_reads_them() -> None:
    """DeepSeek-V3's PP 4 x VP 4 layout in Megatron-Bridge's recipes, and its H100 PP 8 x VP 4 one."""
    chunks = parse("Et*4|(t*4|)*14tmL", 61, 4, 4)
    assert len(chunks) == 16 and sum(c.layers for c in chunks) == 61
    assert chunks[0] == Chunk(0, 4, 0, True, False) and chunks[1] == Chunk(4, 4)
    assert chunks[-1] == Chunk(60, 1, 1, False, True)
    assert expand("Et|(tt|)*30mL") == ["Et", *["tt"] * 30, "mL"]
    assert expand("E,t*2|(t|)*2tL") == ["Ett", "t", "t", "tL"]


def test_first_and_last_stage_layers_write_a_layout() -> None:
    """Megatron-Core's num_layers_in_first/last_pipeline_stage: the others share the rest evenly,
    each stage's layers split evenly over its VP chunks (chunk i on stage i mod PP)."""
    assert edges(8, 4, 1, 1, 1) == "Et|ttt|ttt|tL"
    assert edges(8, 3, 1, 2, 0) == "Ett|ttt|tttL"
    assert edges(12, 2, 2, 4, 0) == "Ett|tttt|tt|ttttL"


@pytest.mark.parametrize(
    ("run", "words"),
    [
        (Training(64, pp=2, pp_layout="Et*4|t*3L"), "places 7 transformer layers (t) but the model has 8"),
        (Training(64, pp=2, pp_layout="Et*4|t*2|t*2L"), "has 3 chunks but --pp 2 x --virtual-stages 1"),
        (Training(64, pp=2, pp_layout="t*4|Et*4L"), "must hold the embedding (E) once, in its first chunk"),
        (Training(64, pp=2, pp_layout="Et*4L|t*4L"), "must hold the loss (L) once"),
        (Training(64, pp=2, pp_layout="Et*4|mt*4L"), "puts an MTP layer (m) before a transformer layer"),
        (Training(64, pp=2, pp_layout="Et*4|x*4L"), "has 'x': write it with E (embedding)"),
        (Training(64, pp=4, first_stage_layers=3), "leave 5 of the 8 layers for 3 other stages"),
        (
            Training(64, pp=2, virtual_stages=2, first_stage_layers=3, last_stage_layers=5),
            "each stage's layers (3, 5) must split evenly over its chunks",
        ),
    ],
)
def test_bad_layouts_are_refused_in_one_sentence(run: Training, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        check(SMALL, run, 16)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--pp", "2", "--pp-layout", "Et*4|t*3L"], "places 7 transformer layers (t) but the model has 8"),
        (
            ["--pp", "2", "--pp-layout", "Et*4|t*4L", "--first-stage-layers", "4"],
            "--pp-layout places every layer itself: drop --first-stage-layers",
        ),
        (["--first-stage-layers", "4"], "need --pp 2 or more"),
        (["--pp-layout", "Et*8L", "--search"], "--pp-layout do not apply with --search"),
    ],
)
def test_cli_refuses_bad_layouts_with_exit_2(args: list[str], words: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    base = ["plan", "--model", "transformer", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq", "2048", "--vocab", "32000", "--global-batch", "64", "--nodes", "2",
            "--cluster", "dgx-h100", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2 and words in " ".join(result.output.replace("│", " ").split())
    assert "Traceback" not in result.output and not out.exists()


def test_the_default_split_written_as_a_layout_changes_nothing() -> None:
    cluster = get("dgx-h100").cluster(2)
    even = plan(SMALL, Training(64, pp=2, tp=2), cluster, GPU)
    written = plan(SMALL, Training(64, pp=2, tp=2, pp_layout="Et*4|t*4L"), cluster, GPU)
    assert written.step_s == even.step_s and written.memory == even.memory
    edge = plan(SMALL, Training(64, pp=2, tp=2, first_stage_layers=4), cluster, GPU)
    assert edge.step_s == even.step_s


def test_an_uneven_step_is_priced_by_its_heaviest_stage() -> None:
    """Six layers on the first stage, two and the logits on the last (lighter: the 32,000-word
    output layer costs about three layers): each micro-batch's pace is six layers', and the first
    stage holds 6/4 of the even split's activations."""
    run = Training(64, pp=2, pp_layout="Et*6|t*2L")
    f, b, _ = layer_times(SMALL, run, GPU)
    logits = compute.logits_s(SMALL, SMALL.seq, 1, GPU, "bf16")
    assert 2 * f + logits < 6 * f
    w = work(SMALL, run, GPU, 8)
    assert w.forward_s == pytest.approx(6 * f) and w.backward_s == pytest.approx(6 * b)
    assert w.stage_forward_s == pytest.approx((6 * f, 2 * f + logits))
    even = stages(SMALL, Training(64, pp=2), 4, 8)[0].activations
    assert stages(SMALL, run, 4, 8)[0].activations == pytest.approx(1.5 * even)


def test_an_interleaved_step_is_priced_by_its_heaviest_chunk() -> None:
    """PP 2 x VP 2 with chunks of 5, 1, 1 and 1 + the logits layers: each stage runs V = 2 chunks as
    heavy as the first (5 layers), and the bubble is (p - 1) of that chunk's forward and backward."""
    run = Training(64, pp=2, virtual_stages=2, pp_layout="Et*5|t|t|tL")
    f, b, _ = layer_times(SMALL, run, GPU)
    w = work(SMALL, run, GPU, 1)
    assert w.stage_forward_s == pytest.approx((10 * f, 10 * f))
    assert w.stage_backward_s == pytest.approx((10 * b, 10 * b)) and w.layers == 10
    row = predict(w, Cluster(1, 2, FREE, FREE), "ring", run.layout)
    assert row.pp_bubble_s == pytest.approx(5 * (f + b))
    assert row.compute_s == pytest.approx(w.micro_batches * 10 * (f + b))


def test_an_mtp_layer_is_one_more_layer_with_its_own_logits() -> None:
    run = Training(64, pp=2, pp_layout="Et*4|t*4mL")
    f, _, _ = layer_times(SMALL, run, GPU)
    logits = compute.logits_s(SMALL, SMALL.seq, 1, GPU, "bf16")
    w = work(SMALL, run, GPU, 8)
    assert w.stage_forward_s == pytest.approx((4 * f, 5 * f + 2 * logits))
    moe = dataclasses.replace(SMALL, experts=8, top_k=2, moe_ffn_hidden=512)
    assert work(moe, run, GPU, 8).ep_forward == 2 * 5  # the MTP layer is MoE as the last layer is


def test_cli_plans_a_layout_and_says_so_in_its_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "transformer", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq", "2048", "--vocab", "32000", "--global-batch", "64", "--nodes", "2", "--pp", "2",
            "--virtual-stages", "2", "--pp-layout", "Et*3|t|(t*3|)*1tL", "--cluster", "dgx-h100",
            "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan_json = json.loads(out.read_text())
    assert plan_json["details"]["training"]["pp_layout"] == "Et*3|t|(t*3|)*1tL"
    assert plan_json["step_s"] > 0 and len(plan_json["memory"]["stages"]) == 2
