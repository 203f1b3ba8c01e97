"""The planner prices the zero-bubble schedules: the replayed bubble against the published formulas,
W's share from a layer's matmuls, memory from each schedule's activations in flight, the search's
candidates, and bad input. No processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.schedules.pipeline import ZERO_BUBBLE, build
from ringtree.schedules.pipeline_verify import peak_bound, peak_in_flight
from ringtree.sim.network.clusters import get
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import in_flight, stages
from ringtree.sim.training.pipeline import bubble_formula_s
from ringtree.sim.training.plan import Layout, StepWork, predict, predict_pipeline
from ringtree.sim.training.predictor import weight_fraction
from ringtree.sim.training.search import candidates
from ringtree.sim.training.transformer import MODELS, Transformer

runner = CliRunner()
H100 = get("dgx-h100")
SMALL = Transformer(8, 1024, 16, 2048, 32000, kv_heads=4, ffn_hidden=2816, mlp="swiglu")
FREE = Link("free", 0.0, 1e30)


def _bubble(schedule: str, p: int, m: int, f: float, b: float, w: float, fast: bool = False) -> float:
    """The planner's pipeline bubble for a stage forward f, B b and W w (a backward b + w)."""
    work = StepWork(f, b + w, m, 0, 2, weight_fraction=w / (b + w))
    return predict(work, Cluster(1, p, FREE, FREE), "ring", Layout(pp=p, schedule=schedule), fast).pp_bubble_s


@pytest.mark.parametrize(
    ("f", "b", "w"), [(0.1, 0.1, 0.1), (0.1, 0.12, 0.08), (0.1, 0.15, 0.05), (0.15, 0.1, 0.1)]
)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_the_planners_bubble_is_the_published_formula(schedule: str, f: float, b: float, w: float) -> None:
    """Qi et al. 2024, Table 2, with the schedule simulated on those F, B and W (ZB-H2: one
    synchronous step keeps the (p-1) F fill); the closed form the search ranks by says the same."""
    p, m = 4, 12
    formula = bubble_formula_s(schedule, p, f, b, w)
    assert _bubble(schedule, p, m, f, b, w) == pytest.approx(formula)
    if schedule != "1f1b":
        assert _bubble(schedule, p, m, f, b, w, fast=True) == pytest.approx(formula)
        assert _bubble(schedule, p, m, f, b, w) < _bubble("1f1b", p, m, f, b, w)


def test_zb_v_leaves_only_the_fill_at_equal_times_and_the_v_schedules_beat_zb_h1() -> None:
    p, m, t = 4, 8, 0.1
    assert _bubble("zb-v", p, m, t, t, t) == pytest.approx((p - 1) * t / 2)
    f, b, w = 0.1, 0.12, 0.08
    assert _bubble("zb-v", p, m, f, b, w) < _bubble("zb-h1", p, m, f, b, w)
    assert _bubble("dualpipev", p, m, f, b, w) < _bubble("zb-h1", p, m, f, b, w)
    assert _bubble("dualpipev", p, m, f, b, w) <= bubble_formula_s("dualpipev", p, f, b, w)  # DeepSeek's


def test_the_dense_planners_pipeline_takes_w_as_a_third_of_the_backward() -> None:
    rows = {s: predict_pipeline(s, 4, 8, 1.0, FREE) for s in ("1f1b", *ZERO_BUBBLE)}
    for s in ("1f1b", "zb-h1", "zb-h2"):
        assert rows[s]["bubble_fraction"] == pytest.approx(rows[s]["theoretical_bubble_fraction"])
    # forward 1/3, B 4/9, W 2/9 of a micro-step: ZB-H1 idles (p-1)(F+B-W) = 3 x 5/9
    assert rows["zb-h1"]["bubble_fraction"] == pytest.approx(15 / 9 / (8 + 15 / 9))
    fractions = [float(rows[s]["bubble_fraction"]) for s in ("1f1b", "zb-h1", "zb-v")]
    assert fractions == sorted(fractions, reverse=True)


def test_w_is_about_a_third_of_a_transformer_layers_backward() -> None:
    """W is the layer's forward matmuls over its backward (recompute included): a third to a half."""
    share = weight_fraction(MODELS["llama3-8b"], Training(64), H100.gpu)
    assert 0.3 < share < 0.5
    full = weight_fraction(MODELS["llama3-8b"], Training(64, recompute="full"), H100.gpu)
    assert full < share  # the recomputed forward belongs to B


@pytest.mark.parametrize(
    ("schedule", "held"), [("1f1b", 4.0), ("zb-h1", 4.0), ("zb-h2", 7.0), ("zb-v", 4.0), ("dualpipev", 4.5)]
)
def test_memory_follows_each_schedules_activations_in_flight(schedule: str, held: float) -> None:
    p, m = 4, 8
    run = Training(64, pp=p, schedule=schedule)
    assert in_flight(run, m, 0) == held  # stage 0, in whole stages' micro-batches
    s, chunks = build(schedule, p, m), 2 if schedule in ("zb-v", "dualpipev") else 1
    assert max(peak_in_flight(s, j) for j in range(p)) == peak_bound(schedule, p, m) == held * chunks
    if schedule in ZERO_BUBBLE:  # every stage alike: the last holds as much as the first
        assert in_flight(run, m, p - 1) == held
        acts = [st.activations for st in stages(SMALL, run, m, 1)]
        ref = [st.activations for st in stages(SMALL, Training(64, pp=p), m, 1)]
        assert acts[0] == pytest.approx(ref[0] * held / 4)


def test_the_search_considers_the_zero_bubble_schedules() -> None:
    found = {
        group[0].schedule
        for group in candidates(SMALL, 64, Cluster(2, 8, H100.intra, H100.inter), "bf16", ("none",))
        if group[0].pp > 1
    }
    assert found == {"1f1b", *ZERO_BUBBLE}


def test_too_few_micro_batches_or_layers_are_refused() -> None:
    words = (
        "--schedule zb-v on --pp 4 needs at least 8 micro-batches per pipeline, got 4 (--global-batch 16 / "
        "(dp 4 x --micro-batch 1)); use --global-batch 32"
    )
    with pytest.raises(ValueError, match=re.escape(words)):
        check(SMALL, Training(16, pp=4, schedule="zb-v"), 16)  # dp 4: m = 4
    tiny = Transformer(6, 1024, 16, 2048, 32000)
    with pytest.raises(ValueError, match=re.escape("cuts the model into 8 chunks, but it has 6 layers")):
        check(tiny, Training(64, pp=4, schedule="dualpipev"), 16)
    assert check(SMALL, Training(128, pp=4, schedule="zb-v"), 16) == 4


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--pp", "4", "--schedule", "zb-v", "--global-batch", "16"], "use --global-batch 32"),
        (["--pp", "4", "--schedule", "zb-h1", "--global-batch", "8"], "use --global-batch 16"),
        (["--pp", "4", "--schedule", "dualpipev", "--layers", "6"], "6 layers; use --layers 8 or --pp 3"),
        (["--pp", "2", "--schedule", "zb-x"], "unknown --schedule 'zb-x'"),
    ],
)
def test_cli_refuses_them_with_exit_2(args: list[str], words: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    base = ["plan", "--model", "transformer", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq", "2048", "--vocab", "32000", "--global-batch", "64", "--nodes", "2",
            "--cluster", "dgx-h100", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2 and words in " ".join(result.output.replace("│", " ").split())
    assert "Traceback" not in result.output and not out.exists()


def test_plan_prices_zb_v_below_1f1b_and_shows_the_schedule(tmp_path: Path) -> None:
    steps = {}
    for schedule in ("1f1b", "zb-v"):
        out = tmp_path / f"{schedule}.json"
        args = ["plan", "--model", "llama3-8b", "--global-batch", "64", "--pp", "4", "--schedule", schedule,
                "--nodes", "2", "--cluster", "dgx-h100", "--json", str(out)]  # fmt: skip
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert f" {schedule} " in result.output
        data = json.loads(out.read_text())
        assert data["details"]["training"]["schedule"] == schedule
        steps[schedule] = data["breakdown"]["pp_bubble_s"]
    assert steps["zb-v"] < steps["1f1b"] / 2


def test_the_data_parallel_planners_pipeline_prices_them_and_refuses_too_few(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    base = ["plan", "--params", "100000000", "--compute-time", "0.1", "--pp", "4", "--cluster", "dgx-h100"]
    done = runner.invoke(app, [*base, "--schedule", "zb-h1", "--micro-batches", "8", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "(p-1)(F+B-W) with W a third of the backward" in " ".join(done.output.split())
    pipe = json.loads(out.read_text())["pipeline"]
    assert pipe["schedule"] == "zb-h1" and pipe["bubble_fraction"] < 3 / 11
    refused = runner.invoke(app, [*base, "--schedule", "dualpipev", "--micro-batches", "7"])
    assert refused.exit_code == 2 and "use --micro-batches 8" in " ".join(refused.output.split())
