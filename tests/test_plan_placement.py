"""The planner prices every group on the links its ranks really span (ringtree.ranks' placement)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.clusters import get, preset_cluster
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training.layout import Training
from ringtree.sim.training.plan import Layout as PlanLayout
from ringtree.sim.training.plan import StepPrediction, placed_stage_link, placement
from ringtree.sim.training.predictor import plan
from ringtree.sim.training.transformer import MODELS

COMM = ("tp_comm_s", "cp_comm_s", "ep_comm_s", "pp_bubble_s", "exposed_dp_s", "exposed_zero_gather_s")
runner = CliRunner()
LAYOUTS = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4, 6, 8) if 24 % (tp * pp) == 0]


def _seeds_cluster(slowdown: float = 1.0) -> Cluster:
    """3 DGX A100 nodes with one 10 GbE port each (the seeds' question), the port `slowdown` x slower."""
    c = dataclasses.replace(preset_cluster("dgx-a100", 3, inter="eth-10g"), nics_per_node=1)
    inter = c.inter
    return dataclasses.replace(c, inter=Link(inter.name, inter.alpha_s, inter.bandwidth_Bps / slowdown))


def _step(tp: int, pp: int, cluster: Cluster) -> StepPrediction:
    run = Training(global_batch=240, tp=tp, pp=pp, zero=1, sequence_parallel=tp > 1)
    return plan(MODELS["llama3-8b"], run, cluster, get("dgx-a100").gpu, fast=True)


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_a_1000x_slower_network_slows_every_3_node_layout(tp: int, pp: int) -> None:
    """24 GPUs on 3 nodes cross the network somewhere, whatever the layout: pp 4 / dp 6 puts stage 1
    on ranks 6-11, over nodes 0 and 1, so its DP all-reduce and its stage boundaries pay the port."""
    fast, slow = _step(tp, pp, _seeds_cluster()), _step(tp, pp, _seeds_cluster(1000.0))
    assert slow.step_s >= 1.5 * fast.step_s, (tp, pp, fast.breakdown, slow.breakdown)
    grown = {k: slow.breakdown[k] - fast.breakdown[k] for k in fast.breakdown}
    part = max(grown, key=lambda k: grown[k])
    assert part in COMM, (tp, pp, grown)  # the breakdown names the communication that grew
    assert sum(grown[k] for k in COMM) == pytest.approx(slow.step_s - fast.step_s), (tp, pp, grown)


def test_the_pipeline_boundary_that_crosses_nodes_pays_the_shared_port() -> None:
    c = _seeds_cluster()
    where = placement(c, PlanLayout(pp=4), 6)  # stage 0 -> 1: ranks 2-5 on node 0 send to node 1
    assert placed_stage_link(c, where).bandwidth_Bps == pytest.approx(c.inter.bandwidth_Bps / 4)
    inside = placement(c, PlanLayout(tp=8, pp=1), 3)
    assert placed_stage_link(c, inside) == c.intra
    whole_nodes = placement(dataclasses.replace(c, nics_per_node=8), PlanLayout(tp=8, pp=3), 1)
    assert placed_stage_link(dataclasses.replace(c, nics_per_node=8), whole_nodes) == c.inter


def test_the_search_keeps_the_layouts_that_cross_the_network_least() -> None:
    """The seeds' cluster: no layout of a grid the search covers (each with the lowest ZeRO stage that
    fits, as the search takes), replayed, beats the search's best (its closed-form first pass
    overprices a pipeline's messages; it must not drop the pipelines for that)."""
    from ringtree.sim.training.memory import fits
    from ringtree.sim.training.search import search

    cluster, gpu, model = _seeds_cluster(), get("dgx-a100").gpu, MODELS["llama3-8b"]
    best = search(model, 240, cluster, gpu).rows[0]
    for tp, pp, mb in itertools.product((1, 2), (1, 2, 4, 8), (1, 2)):
        if 24 % (tp * pp):
            continue
        dp = 24 // (tp * pp)
        runs = [Training(240, mb, tp, pp, zero=z, overlap=True, sequence_parallel=tp > 1) for z in range(4)]
        run = next((r for r in runs if fits(model, r, r.micro_batches(dp), dp, gpu)), None)  # as the search
        if run is not None:
            assert plan(model, run, cluster, gpu).step_s >= best.step_s * 0.999, (tp, pp, mb)
    assert best.pp > 1  # on one 10 GbE port per node, a pipeline's activations beat DP's gradients


SEEDS = ["--model", "llama3-8b", "--global-batch", "240", "--nodes", "3", "--cluster", "dgx-a100",
         "--inter", "eth-10g", "--seq", "4096", "--zero", "1", "--pp", "4"]  # fmt: skip


def test_plan_and_sim_say_what_each_node_has(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", *SEEDS, "--nics-per-node", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 x eth-10g (1.25 GB/s each) per node" in " ".join(result.output.split())
    assert "note:" not in result.output  # the count was given
    network = json.loads(out.read_text())["network"]
    assert network == {"gpus_per_node": 8, "intra": "nvlink-a100", "nics_per_node": 1, "nic": "eth-10g",
                       "nic_GBps": pytest.approx(1.25)}  # fmt: skip
    sim = tmp_path / "sim.json"
    result = runner.invoke(app, ["sim", "--nodes", "3", "--cluster", "dgx-a100", "--json", str(sim)])
    assert result.exit_code == 0, result.output
    assert "8 x ib-hdr" in " ".join(result.output.split())
    assert json.loads(sim.read_text())[0]["nics_per_node"] == 8


def test_inter_over_a_preset_says_once_which_nic_count_it_kept() -> None:
    result = runner.invoke(app, ["plan", *SEEDS])
    assert result.exit_code == 0, result.output
    assert result.output.count("note:") == 1
    assert "kept --cluster dgx-a100's 8 NICs per node; pass --nics-per-node" in " ".join(
        result.output.split()
    )
    assert "8 x eth-10g" in " ".join(result.output.split())


@pytest.mark.parametrize("algorithm", ["ring", "native", "hierarchical", "double_tree"])
@pytest.mark.parametrize(
    ("name", "nodes", "model"), [("dgx-a100", 3, "llama3-8b"), ("dgx-h100", 4, "gpt-1.3b")]
)
def test_both_planners_price_the_same_gradient_all_reduce(
    algorithm: str, name: str, nodes: int, model: str
) -> None:
    """Same bytes, algorithm, group and links: one function (`collective_s` over the placed DP group)."""
    from ringtree.sim.training.plan import StepConfig, predict_step

    cluster = dataclasses.replace(preset_cluster(name, nodes, inter="eth-10g"), nics_per_node=1)
    shape = MODELS[model]
    run = Training(global_batch=240 if nodes == 3 else 256, grad_dtype="fp32")
    transformer = plan(shape, run, cluster, get(name).gpu, algorithm, fast=True).dp_allreduce_s
    data_parallel = predict_step(StepConfig(int(shape.params), 1.0), cluster, algorithm).dp_allreduce_s
    assert data_parallel == pytest.approx(transformer, rel=0.01)


def test_the_cli_planners_agree_and_say_which_model_ran(tmp_path: Path) -> None:
    cluster = ["--nodes", "3", "--cluster", "dgx-a100", "--inter", "eth-10g", "--nics-per-node", "1"]
    dp_json, tf_json = tmp_path / "dp.json", tmp_path / "tf.json"
    dp = runner.invoke(app, ["plan", "--model", "Llama3-8B", "--compute-time", "1", "--algorithm", "ring",
                             *cluster, "--json", str(dp_json)])  # fmt: skip
    tf = runner.invoke(app, ["plan", "--model", "llama3-8b", "--global-batch", "240", "--grad-dtype", "fp32",
                             "--algorithm", "ring", *cluster, "--json", str(tf_json)])  # fmt: skip
    assert dp.exit_code == 0 and tf.exit_code == 0, dp.output + tf.output
    a, b = json.loads(dp_json.read_text()), json.loads(tf_json.read_text())
    assert (a["planner"], b["planner"]) == ("data-parallel", "transformer")
    assert a["dp_allreduce_s"] == pytest.approx(b["dp_allreduce_s"], rel=0.01)
    assert "planner: data-parallel (the whole model on every GPU" in " ".join(dp.output.split())
    assert "planner: transformer (compute from the model's FLOPs" in " ".join(tf.output.split())


def test_model_names_are_one_case_insensitive_list_with_a_did_you_mean() -> None:
    result = runner.invoke(
        app, ["plan", "--model", "lama3-8b", "--global-batch", "8", "--cluster", "dgx-a100"]
    )
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "did you mean llama3-8b" in words and "vit-base" in words
    assert "Traceback" not in result.output
    for spelling in ("VIT-BASE", "vit-base"):
        ok = runner.invoke(
            app, ["plan", "--model", spelling, "--compute-time", "0.4", "--cluster", "eth-10g"]
        )
        assert ok.exit_code == 0 and "86.0M params" in ok.output, ok.output


def test_the_search_folds_rows_that_differ_in_nothing_it_prices() -> None:
    """CP 2 with half the DP and twice the micro-batch costs what CP 1 does here: one row, not three;
    the why line's runner-up is the first row that costs something else."""
    from ringtree.sim.training.search import alike_words, search, why

    found = search(MODELS["llama3-8b"], 240, _seeds_cluster(), get("dgx-a100").gpu)
    rows = found.rows
    for a, b in itertools.pairwise(rows):
        assert (a.step_s, a.memory["total_GiB"]) != pytest.approx((b.step_s, b.memory["total_GiB"]))
    folded = next(r for r in rows if r.details.get("alike"))
    assert all(a["cp"] != folded.cp for a in folded.details["alike"]) and "CP " in alike_words(folded)
    assert f"{rows[1].step_s / rows[0].step_s - 1:.1%} slower" in why(found)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "llama3-8b", "--global-batch", "240", "--cluster", "dgx-a100", "--pp", "24"],
         "--pp 24 cannot split the 32 layers: 2 on each of the 22 middle stages is 44; choose --pp among"),
        (["--model", "llama3-8b", "--global-batch", "0", "--cluster", "dgx-a100"],
         "--global-batch must be at least 1, got 0"),
        (["--model", "vit-base", "--compute-time", "-1", "--cluster", "eth-10g"],
         "--compute-time must not be negative, got -1.0"),
    ],
)  # fmt: skip
def test_plan_mistakes_name_the_flag_in_one_sentence(args: list[str], said: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", *args, "--json", str(out)], env={"COLUMNS": "250"})
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and said in words, result.output
    assert "Traceback" not in result.output and not out.exists()


def test_memory_warning_says_an_a100() -> None:
    args = ["plan", "--model", "llama3-70b", "--global-batch", "8", "--cluster", "dgx-a100"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "GiB of an A100-SXM4-80GB;" in " ".join(result.output.split())


def test_bench_sizes_name_the_flags() -> None:
    result = runner.invoke(app, ["bench", "--min-bytes", "100", "--max-bytes", "10"], env={"COLUMNS": "250"})
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "--min-bytes 100 and --max-bytes 10" in words
    assert "min_bytes" not in words


def test_tp_across_nodes_is_priced_and_said_to_be_a_bad_idea() -> None:
    base = ["plan", "--model", "llama3-70b", "--global-batch", "64", "--cluster", "dgx-a100", "--nodes", "4",
            "--pp", "2", "--zero", "1", "--sequence-parallel"]  # fmt: skip
    across, inside = (runner.invoke(app, [*base, "--tp", tp]) for tp in ("16", "8"))
    assert across.exit_code == 0 and inside.exit_code == 0, across.output
    assert "the TP group of 16 spans nodes of 8 GPUs" in " ".join(across.output.split())
    assert "spans nodes" not in inside.output
