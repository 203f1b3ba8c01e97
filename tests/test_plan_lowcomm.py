"""The planner's low-communication methods (ringtree.sim.lowcomm, `ringtree plan --sync`): each
price in closed form, PowerSGD's split of a model as torch's hook makes it, the bandwidth sweep,
the CLI's tables and JSON, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from benchmark_scripts import load
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.json_keys import OUTPUTS
from ringtree.sim.lowcomm import (
    Model,
    SyncMethod,
    bandwidth_for,
    outer_sync_s,
    powersgd_payload,
    price,
    replica_cluster,
    slow_link_bytes,
)
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.param_shapes import encoder_shapes, transformer_shapes
from ringtree.sim.training.plan import StepConfig, buckets, collective_s, predict_step
from ringtree.sim.training.transformer import MODELS

runner = CliRunner()
ETH = Link("eth", 20e-6, 1.25e9)
# three nodes of one device each: every all-reduce crosses the slow link, none runs inside a node
NODES3 = Cluster(3, 1, Link("pcie", 2e-6, 16e9), ETH)
CONFIG = StepConfig(10_000_000, 0.2)  # 40 MB of fp32 gradients, 0.2 s of compute
MODEL = Model(CONFIG.params, 4, CONFIG.bucket_mb)
SEED = ["plan", "--model", "vit-base", "--grad-dtype", "fp16", "--compute-time", "0.4", "--nodes", "3",
        "--gpus-per-node", "8", "--intra", "pcie-gen3", "--inter", "eth-10g"]  # fmt: skip


def _step(cluster: Cluster) -> object:
    return predict_step(CONFIG, cluster, "ring")


def _price(cluster: Cluster = NODES3, **words: object) -> object:
    return price(SyncMethod(**words), MODEL, cluster, "ring", _step)  # type: ignore[arg-type]


def test_ddp_is_the_planners_step_and_sends_the_all_reduces_lower_bound() -> None:
    ddp, world = _price(sync="ddp"), predict_step(CONFIG, NODES3, "ring")
    assert ddp.step_s == world.step_s and ddp.compute_utilisation == pytest.approx(0.2 / world.step_s)
    assert ddp.slow_link_bytes_per_step == pytest.approx(2 * 2 / 3 * 40e6)


def test_diloco_sends_ddps_bytes_over_h_and_adds_one_sync_per_h_steps() -> None:
    ddp = _price(sync="ddp")
    for h in (1, 10, 100):
        diloco = _price(sync="diloco", inner_steps=h)
        assert diloco.slow_link_bytes_per_step == pytest.approx(ddp.slow_link_bytes_per_step / h)
        assert diloco.peak_sync_bytes == pytest.approx(ddp.peak_sync_bytes)
        # one rank per replica: the outer all-reduce is the world's all-reduce of the model, bucketed
        sync = sum(collective_s("all_reduce", "ring", NODES3, b, 4) for b in buckets(40_000_000, 4, 25.0))
        assert diloco.outer_sync_s == pytest.approx(sync)
        assert diloco.inner_step_s == pytest.approx(0.2)  # a replica of one device: no DDP at all
        assert diloco.step_s == pytest.approx(0.2 + sync / h)
    assert (
        _price(sync="local-sgd", inner_steps=10).as_dict() | {"sync": "diloco"}
        == _price(sync="diloco", inner_steps=10).as_dict()
    )


def test_local_sgd_every_step_costs_what_ddp_costs() -> None:
    """H = 1 with one device per replica and fp32 on both wires: the parameter average moves DDP's
    bytes in DDP's buckets, so the step is DDP's (as H = 1 with inner SGD is data parallelism)."""
    ddp, every = _price(sync="ddp"), _price(sync="local-sgd", inner_steps=1)
    assert every.step_s == pytest.approx(ddp.step_s)
    assert every.slow_link_bytes_per_step == pytest.approx(ddp.slow_link_bytes_per_step)


def test_streaming_moves_one_fragment_every_h_over_f_steps_behind_t_steps() -> None:
    diloco = _price(sync="diloco", inner_steps=100)
    streaming = _price(sync="streaming-diloco", inner_steps=100, fragments=4)
    assert streaming.peak_sync_bytes == pytest.approx(diloco.peak_sync_bytes / 4)
    assert streaming.peak_bandwidth_gbps == pytest.approx(diloco.peak_bandwidth_gbps / 4)
    assert streaming.slow_link_bytes_per_step == pytest.approx(diloco.slow_link_bytes_per_step)
    one = sum(collective_s("all_reduce", "ring", NODES3, b, 4) for b in buckets(10_000_000, 4, 25.0))
    assert streaming.outer_sync_s == pytest.approx(one)
    assert streaming.step_s == pytest.approx(0.2 + one / 25)
    slow = Cluster(3, 1, NODES3.intra, Link("slow", 20e-6, 20e6))  # a fragment takes ~0.67 s: beyond one step
    behind = price(SyncMethod("streaming-diloco", fragments=4, overlap_steps=2), MODEL, slow, "ring", _step)
    assert behind.outer_sync_s > 0.4
    assert behind.outer_comm_exposed_s == pytest.approx((behind.outer_sync_s - 2 * 0.2) / 25)
    assert behind.peak_bandwidth_gbps == pytest.approx(behind.peak_sync_bytes * 8 / (2 * 0.2) / 1e9)
    hidden = price(SyncMethod("streaming-diloco", fragments=4, overlap_steps=4), MODEL, slow, "ring", _step)
    assert hidden.outer_comm_exposed_s == 0 and hidden.step_s == pytest.approx(0.2)


@pytest.mark.parametrize(("dtype", "size"), [("fp32", 4.0), ("bf16", 2.0), ("fp8", 1.0), ("int8", 1.0),
                                             ("int4", 0.5)])  # fmt: skip
def test_outer_dtype_bytes_with_their_scales(dtype: str, size: float) -> None:
    scales = 4 * math.ceil(1000 / 128) if size < 2 else 0
    assert SyncMethod("diloco", outer_dtype=dtype).outer_bytes(1000) == 1000 * size + scales
    fp32 = _price(sync="diloco", inner_steps=10)
    quantised = _price(sync="diloco", inner_steps=10, outer_dtype=dtype)
    ratio = quantised.slow_link_bytes_per_step / fp32.slow_link_bytes_per_step
    assert ratio == pytest.approx((size + (4 / 128 if size < 2 else 0)) / 4, rel=1e-3)


SHAPES = [(64, 32), (32,), (16, 16), (4, 4), (3, 8, 5, 5), (1000, 1), (256, 512)]


def test_powersgd_compresses_what_torchs_hook_compresses() -> None:
    """Each tensor's fate (compressed or sent whole) is torch's `_should_compress`'s, and a compressed
    one sends P (n x r) and Q (m x r)."""
    for rank in (1, 2, 4):
        plain, p, q = powersgd_payload(SHAPES, rank, 2.0)
        want_plain = want_p = want_q = 0
        for shape in SHAPES:
            n, m = shape[0], math.prod(shape[1:])
            if len(shape) > 1 and _should_compress(n, m, rank, 2.0)[0]:
                want_p, want_q = want_p + n * rank, want_q + m * rank
            else:
                want_plain += n * m
        assert (plain, p, q) == (want_plain, want_p, want_q)
    # by hand at rank 2: 64x32, 16x16 ((16 + 16) x 2 x 2 = 128 < 256) and 256x512 compressed; 4x4
    # (32 >= 16), 3x200 (812 >= 600) and the vectors whole
    assert powersgd_payload(SHAPES, 2, 2.0) == (
        32 + 16 + 600 + 1000,
        2 * (64 + 16 + 256),
        2 * (32 + 16 + 512),
    )


def test_powersgd_prices_three_all_reduces_per_bucket_one_after_another() -> None:
    shapes = ((256, 512), (512,), (512, 256))
    model = Model(sum(math.prod(s) for s in shapes), 4, 25.0, shapes)
    config = StepConfig(model.params, 0.2)
    got = price(SyncMethod("powersgd", powersgd_rank=4), model, NODES3, "ring",
                lambda c: predict_step(config, c, "ring"))  # fmt: skip
    plain, p, q = powersgd_payload(shapes, 4, 2.0)
    want = sum(collective_s("all_reduce", "ring", NODES3, n * 4, 4) for n in (plain, p, q))
    assert got.step_s == pytest.approx(0.2 + want) and got.dp_comm_s == pytest.approx(want)
    assert got.slow_link_bytes_per_step == pytest.approx(slow_link_bytes((plain + p + q) * 4, 3, NODES3))
    # on a device of 1 TB/s, torch's hook's 11 passes over the two compressed matrices (the vector
    # travels whole)
    fast = dataclasses.replace(model, hbm_Bps=1e12)
    passes = price(SyncMethod("powersgd", powersgd_rank=4), fast, NODES3, "ring",
                   lambda c: predict_step(config, c, "ring"))  # fmt: skip
    assert passes.step_s == pytest.approx(got.step_s + 11 * 2 * 256 * 512 * 4 / 1e12)


def test_the_models_shapes_add_up_to_its_parameters() -> None:
    for name in ("gpt3-175b", "llama3-8b", "mixtral-8x7b", "deepseek-v3"):
        assert sum(math.prod(s) for s in transformer_shapes(MODELS[name])) == MODELS[name].params
    assert sum(math.prod(s) for s in encoder_shapes(86_000_000, 12, 768)) == pytest.approx(86e6, abs=768)


def test_replica_groups_hold_whole_nodes_or_split_one_evenly() -> None:
    eight = Cluster(4, 8, NODES3.intra, ETH)
    assert (replica_cluster(eight, 2, 1).nodes, replica_cluster(eight, 2, 1).gpus_per_node) == (2, 8)
    assert (replica_cluster(eight, 8, 1).nodes, replica_cluster(eight, 8, 1).gpus_per_node) == (1, 4)
    with pytest.raises(ValueError, match="--replicas 3 must divide the 4 nodes"):
        replica_cluster(eight, 3, 1)
    with pytest.raises(ValueError, match="cut a tp x cp x pp = 8 model copy"):
        replica_cluster(eight, 8, 8)


def test_the_outer_sync_shards_over_the_groups_ranks_sharing_the_nodes_nic() -> None:
    """Eight ranks per replica each all-reduce 1/8 of the model with their peers, the node's NIC
    shared eight ways, then all-gather it inside the node."""
    eight = Cluster(3, 8, Link("nvlink", 1e-6, 100e9), ETH)
    group = replica_cluster(eight, 3, 1)
    shard_group = Cluster(3, 1, eight.intra, Link("eth", 20e-6, 1.25e9 / 8))
    want = sum(collective_s("all_reduce", "ring", shard_group, b, 4) for b in buckets(5_000_000, 4, 25.0))
    want += collective_s("all_gather", "ring", Cluster(1, 8, eight.intra, ETH), 40_000_000, 4)
    assert outer_sync_s(40_000_000, 4, MODEL, eight, group, "ring") == pytest.approx(want)


def test_the_sweep_finds_the_bandwidth_each_utilisation_needs() -> None:
    for target in (0.5, 0.9):
        gbps = bandwidth_for(target, SyncMethod("ddp"), MODEL, NODES3, "ring", _step)
        assert gbps is not None
        at = Cluster(3, 1, NODES3.intra, Link("eth", ETH.alpha_s, gbps * 1e9 / 8))
        below = Cluster(3, 1, NODES3.intra, Link("eth", ETH.alpha_s, gbps * 0.99 * 1e9 / 8))
        assert (
            _price(at, sync="ddp").compute_utilisation
            >= target
            > _price(below, sync="ddp").compute_utilisation
        )
    # H = 99 at 99% makes the outer sync 1/99 of a step, as DDP's all-reduce is one step at 50%: the
    # same all-reduces, so the same bandwidth (Streaming DiLoCo's table 4 shows DiLoCo at 99% = DP at 50%)
    dp = bandwidth_for(0.5, SyncMethod("ddp"), MODEL, NODES3, "ring", _step)
    diloco = bandwidth_for(0.99, SyncMethod("diloco", inner_steps=99), MODEL, NODES3, "ring", _step)
    assert dp is not None and diloco == pytest.approx(dp, rel=2e-3)


def test_streaming_diloco_table_4s_diloco_column_is_half_the_planners_at_99_percent() -> None:
    """docs/results/lowcomm-planner.md: the paper's sync moves (M-1)/M of the payload where the
    all-reduce sends 2(M-1)/M, so the planner's DiLoCo needs twice its bandwidth at 99%."""
    table4 = load("lowcomm_table4")
    params, layers, seconds = table4.MODELS["1B"]
    config = StepConfig(params, seconds, "bf16", overlap=True)
    model = Model(params, 2, config.bucket_mb)
    method = table4.methods(layers)["DiLoCo"]
    ours = bandwidth_for(
        0.99, method, model, table4.CLUSTER, "ring", lambda c: predict_step(config, c, "ring")
    )
    assert ours is not None and 1.9 < ours / table4.PAPER["1B"]["DiLoCo"][-1] < 2.1
    assert [table4.fragments(n) for n in (24, 48, 108)] == [10, 20, 25]


def test_the_seeds_example_recommends_diloco_with_the_caveat(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = runner.invoke(app, [*SEED, "--sync", "diloco", "--inner-steps", "100", "--json", str(out)],
                           env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    text = re.sub(r"\s+", " ", result.output)
    assert "sync: diloco over the all-reduce" in text and "convergence is not priced" in text
    data = json.loads(out.read_text())
    assert data["sync"]["sync"] == "diloco" and data["sync"]["inner_steps"] == 100
    assert data["sync"]["samples_per_s"] > 1.3 * data["syncs"][0]["samples_per_s"]
    assert data["sync_model"].startswith("data-parallel formula")
    assert [r["sync"] for r in data["syncs"]] == [
        "ddp",
        "powersgd",
        "local-sgd",
        "diloco",
        "streaming-diloco",
    ]
    step = {k for k in OUTPUTS["plan"].keys if "." not in k}
    plain = step | set(OUTPUTS["plan-dp"].keys) - {"pipeline", "tensor_parallel"}
    documented = {k for k in OUTPUTS["plan-sync"].keys if not k.startswith(("sync.", "sweep"))}
    assert set(data) == plain | documented - {"syncs[]." + k for k in data["sync"]}
    assert {f"sync.{k}" for k in data["sync"]} == {
        k for k in OUTPUTS["plan-sync"].keys if k.startswith("sync.")
    }
    assert {f"syncs[].{k}" for k in data["syncs"][0]} == {
        k for k in OUTPUTS["plan-sync"].keys if k.startswith("syncs[].")
    }


def test_the_transformer_planner_prices_the_methods_and_sweeps(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-1.3b", "--global-batch", "512", "--nodes", "4", "--cluster", "dgx-h100",
            "--inter", "eth-10g", "--nics-per-node", "1", "--sync", "streaming-diloco", "--fragments", "4",
            "--overlap-steps", "1", "--outer-dtype", "fp8", "--sweep", "bandwidth",
            "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["sync_model"].startswith("transformer") and data["sync"]["fragments"] == 4
    assert data["algorithm"] == "native" and data["sweep_algorithm"] == "hierarchical"
    top = {k for k in [*OUTPUTS["plan"].keys, *OUTPUTS["plan-sync"].keys] if "." not in k and "[]" not in k}
    assert set(data) == top
    diloco = next(r for r in data["syncs"] if r["sync"] == "diloco")
    assert data["sync"]["peak_sync_bytes"] == pytest.approx(diloco["peak_sync_bytes"] / 4, rel=1e-6)
    assert {f"sweep[].{k}" for k in data["sweep"][0]} == {
        k for k in OUTPUTS["plan-sync"].keys if k.startswith("sweep[].")
    }
    assert list(data["sweep"][0]["gbps"]) == ["50%", "80%", "90%", "95%", "99%"]
    ddp_50 = data["sweep"][0]["gbps"]["50%"]
    assert ddp_50 is not None and all(
        g is None or g < ddp_50 for row in data["sweep"][2:] for g in list(row["gbps"].values())[:1]
    )


def _one_sentence(output: str) -> str:
    lines = [line.strip(" │╭╮╰╯─") for line in output.splitlines() if line.startswith("│")]
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


BAD = [
    (["--sync", "gossip"], "unknown --sync 'gossip'"),
    (["--sync", "diloco", "--inner-steps", "0"], "--inner-steps must be at least 1"),
    (["--sync", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
    (["--sync", "diloco", "--replicas", "2"], "--replicas 2 must divide the 3 nodes"),
    (["--sync", "diloco", "--nodes", "1"], "need at least 2 replica groups, got 1 (default: one per node)"),
    (["--sync", "diloco", "--outer-dtype", "fp6"], "unknown --outer-dtype 'fp6'"),
    (["--sync", "streaming-diloco", "--fragments", "3"], "--fragments 3 must be at least 1 and divide"),
    (["--sync", "streaming-diloco", "--fragments", "4", "--overlap-steps", "25"],
     "--overlap-steps 25 must be at least 0 and below --inner-steps / --fragments = 25"),
    (["--sync", "diloco", "--fragments", "4"], "--fragments do not apply with --sync diloco"),
    (["--powersgd-rank", "4"], "--powersgd-rank do not apply with --sync ddp"),
    (["--sync", "diloco", "--powersgd-compute-time", "0.01"], "--powersgd-compute-time do not apply"),
    (["--sync", "powersgd", "--powersgd-compute-time", "-0.01"], "--powersgd-compute-time -0.01: give"),
    (["--sync", "ddp", "--sweep", "latency"], "unknown --sweep 'latency'"),
    (["--sync", "ddp", "--sweep", "bandwidth", "--nodes", "1"], "--sweep bandwidth varies the link between"),
    (["--sync", "streaming-diloco", "--fragments", "20"],
     "--fragments 20 is more than the model's 12 layers"),
    (["--sync", "powersgd", "--shape", "12,768"], "--shape '12,768': write it as LAYERS,HIDDEN,SEQ"),
    (["--sync", "powersgd", "--model", "resnet50"], "--sync powersgd needs the model's tensor shapes"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "fragment"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_sync_words_exit_2_naming_the_flag(tmp_path: Path, extra: list[str], fragment: str) -> None:
    args = [*SEED, *extra]
    if "--nodes" in extra:
        args = [a for a in SEED if a not in ("--nodes", "3")] + extra
    if "--model" in extra:
        args = [a for a in args[:2] + args[4:]]
    result = runner.invoke(app, [*args, "--json", str(tmp_path / "plan.json")])
    assert result.exit_code == 2, result.output
    assert fragment in _one_sentence(result.output) and "Traceback" not in result.output
    assert not (tmp_path / "plan.json").exists() and "ringtree plan:" not in result.output  # refused first


TRANSFORMER_BAD = [
    (["--pp", "2", "--sync", "streaming-diloco", "--fragments", "5"],
     "--fragments 5 must be a multiple of --pp 2, so that each fragment lies in one pipeline stage"),
    (["--zero", "1", "--sync", "powersgd"],
     "--sync powersgd compresses DDP's all-reduce: drop --tp, --pp and --zero"),
    (["--tp", "8", "--nodes", "3", "--sync", "diloco", "--replicas", "6"],
     "--replicas 6 gives groups of 4 ranks, which cut a tp x cp x pp = 8 model copy"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "fragment"), TRANSFORMER_BAD, ids=[" ".join(a) for a, _ in TRANSFORMER_BAD]
)
def test_bad_sync_words_for_the_transformer_exit_2(extra: list[str], fragment: str) -> None:
    args = ["plan", "--model", "gpt-1.3b", "--global-batch", "64", "--cluster", "dgx-h100"]
    args += [] if "--nodes" in extra else ["--nodes", "2"]
    result = runner.invoke(app, [*args, *extra])
    assert result.exit_code == 2, result.output
    assert fragment in _one_sentence(result.output) and "Traceback" not in result.output


def test_sync_with_a_run_or_a_search_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"parameters": 1000, "step_time_s": 0.1}))
    result = runner.invoke(app, ["plan", "--from-run", str(run), "--sync", "diloco"])
    assert result.exit_code == 2 and "--sync do not apply with --from-run" in _one_sentence(result.output)
    result = runner.invoke(app, ["plan", "--from-run", str(run), "--inner-steps", "5"])
    assert result.exit_code == 2 and "--inner-steps do not apply with --from-run" in _one_sentence(
        result.output
    )
    args = ["plan", "--model", "gpt-1.3b", "--global-batch", "32", "--cluster", "dgx-h100", "--nodes", "2"]
    args.append("--search")
    result = runner.invoke(app, [*args, "--sync", "diloco"])
    assert result.exit_code == 2 and "--sync price one layout" in _one_sentence(result.output)


def test_powersgd_on_a_module_prices_its_own_tensors(tmp_path: Path) -> None:
    """--module gives PowerSGD the module's real matrices: the mlp's three weights travel as P and Q
    of rank 4 ([128,64]: 768, [128,128]: 1024, [10,128]: 552 numbers), its biases (266) whole."""
    out = tmp_path / "plan.json"
    args = ["plan", "--module", "ringtree.train.models:MLP", "--compute-time", "0.002", "--nodes", "3"]
    args += ["--gpus-per-node", "1", "--intra", "pcie-gen3", "--inter", "bw=12MB/s,lat=100us"]
    result = runner.invoke(app, [*args, "--sync", "powersgd", "--powersgd-rank", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    sync = json.loads(out.read_text())["sync"]
    assert sync["slow_link_bytes_per_step"] == pytest.approx(2 * 2 / 3 * 4 * (768 + 1024 + 552 + 266))


# a one-node, two-rank `ringtree train --json` summary of the mlp-tiny (its keys as train writes them)
RUN = {"step_time_s": 0.0075, "exposed_comm_time_s": 0.0008, "world_size": 2, "nodes": 1,
       "parameters": 1482, "steps": 23, "sync": "ddp", "replicas": 1, "inner_steps": 1,
       "outer_syncs": None, "outer_comm_exposed_s": None, "model": "mlp-tiny", "mode": "ddp",
       "algorithm": "ring", "bucket_mb": 25.0, "compression": None, "overlap": True,
       "batch_size": 32, "accumulate": 1, "zero": 0}  # fmt: skip
FROM_RUN = ["--nodes", "3", "--gpus-per-node", "2", "--intra", "pcie-gen3", "--inter", "eth-1g"]


def _from_run(tmp_path: Path, summary: dict[str, object], *extra: str) -> tuple[object, dict[str, object]]:
    run, out = tmp_path / "run.json", tmp_path / "plan.json"
    run.write_text(json.dumps(summary))
    result = runner.invoke(app, ["plan", "--from-run", str(run), *FROM_RUN, *extra, "--json", str(out)])
    return result, json.loads(out.read_text()) if result.exit_code == 0 else {}


def test_a_powersgd_run_is_priced_as_it_ran(tmp_path: Path) -> None:
    """--compression powersgd: the run's rank on its model's own matrices (rebuilt from its name);
    the step line stays DDP's, fp32 gradients."""
    run = RUN | {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_iter": 1000}
    result, plan = _from_run(tmp_path, run)
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    sync = plan["sync"]
    assert isinstance(sync, dict) and (sync["sync"], sync["powersgd_rank"]) == ("powersgd", 2)
    direct = tmp_path / "direct.json"
    args = ["plan", "--module", "ringtree.train.models:_tiny", "--compute-time", str(0.0075 - 0.0008)]
    args += [*FROM_RUN, "--sync", "powersgd", "--powersgd-rank", "2", "--json", str(direct)]
    assert runner.invoke(app, args).exit_code == 0
    bytes_per_step = json.loads(direct.read_text())["sync"]["slow_link_bytes_per_step"]
    assert sync["slow_link_bytes_per_step"] == pytest.approx(bytes_per_step)
    assert "before PowerSGD's start iteration 1000" in result.output  # type: ignore[attr-defined]


def test_powersgds_measured_work_adds_to_its_step_and_a_runs_own_is_used(tmp_path: Path) -> None:
    """--powersgd-compute-time S: S more seconds per step than without (no GPU: otherwise not
    priced); a PowerSGD run's powersgd_compute_s is priced the same way by --from-run."""
    out = tmp_path / "plan.json"
    args = ["plan", "--module", "ringtree.train.models:MLP", "--compute-time", "0.002", "--nodes", "3"]
    args += ["--gpus-per-node", "1", "--intra", "pcie-gen3", "--inter", "bw=12MB/s,lat=100us"]
    args += ["--sync", "powersgd", "--powersgd-rank", "4", "--json", str(out)]
    steps = []
    for extra in ([], ["--powersgd-compute-time", "0.0125"]):
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        steps.append(json.loads(out.read_text())["sync"]["step_s"])
    assert steps[1] - steps[0] == pytest.approx(0.0125)
    run = RUN | {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_iter": 1}
    plain = _from_run(tmp_path, run)[1]["sync"]
    timed = _from_run(tmp_path, run | {"powersgd_compute_s": 0.004})[1]["sync"]
    assert timed["step_s"] - plain["step_s"] == pytest.approx(0.004)  # type: ignore[index]


def test_a_diloco_run_is_priced_with_its_own_words(tmp_path: Path) -> None:
    """--sync diloco: H and the outer dtype from the run, one replica group per planned node; the
    outer sync's measured exposure leaves the compute (the planner prices its own)."""
    run = RUN | {"sync": "diloco", "replicas": 2, "inner_steps": 5, "outer_syncs": 5,
                 "outer_comm_exposed_s": 0.001, "outer_dtype": "int8", "outer_lr": 0.7}  # fmt: skip
    result, plan = _from_run(tmp_path, run)
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    sync = plan["sync"]
    assert isinstance(sync, dict)
    assert (sync["sync"], sync["inner_steps"], sync["outer_dtype"], sync["replicas"]) == (
        "diloco",
        5,
        "int8",
        3,
    )
    assert StepConfig.from_summary(run).compute_time_s == pytest.approx(0.0075 - 0.0008 - 0.001)
    streaming = run | {"sync": "streaming-diloco", "inner_steps": 4, "fragments": 2, "overlap_steps": 1}
    result, plan = _from_run(tmp_path, streaming, "--replicas", "6")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    sync = plan["sync"]
    assert isinstance(sync, dict) and (sync["fragments"], sync["overlap_steps"], sync["replicas"]) == (
        2,
        1,
        6,
    )


FROM_RUN_BAD = [
    ({"sync": "diloco", "inner_steps": 5, "compression": "powersgd"}, [], "does not price together"),
    ({"compression": "powersgd", "model": "Sequential"}, [], "'Sequential' cannot be rebuilt here"),
    ({"sync": "gossip"}, [], "ran --sync gossip, which the planner does not price"),
    ({}, ["--replicas", "2"], "ran --sync ddp: drop --replicas"),
]


@pytest.mark.parametrize(("words", "extra", "fragment"), FROM_RUN_BAD, ids=[f for *_, f in FROM_RUN_BAD])
def test_a_run_the_planner_cannot_price_exits_2_naming_it(
    tmp_path: Path, words: dict[str, object], extra: list[str], fragment: str
) -> None:
    result, _ = _from_run(tmp_path, RUN | words, *extra)
    assert result.exit_code == 2, result.output  # type: ignore[attr-defined]
    assert fragment in _one_sentence(result.output)  # type: ignore[attr-defined]
    # the file named (rich may wrap a long path mid-word: compared without the white space)
    assert str(tmp_path / "run.json") in "".join(_one_sentence(result.output).split())  # type: ignore[attr-defined]
