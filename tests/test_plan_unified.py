"""The unified planner: cluster presets, the transformer compute and memory model, one result for
DP x TP x PP, `plan --search`, `plan --from-run` and the explanation, and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim import INTER, INTRA, Cluster, Link
from ringtree.sim.network.clusters import CLUSTERS, get, preset_cluster
from ringtree.sim.training.explain import level_bounds, seed_derivation
from ringtree.sim.training.layout import Training
from ringtree.sim.training.memory import activation_bytes_per_layer, memory
from ringtree.sim.training.plan import (
    Layout,
    StepConfig,
    StepWork,
    predict,
    predict_pipeline,
    predict_step,
    with_run_wait,
)
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.transformer import Transformer

runner = CliRunner()
TINY = Transformer(layers=2, hidden=64, heads=4, seq=16, vocab=100)
SEED = Cluster(3, 8, INTRA["pcie-gen3"], INTER["eth-10g"])
VIT = StepConfig(86_000_000, 0.4, "fp16")


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_every_preset_is_a_whole_machine(name: str) -> None:
    preset = get(name)
    c = preset.cluster(2)
    assert c.ranks == 2 * preset.gpus_per_node and 1 <= c.nics_per_node <= preset.gpus_per_node
    assert preset.gpu.peak("fp16") > preset.gpu.peak("fp32") > 0 and preset.gpu.memory_GB >= 16
    assert preset.intra.bandwidth_Bps > preset.inter.bandwidth_Bps and preset.source


def test_presets_carry_their_datasheet_figures_and_options_override_them() -> None:
    a100 = get("dgx-a100")
    assert a100.gpu.peak("bf16") == 312e12 and a100.gpu.memory_GB == 80
    assert a100.inter.bandwidth_Bps == 25e9 and a100.nics_per_node == 8
    assert get("dgx-h100").gpu.peak("bf16") == pytest.approx(989.5e12)
    assert get("p4d.24xlarge").nics_per_node * get("p4d.24xlarge").inter.bandwidth_Bps == 50e9  # 400 Gbit/s
    seed = get("eth-10g").cluster(3)
    assert (seed.gpus_per_node, seed.intra.name, seed.inter.name) == (8, "pcie-gen3", "eth-10g")
    c = preset_cluster("dgx-a100", 2, gpus_per_node=4, inter="eth-10g")
    assert (c.gpus_per_node, c.inter.name, c.intra.name, c.nics_per_node) == (4, "eth-10g", "nvlink-a100", 4)
    with pytest.raises(ValueError, match="dgx-a100"):
        get("dgx-a1000")


def test_flops_and_params_by_hand() -> None:
    tokens = 16  # one sequence
    layer = 24 * tokens * 64**2 + 4 * tokens * 16 * 64  # 1,572,864 + 65,536
    assert TINY.layer_flops(tokens) == layer == 1_638_400
    logits = 2 * tokens * 64 * 100
    assert TINY.step_flops(1) == 3 * (2 * layer + logits)
    assert TINY.step_flops(1, "full") == 3 * (2 * layer + logits) + 2 * layer
    assert TINY.step_flops(1, "selective") == 3 * (2 * layer + logits) + 2 * 4 * tokens * 16 * 64
    assert TINY.params == pytest.approx(12 * 2 * 64 * 64 * (1 + 13 / (12 * 64) + 116 / (12 * 2 * 64)), abs=1)
    assert Transformer(96, 12288, 96, 2048, 51200).params == pytest.approx(174.6e9, rel=0.001)


def test_activation_memory_by_hand() -> None:
    """Korthikanti et al. 2022, table 2: without flash attention the scores are stored; with it not."""
    sbh = 16 * 2 * 64  # s b h with b = 2
    unfused = Training(8, 2, flash_attention=False)
    assert activation_bytes_per_layer(TINY, unfused) == sbh * (10 + 24 + 5 * 4 * 16 / 64)
    assert activation_bytes_per_layer(TINY, Training(8, 2, tp=2, recompute="selective")) == sbh * (10 + 12)
    assert activation_bytes_per_layer(TINY, Training(8, 2, tp=2, recompute="full")) == 2 * sbh
    gpu = get("dgx-a100").gpu
    m = memory(TINY, Training(32, 2, pp=2, flash_attention=False), 8, 2, gpu)  # first stage: min(p, m) = 2
    first = m["stages"][0]
    assert first["weights_grads_optimizer_GiB"] * 2**30 == pytest.approx(
        18 * (TINY.layer_params + TINY.embedding_params)  # bf16 weights, fp32 gradients, 12 of Adam
    )
    assert first["activations_GiB"] * 2**30 == pytest.approx(2 * activation_bytes_per_layer(TINY, unfused))
    assert m["fits"]
    big = memory(Transformer(96, 12288, 96, 2048, 51200), Training(8), 1, 8, gpu)
    assert not big["fits"] and big["weights_grads_optimizer_GiB"] * 2**30 > 2e12


def test_compute_runs_below_peak_for_small_shapes() -> None:
    gpu, c = get("dgx-a100").gpu, get("dgx-a100").cluster(1)
    small = plan(Transformer(4, 256, 4, 128, 1000), Training(8, 1), c, gpu)
    large = plan(Transformer(8, 8192, 64, 2048, 51200), Training(8, 1, tp=8), c, gpu)
    assert small.mfu is not None and large.mfu is not None
    assert small.mfu < 0.1 < 0.4 < large.mfu < 0.72


def test_one_result_adds_up_and_matches_the_old_planners() -> None:
    row = predict_step(VIT, SEED, "ring")
    assert row.step_s == pytest.approx(sum(row.breakdown.values()))
    assert row.step_s == pytest.approx(0.4 + row.dp_allreduce_s)
    free = Link("free", 0.0, 1e30)
    old = predict_pipeline("gpipe", 4, 8, 3.2, free)
    work = StepWork(0.1 / 3, 0.2 / 3, 8, 0, 4)
    new = predict(work, Cluster(1, 4, free, free), "ring", Layout(pp=4, schedule="gpipe"))
    assert old["pipeline_step_time_s"] == pytest.approx(new.step_s) == pytest.approx((8 + 3) * 0.1)
    assert new.pp_bubble_s == pytest.approx(3 * 0.1) and new.compute_s == pytest.approx(0.8)


def test_megatron_gpt3_175b_lands_near_the_paper() -> None:
    """Narayanan et al. 2021, table 1: 145.6B (l=80, h=12288) on 1536 A100s, t=8 p=8, 148 TFLOP/s."""
    preset = get("dgx-a100")
    model = Transformer(80, 12288, 96, 2048, 51200)
    run = Training(2304, 1, 8, 8, "fp16", "full", flash_attention=False)
    row = plan(model, run, preset.cluster(192), preset.gpu)
    assert row.hardware_tflops_per_gpu == pytest.approx(148, rel=0.15)
    assert row.memory is not None and row.memory["fits"]


def test_plan_transformer_cli_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "transformer", "--layers", "24", "--hidden", "2048", "--heads", "16",
            "--seq", "2048", "--vocab", "51200", "--global-batch", "64", "--micro-batch", "2", "--tp", "2",
            "--pp", "2", "--nodes", "1", "--cluster", "dgx-a100", "--dtype", "bf16", "--recompute",
            "selective", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["tp"], data["pp"], data["dp"], data["micro_batches"]) == (2, 2, 2, 16)
    assert data["step_s"] == pytest.approx(sum(data["breakdown"].values()))
    assert set(data["breakdown"]) == {"compute_s", "optimizer_s", "tp_comm_s", "cp_comm_s", "ep_comm_s",
                                      "pp_bubble_s",
                                      "sync_wait_s", "exposed_dp_s", "exposed_zero_gather_s"}  # fmt: skip
    assert 0 < data["mfu"] < 1 and data["memory"]["fits"]


def test_plan_warns_when_it_does_not_fit() -> None:
    args = ["plan", "--model", "gpt3-175b", "--global-batch", "8", "--nodes", "1", "--cluster", "dgx-a100"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "does not fit" in result.output


def test_plan_search_ranks_configurations_that_fit(tmp_path: Path) -> None:
    out = tmp_path / "search.json"
    args = ["plan", "--model", "gpt-1.3b", "--global-batch", "32", "--nodes", "1", "--cluster", "dgx-a100",
            "--search", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    steps = [c["step_s"] for c in data["configurations"]]
    assert steps == sorted(steps) and data["step_s"] == steps[0] and len(steps) > 5
    assert all(c["memory"]["fits"] for c in data["configurations"])
    assert data["layouts_fit"] >= len(steps) == 10 and "runner-up" in data["why"]


def test_plan_from_run_predicts_more_nodes(tmp_path: Path) -> None:
    summary = {"step_time_s": 0.42, "exposed_comm_time_s": 0.02, "parameters": 86_000_000,
               "accumulate": 1, "batch_size": 32, "compression": "fp16", "overlap": False, "bucket_mb": 25.0,
               "algorithm": "ring", "mode": "ddp", "world_size": 8, "nodes": 1}  # fmt: skip
    run, cal, out = tmp_path / "run.json", tmp_path / "machine.json", tmp_path / "plan.json"
    run.write_text(json.dumps(summary))
    fitted = {"alpha_s": 2e-6, "beta_s_per_byte": 1 / 15.75e9, "gamma_s_per_byte": 5e-12, "world_size": 8,
              "rows": 10, "rms_rel_error": 0.1, "max_rel_error": 0.2}  # fmt: skip
    cal.write_text(json.dumps(fitted))
    args = ["plan", "--from-run", str(run), "--nodes", "3", "--gpus-per-node", "8", "--calibration", str(cal),
            "--inter", "eth-10g", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["step_s"] == pytest.approx(0.4 + data["breakdown"]["sync_wait_s"] + data["dp_allreduce_s"])
    assert data["breakdown"]["sync_wait_s"] == pytest.approx(
        max(0.0, 0.02 - data["predicted_run_step_s"] + 0.4), abs=1e-9
    )
    assert data["speedup"] == pytest.approx(3 * 0.42 / data["step_s"])
    assert data["explain"]["error_bar_s"] == pytest.approx(0.1 * data["dp_allreduce_s"])
    assert data["explain"]["bottleneck"].startswith("inter")
    assert "90% scaling efficiency needs" in result.output


@pytest.mark.parametrize(("exposed", "waits"), [(0.0, False), (0.1, True)])
def test_from_run_keeps_the_runs_wait_beyond_its_own_all_reduce(exposed: float, waits: bool) -> None:
    """A 4-rank one-node run whose ranks waited 0.1 s for each other (ranks sharing cores): the
    wait is what the run exposed beyond the all-reduce predicted for its own shape; it stays in
    the plan for more nodes, ahead of the bigger all-reduce. A run that exposed less keeps none."""
    summary = {"step_time_s": 0.5 + exposed, "exposed_comm_time_s": exposed, "parameters": 1_000_000,
               "algorithm": "ring", "world_size": 4, "nodes": 1, "overlap": True}  # fmt: skip
    config = StepConfig.from_summary(summary)
    one_node = Cluster(1, 4, Link("fast", 1e-6, 10e9), Link("slow", 1e-4, 1.25e8))
    kept = with_run_wait(config, summary, one_node)
    own = predict_step(config, one_node, "ring").exposed_dp_s
    assert 0 < own < 0.1 and kept.sync_wait_s == pytest.approx(max(0.0, exposed - own))
    row = predict_step(kept, one_node.with_nodes(4), "ring")
    assert row.sync_wait_s == kept.sync_wait_s and (row.sync_wait_s > 0) == waits
    assert row.step_s == pytest.approx(sum(row.breakdown.values()))
    assert row.step_s == pytest.approx(0.5 + kept.sync_wait_s + row.dp_allreduce_s)


def test_from_run_refuses_options_it_would_ignore(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"step_time_s": 1.0, "parameters": 10, "world_size": 4, "nodes": 1}))
    args = ["plan", "--from-run", str(run), "--nodes", "3", "--intra", "pcie-gen3", "--inter", "eth-10g"]
    result = runner.invoke(app, [*args, "--overlap", "--bucket-mb", "50"])
    assert result.exit_code == 2 and "--overlap, --bucket-mb" in result.output, result.output


def test_the_seed_derivation_and_bounds() -> None:
    inter = level_bounds(VIT, SEED)[1]
    assert inter["seconds"] == pytest.approx(2 * 2 / 3 * 172e6 / 1.25e9)
    lines = seed_derivation(VIT, SEED, "ring")
    assert "0.2752 s" in lines[0] and "0.2637 s" in lines[0] and "1.88x" in lines[2]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "transformer", "--global-batch", "8", "--cluster", "dgx-a100"], "--layers"),
        (["--model", "gpt-1.3b", "--global-batch", "7", "--cluster", "dgx-a100"], "--global-batch 7"),
        (["--model", "gpt-1.3b", "--global-batch", "8"], "--cluster"),
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "dgx-a100", "--tp", "3"], "--tp 3"),
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "nope"], "dgx-a100"),
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "dgx-a100", "--recompute", "x"], "full"),
        (["--model", "vit-base", "--compute-time", "1", "--cluster", "eth-10g", "--calibration", "x.json"],
         "--calibration"),
    ],
)  # fmt: skip
def test_bad_inputs_exit_2_naming_the_fix(args: list[str], words: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2 and words in " ".join(result.output.replace("│", " ").split()), result.output


def test_from_run_refuses_a_multi_node_run(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"step_time_s": 1.0, "parameters": 10, "world_size": 16, "nodes": 2}))
    args = ["plan", "--from-run", str(run), "--nodes", "3", "--intra", "pcie-gen3", "--inter", "eth-10g"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "one-node run" in result.output


def test_sim_takes_a_cluster_preset_and_its_overrides(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    args = ["sim", "--cluster", "p4d.24xlarge", "--nodes", "2", "--bytes", "64M", "--method", "closed-form"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = json.loads(out.read_text())[0]
    assert (row["ranks"], row["gpus_per_node"]) == (16, 8) and "efa-100g" in result.output
    slow = tmp_path / "slow.json"
    assert runner.invoke(app, [*args, "--inter", "eth-10g", "--json", str(slow)]).exit_code == 0
    assert json.loads(slow.read_text())[0]["time_s"] > 5 * row["time_s"]
    bad = runner.invoke(app, ["sim", "--cluster", "dgx-a1000"])
    assert bad.exit_code == 2 and "p5.48xlarge" in bad.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "dgx-a100", "--compute-time", "1"],
         "--compute-time"),
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "dgx-a100", "--search", "--tp", "2"],
         "--tp"),
        (["--model", "gpt-1.3b", "--global-batch", "8", "--cluster", "dgx-a100", "--batch-size", "4"],
         "--batch-size"),
        (["--from-run", "run.json", "--model", "vit-base", "--intra", "pcie-gen3"], "--model"),
    ],
)  # fmt: skip
def test_options_that_would_be_ignored_are_refused(args: list[str], words: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2 and words in " ".join(result.output.replace("│", " ").split()), result.output


def test_a_preset_in_both_planners_goes_by_its_inputs() -> None:
    dp = runner.invoke(app, ["plan", "--model", "llama-7b", "--compute-time", "1", "--intra", "nvlink-a100"])
    assert dp.exit_code == 0 and "6740.0M params" in dp.output
    tf = runner.invoke(app, ["plan", "--model", "llama-7b", "--global-batch", "8", "--cluster", "dgx-a100"])
    assert tf.exit_code == 0 and "transformer" in tf.output


def test_the_error_bar_reads_residuals_levels_or_the_overall_fit(tmp_path: Path) -> None:
    from ringtree.sim.training.explain import calibration_error

    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"rms_rel_error": 0.1}))
    assert calibration_error(f) == pytest.approx(0.1)
    levels = {"intra": {"rms_rel_error": 0.05}, "inter": {"rms_rel_error": 0.2}}
    f.write_text(json.dumps({"rms_rel_error": 0.1, "levels": levels}))
    assert calibration_error(f) == pytest.approx(0.2)
    f.write_text(json.dumps({"rms_rel_error": 0.1, "residuals": [0.3, -0.4]}))
    assert calibration_error(f) == pytest.approx((0.25 / 2) ** 0.5)
    assert calibration_error(None) is None
