"""The planner's model side: GQA/SwiGLU shapes and Llama 3 presets, CP, virtual stages, sequence
parallelism and ZeRO in time and memory, per-stage memory, the search, and plan's JSON keys."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.json_keys import OUTPUTS
from ringtree.sim.network.clusters import CLUSTERS, get
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training import compute
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import GiB, memory, stages, states_bytes
from ringtree.sim.training.plan import Layout, StepWork, predict
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.search import candidates, search
from ringtree.sim.training.transformer import MODELS, Transformer

runner = CliRunner()
H100 = get("dgx-h100")
SMALL = Transformer(8, 1024, 16, 2048, 32000, kv_heads=4, ffn_hidden=2816, mlp="swiglu")
FREE = Link("free", 0.0, 1e30)


def test_llama3_presets_have_the_papers_parameter_counts() -> None:
    """Llama 3 paper, table 3: 8B, 70B, 405B (8,030,261,248 for 8B in its released config)."""
    assert MODELS["llama3-8b"].params == 8_030_261_248
    assert MODELS["llama3-70b"].params == pytest.approx(70.55e9, rel=0.002)
    assert MODELS["llama3-405b"].params == pytest.approx(405.85e9, rel=0.002)
    assert all(MODELS[m].vocab == 128_256 and MODELS[m].kv_heads == 8 for m in ("llama3-8b", "llama3-405b"))


def test_gqa_and_swiglu_flops_by_hand() -> None:
    h, kv, f = 1024, 4 * 64, 2816
    weights = 2 * h * h + 2 * h * kv + 3 * h * f
    assert SMALL.layer_weights == weights
    tokens = 2048
    assert SMALL.layer_flops(tokens) == 2 * tokens * weights + 4 * tokens * 2048 * h
    gpt = Transformer(2, 64, 4, 16, 100)
    assert gpt.layer_weights == 12 * 64 * 64 and gpt.ffn_hidden == 256 and gpt.kv_heads == 4


@pytest.mark.parametrize(
    ("run", "words"),
    [
        (Training(64, tp=3), "--tp 3 must divide --heads 16"),
        (Training(64, cp=3), "--cp 3 needs --seq 2048 to be a multiple of 2 x 3"),
        (Training(64, pp=2, virtual_stages=3), "--pp 2 x --virtual-stages 3 must divide --layers 8"),
        (Training(64, tp=4, cp=4, pp=2), "must divide the 16 GPUs"),
        (Training(63), "--global-batch 63 must be a multiple of dp 16"),
    ],
)
def test_degrees_that_do_not_divide_are_refused(run: Training, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        check(SMALL, run, 16)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--tp", "3"], "--tp 3 must divide"),
        (["--cp", "3"], "--cp 3 needs --seq"),
        (["--pp", "2", "--virtual-stages", "3"], "--virtual-stages 3 must divide --layers 8"),
        (["--sequence-parallel"], "--sequence-parallel splits activations over the TP group"),
        (["--zero", "4"], "--zero 4 is not a ZeRO stage"),
        (["--mlp", "relu"], "unknown --mlp 'relu'"),
        (["--kv-heads", "5"], "--kv-heads 5 must divide --heads 16"),
        (["--kv-heads", "0"], "--kv-heads must be at least 1"),
        (["--attention-kernel", "flash9"], "unknown --attention-kernel 'flash9'; choose fused or flash2"),
        (["--attention-kernel", "flash2", "--no-flash-attention"], "which --no-flash-attention turns off"),
        (["--attention-kernel", "flash2", "--search"], "--attention-kernel do not apply with --search"),
    ],
)
def test_cli_refuses_bad_layouts_in_one_sentence(args: list[str], words: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    base = ["plan", "--model", "transformer", "--layers", "8", "--hidden", "1024", "--heads", "16",
            "--seq", "2048", "--vocab", "32000", "--global-batch", "64", "--nodes", "2",
            "--cluster", "dgx-h100", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, base + args)
    assert result.exit_code == 2 and words in " ".join(result.output.replace("│", " ").split())
    assert "Traceback" not in result.output and not out.exists()


def test_zero_shards_exactly_its_states_over_dp() -> None:
    """ZeRO-1 divides the 12 optimizer bytes by N, ZeRO-2 the gradients too, ZeRO-3 the weights too.
    bf16 with fp32 gradients (the default) is Megatron's distributed-optimizer table: 18 bytes a
    parameter replicated, 6 + 12/d with ZeRO-1; 16-bit gradients the ZeRO paper's 16 and 4 + 12/d."""
    n, params = 16, 1e9
    zero = [states_bytes(params, Training(64, zero=z), n) for z in range(4)]
    assert zero[0] == 18 * params
    assert zero[1] == params * (6 + 12 / n)
    assert zero[2] == params * (2 + (4 + 12) / n)
    assert zero[3] == params * 16 / n  # FSDP2: fp32 sharded parameter, gradient and two moments
    half = [states_bytes(params, Training(64, zero=z, grad_dtype="bf16"), n) for z in range(4)]
    assert half == [16 * params, params * (4 + 12 / n), params * (2 + 14 / n), params * 16 / n]
    # in the planner: the sharded part of a stage's states shrinks by exactly dp x cp
    z0, z1 = (stages(SMALL, Training(64, zero=z, cp=2), 8, 8)[0] for z in (0, 1))
    assert z0.states - z1.states == pytest.approx(z0.states * 12 / 18 * (1 - 1 / 16))


def test_a_shard_group_shards_inside_it_and_reduces_across_the_groups() -> None:
    """--shard-group S (HSDP): the states are sharded over S ranks, not all of DP; each gradient bucket
    is reduce-scattered inside the group, then its 1/S shard all-reduced across the dp / S groups."""
    from ringtree.sim.training.plan import buckets, collective_s, dp_group

    slow = H100.cluster(4)  # 32 GPUs on 4 nodes
    full, hybrid = (Training(32, zero=3, shard_group=s) for s in (0, 8))
    one, two = (stages(SMALL, r, 1, 32)[0] for r in (full, hybrid))
    assert two.states == pytest.approx(states_bytes(SMALL.params, hybrid, 8) + 2 * 2 * SMALL.layer_params)
    assert one.states == pytest.approx(states_bytes(SMALL.params, full, 32) + 2 * 2 * SMALL.layer_params)
    assert hybrid.shards(32) == 8 and full.shards(32) == 32 and Training(32, zero=1, cp=2).shards(16) == 32
    row = plan(SMALL, hybrid, slow, H100.gpu, "ring")
    sizes = buckets(int(SMALL.params) * 4, 4, 25.0)  # fp32 gradients in 25 MiB buckets
    inside, across = dp_group(slow, 1, 8), dp_group(slow, 8, 4)
    assert (inside.nodes, across.nodes, across.gpus_per_node) == (1, 4, 1)
    expected = sum(
        collective_s("reduce_scatter", "ring", inside, n, 4)
        + collective_s("all_reduce", "ring", across, n // 8, 4)
        for n in sizes
    )
    assert row.dp_allreduce_s == pytest.approx(expected)
    for bad, words in (
        (dict(shard_group=8), "add --zero 1, 2 or 3"),
        (dict(zero=3, shard_group=-1), "at least 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            Training(32, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--shard-group 5 must divide the data-parallel degree 32"):
        check(SMALL, Training(32, zero=3, shard_group=5), 32)


def test_block_recompute_reruns_only_its_layers() -> None:
    """--recompute full --recompute-layers K (Megatron's block method): K layers of each stage (of
    each chunk when interleaved) rerun their forward and store only their input; the rest store all."""
    from ringtree.sim.training.predictor import layer_times, work

    gpu, model = H100.gpu, MODELS["llama3-8b"]
    none, full = Training(16, recompute="none"), Training(16, recompute="full")
    block = Training(16, recompute="full", recompute_layers=12)
    _, b_none, _ = layer_times(model, none, gpu)
    _, b_full, _ = layer_times(model, full, gpu)
    w = work(model, block, gpu, 1)
    logits = work(model, none, gpu, 1).backward_s - model.layers * b_none
    assert w.backward_s == pytest.approx(12 * b_full + 20 * b_none + logits)
    assert w.forward_s == pytest.approx(work(model, none, gpu, 1).forward_s)
    share = 12 / 32
    assert w.hardware_flops == pytest.approx(
        share * model.step_flops(16, "full") + (1 - share) * model.step_flops(16, "none")
    )
    assert Training(16, recompute="full", recompute_layers=40).mode_layers(32) == 32  # all of them
    assert Training(64, pp=4, virtual_stages=2, recompute="full", recompute_layers=2).mode_layers(8) == 4
    assert Training(16, recompute="selective").mode_layers(32) == 32  # every layer runs the mode
    acts = [stages(model, r, 1, 1)[0].activations for r in (none, block, full)]
    assert acts[2] < acts[1] < acts[0]
    kept, stored = activation(model, none), activation(model, full)  # a layer's, one micro-batch
    assert acts[1] - acts[2] == pytest.approx(20 * (kept - stored))  # 20 layers keep everything
    with pytest.raises(ValueError, match="add --recompute full"):
        Training(16, recompute="selective", recompute_layers=2)


def activation(model: Transformer, run: Training) -> float:
    from ringtree.sim.training.memory import activation_bytes_per_layer

    return activation_bytes_per_layer(model, run)


def test_sequence_parallel_moves_the_all_reduces_bytes_and_divides_norm_activations() -> None:
    cluster = H100.cluster(1)
    tp, sp = (plan(SMALL, Training(16, tp=4, sequence_parallel=s), cluster, H100.gpu) for s in (False, True))
    assert sp.tp_comm_s == pytest.approx(tp.tp_comm_s, rel=1e-9) and tp.tp_comm_s > 0
    assert sp.memory is not None and tp.memory is not None
    assert sp.memory["activations_GiB"] < tp.memory["activations_GiB"]


@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaving_divides_the_bubble_by_v(v: int) -> None:
    """Narayanan et al. 2021: the 1F1B bubble (p-1)(f+b) becomes (p-1)(f+b)/V on a free link."""
    p, m, f, b = 4, 8, 0.1, 0.2
    work = StepWork(f, b, m, 0, 2)
    row = predict(work, Cluster(1, p, FREE, FREE), "ring", Layout(pp=p, virtual_stages=v))
    assert row.pp_bubble_s == pytest.approx((p - 1) * (f + b) / v)
    slow = Link("slow", 1e-3, 1e30)
    linked = [
        predict(
            StepWork(f, b, m, 0, 2, activation_bytes=1),
            Cluster(1, p, slow, slow),
            "ring",
            Layout(pp=p, virtual_stages=x),
        )
        for x in (1, v)
    ]
    messages = linked[0].pp_bubble_s - (p - 1) * (f + b)
    assert linked[1].pp_bubble_s == pytest.approx((p - 1) * (f + b) / v + v * messages)


def test_context_parallelism_splits_the_sequence_and_prices_its_ring() -> None:
    cluster, model = H100.cluster(1), MODELS["llama3-8b"]
    one, two = (plan(model, Training(8, cp=c, zero=3), cluster, H100.gpu) for c in (1, 2))
    assert two.micro_batches == 2 * one.micro_batches  # CP takes ranks from DP: more micro-batches each
    assert two.compute_s / 2 == pytest.approx(one.compute_s / 2, rel=0.02)  # of half the tokens each
    assert two.memory is not None and one.memory is not None
    assert two.memory["activations_GiB"] == pytest.approx(one.memory["activations_GiB"] / 2, rel=0.05)
    assert one.cp_comm_s == 0.0
    slow = Cluster(1, 8, Link("slow-intra", 1e-5, 1e9), Link("x", 1e-5, 1e9))
    exposed = plan(SMALL, Training(8, cp=2), slow, H100.gpu)
    assert exposed.cp_comm_s > 0  # a slow link cannot hide the K/V exchange behind attention


def test_all_gather_context_parallelism_exposes_its_gathers() -> None:
    """--cp-comm all-gather (Llama 3's CP): K and V gathered before every layer's attention, gathered
    again in the backward and their gradients reduce-scattered, none of it behind the attention."""
    from ringtree.sim.training.plan import collective_s, dp_group

    cluster, model = H100.cluster(2), MODELS["llama3-8b"]
    ring, gathered = (
        plan(model, Training(32, cp=8, cp_comm=c), cluster, H100.gpu) for c in ("p2p", "all-gather")
    )
    assert ring.cp_comm_s == 0.0  # NVLink: the ring hides behind the attention
    run = Training(32, cp=8)
    m, layers = run.micro_batches(2), model.layers
    kv = 2 * model.seq * model.kv_hidden * 2  # K and V of the whole sequence, bf16
    group = dp_group(cluster, 1, 8)  # the CP group: 8 ranks of one node
    one = collective_s("all_gather", "native", group, kv, 4)
    assert gathered.cp_comm_s == pytest.approx(m * layers * 3 * one)  # AG forward, AG + RS backward
    assert gathered.step_s == pytest.approx(ring.step_s + gathered.cp_comm_s)
    assert gathered.details["training"]["cp_comm"] == "all-gather"
    with pytest.raises(ValueError, match=r"--cp-comm all-gather .* add --cp 2"):
        Training(8, cp_comm="all-gather")
    with pytest.raises(ValueError, match="unknown --cp-comm 'ulysses'"):
        Training(8, cp=2, cp_comm="ulysses")


def test_cp_comm_on_the_command_line(tmp_path: Path) -> None:
    base = ["plan", "--model", "llama3-8b", "--nodes", "2", "--cluster", "dgx-h100", "--global-batch", "32"]
    out = tmp_path / "p.json"
    result = runner.invoke(app, [*base, "--cp", "8", "--cp-comm", "all-gather", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["breakdown"]["cp_comm_s"] > 0
    for extra, words in (
        (["--cp-comm", "all-gather"], "add --cp 2"),
        (["--cp", "2", "--cp-comm", "x"], "choose p2p"),
    ):
        bad = runner.invoke(app, [*base, *extra])
        said = " ".join(re.sub("[│╭╮╰╯─]", " ", bad.output).split())
        assert bad.exit_code == 2 and words in said, bad.output
    found = runner.invoke(app, [*base, "--search", "--cp-comm", "all-gather", "--json", str(out)])
    assert found.exit_code == 0, found.output
    rows = [r for r in json.loads(out.read_text())["configurations"] if r["cp"] > 1]
    assert all(r["details"]["training"]["cp_comm"] == "all-gather" for r in rows)


def test_first_and_last_stages_hold_embedding_and_logits_and_fits_names_the_stage() -> None:
    model = MODELS["llama3-8b"]
    run = Training(64, 8, 1, 4)
    rows = stages(model, run, 1, 16)
    middle = rows[1].states
    assert rows[0].states - middle == pytest.approx(18 * model.embedding_params, rel=0.05)  # fp32 grads
    assert rows[3].states - middle == pytest.approx(18 * model.logit_params, rel=0.05)
    assert rows[3].activations > rows[2].activations  # the fp32 logits
    report = memory(model, run, 1, 16, H100.gpu)
    assert not report["fits"] and report["overflow_GiB"] == pytest.approx(
        report["total_GiB"] - report["capacity_GiB"]
    )
    assert report["total_GiB"] == max(s["total_GiB"] for s in report["stages"])
    assert report["stages"][report["fullest_stage"]]["total_GiB"] == report["total_GiB"]
    assert report["fullest_stage"] == 3 and report["total_GiB"] * GiB == pytest.approx(rows[3].total)


def test_gemm_efficiency_depends_on_shape() -> None:
    gpu = H100.gpu
    assert compute.shape_efficiency(8192, 8192, gpu) == 1.0
    assert compute.shape_efficiency(128, 128, gpu) == pytest.approx(1 / 132)  # one tile: one SM busy
    assert compute.shape_efficiency(8192, 8192 + 1, gpu) < 1.0  # a padded column of tiles
    big = compute.gemm_s(8192, 8192, 8192, gpu, "bf16")
    rate = 989.5e12 * gpu.matmul_share * compute.GEMM_EFFICIENCY
    assert gpu.matmul_share * compute.GEMM_EFFICIENCY < 0.72  # Hopper: a smaller share than A100
    assert big == pytest.approx(2 * 8192**3 / rate + compute.KERNEL_S)


def test_newer_gpus_are_priced_by_their_own_peak_and_bandwidth() -> None:
    assert {"dgx-h200", "dgx-b200"} <= set(CLUSTERS)
    rows = {
        n: plan(SMALL, Training(64), get(n).cluster(1), get(n).gpu)
        for n in ("dgx-h100", "dgx-h200", "dgx-b200")
    }
    assert rows["dgx-b200"].step_s < rows["dgx-h200"].step_s <= rows["dgx-h100"].step_s
    assert all(get(n).source for n in ("dgx-h200", "dgx-b200"))


def test_search_finds_layouts_that_fit_fastest_first() -> None:
    model = MODELS["llama3-8b"]
    found = search(model, 64, H100.cluster(2), H100.gpu)
    rows = found.rows
    assert found.fitted >= len(rows) > 5
    assert rows and all(r.memory is not None and r.memory["fits"] for r in rows)
    steps = [r.step_s for r in rows[:10]]
    assert steps == sorted(steps)
    alone = plan(model, Training(64, 1, 8), H100.cluster(2), H100.gpu)
    assert rows[0].step_s <= alone.step_s * 1.001  # no worse than a plain TP 8 layout


def test_search_tries_tp_across_up_to_two_nodes() -> None:
    """TP 16 on 8-GPU nodes (Megatron-LM's figure 13 ran it) is among the candidates once there are
    two nodes, priced on the NICs it spans; never wider than two nodes, never on one."""
    model = Transformer(32, 20480, 128, 2048, 51200)

    def tps(nodes: int) -> set[int]:
        return {g[0].tp for g in candidates(model, 512, H100.cluster(nodes), "bf16", ("full",))}

    assert tps(1) == {1, 2, 4, 8}
    assert tps(2) == tps(8) == {1, 2, 4, 8, 16}
    wide = plan(
        model, Training(512, 1, 16, 1, "bf16", "full", sequence_parallel=True), H100.cluster(2), H100.gpu
    )
    assert wide.tp_link == "inter"


def test_search_of_1024_gpus_takes_under_ten_seconds() -> None:
    start = time.perf_counter()
    rows = search(MODELS["llama3-70b"], 1024, H100.cluster(128), H100.gpu).rows
    assert time.perf_counter() - start < 10 and rows[0].memory is not None and rows[0].memory["fits"]


def test_plan_json_keys_are_the_documented_ones(tmp_path: Path) -> None:
    """The registry's plan keys (ringtree.json_keys, the JSON reference) are the output's: no key
    missing, none extra."""
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama3-8b", "--global-batch", "64", "--micro-batch", "1", "--tp", "4",
            "--pp", "2", "--cp", "2", "--virtual-stages", "2", "--sequence-parallel", "--zero", "1",
            "--nodes", "2", "--cluster", "dgx-h100", "--dtype", "bf16", "--recompute", "selective",
            "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    documented = set(OUTPUTS["plan"].keys)
    actual = (
        set(data) | {f"breakdown.{k}" for k in data["breakdown"]} | {f"memory.{k}" for k in data["memory"]}
    ) | {f"network.{k}" for k in data["network"]}
    assert documented == actual
    assert data["step_s"] == pytest.approx(sum(data["breakdown"].values()))
    peak = 989.5e12 * 16
    assert data["mfu"] == pytest.approx(data["details"]["model_flops_per_step"] / (data["step_s"] * peak))
    assert data["tflops_per_gpu"] == pytest.approx(data["mfu"] * 989.5)


def test_help_is_grouped_by_model_layout_and_cluster() -> None:
    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "120"})
    panels = re.findall(r"╭─ ([A-Za-z -]+?) ─", result.output)
    assert panels[1:4] == ["Model", "Layout", "Cluster"]
    model = result.output.split("╭─ Model")[1].split("╭─ Layout")[0]
    assert all(f"--{o}" in model for o in ("kv-heads", "ffn-hidden", "mlp", "layers"))


def test_the_planner_has_no_import_circle() -> None:
    """plan prices pipelines with sim.pipeline's replay; sim.pipeline imports nothing of the planner."""
    sim = Path(__file__).resolve().parents[1] / "ringtree" / "sim" / "training"
    assert "ringtree.sim.training.plan" not in (sim / "pipeline.py").read_text()
    for low in ("transformer.py", "compute.py", "plan.py"):
        text = (sim / low).read_text()
        assert not re.search(r"ringtree\.sim\.training\.(predictor|search|layout|memory)\b", text), low


def test_data_parallel_plan_json_keys_are_the_documented_ones(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "vit-base", "--grad-dtype", "fp16", "--compute-time", "0.4", "--nodes", "3",
            "--cluster", "eth-10g", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    step = {k for k in OUTPUTS["plan"].keys if "." not in k}
    extra = set(OUTPUTS["plan-dp"].keys) - {"pipeline", "tensor_parallel"}  # with --pp, --tp only
    assert set(data) == step | extra
    assert data["memory"] is None and data["step_s"] == pytest.approx(sum(data["breakdown"].values()))


def test_every_collective_is_priced_as_ringtree_sim_prices_it() -> None:
    """TP all-reduces under `native` cost what `ringtree sim --algorithm native` says for the group."""
    from ringtree.sim.network.allreduce import allreduce_time
    from ringtree.sim.training.plan import tp_group

    cluster = H100.cluster(2)
    row = plan(SMALL, Training(16, 1, 8), cluster, H100.gpu, "native")
    one = allreduce_time("native", tp_group(cluster, 8), 2048 * 1024 * 2, "closed-form", 2)
    assert one.method == "nccl-model"
    per_step = row.micro_batches * 4 * SMALL.layers  # 2 forward + 2 backward per layer
    assert row.tp_comm_s == pytest.approx(per_step * one.seconds)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--shard-group", "8", "--search"], "--shard-group"),
        (["--recompute", "full", "--recompute-layers", "4", "--search"], "--recompute-layers"),
        (["--recompute-layers", "4"], "add --recompute full"),
        (["--recompute", "full", "--recompute-layers", "-1"], "at least 1"),
        (["--zero", "3", "--shard-group", "3"], "--shard-group 3 must divide the data-parallel degree 16"),
        (["--shard-group", "8"], "add --zero 1, 2 or 3"),
    ],
)
def test_new_layout_options_refused_on_the_command_line(extra: list[str], words: str, tmp_path: Path) -> None:
    """Exit 2 with one sentence naming the option, nothing written; with --search, which shards over
    all of DP and prices whole-model recompute, neither option is silently dropped."""
    out = tmp_path / "p.json"
    base = ["plan", "--model", "llama3-8b", "--nodes", "2", "--cluster", "dgx-h100", "--global-batch", "32"]
    result = runner.invoke(app, [*base, *extra, "--json", str(out)])
    said = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())
    assert result.exit_code == 2 and words in said, result.output
    assert "Traceback" not in result.output and not out.exists()
