"""The planner's accuracy fixes (issue 21): NCCL as `auto` on GPU clusters, FSDP's overlapped
reduce-scatter, matmuls at each GPU's measured share of its peak; and the published runs
(docs/results/planner-accuracy.md) and the 2021 A100 anchors held to the errors reached, so a
regression fails."""

from __future__ import annotations

import dataclasses
import json
import statistics
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.sim.network.clusters import A100_80, B200, GPU, H100, get
from ringtree.sim.network.hardware import Cluster, Link
from ringtree.sim.training import compute
from ringtree.sim.training.layout import Training, check
from ringtree.sim.training.memory import stage_layers
from ringtree.sim.training.plan import Layout, StepWork, predict
from ringtree.sim.training.predictor import default_algorithm, plan, work
from ringtree.sim.training.search import search
from ringtree.sim.training.transformer import Transformer
from tests.benchmark_scripts import load

# what the published runs reach (docs/results/planner-accuracy.md), rounded up
MEDIAN_ABS_ERROR, MAX_ABS_ERROR, MEAN_ABS_ERROR = 0.080, 0.295, 0.102  # 7.9%, 29.2%, 10.1% reached (90 rows)
# rows the memory model says do not fit: none since Llama's rows store no dropout masks (Llama 3 405B
# at 8,192 GPUs, 32 micro-batches per pipeline and 17.9 in flight on the first stage: 76.6 GiB; it
# read 80.9 GiB with GPT's two dropout masks per layer, which Llama trains without)
NOT_FITTING: set[str] = set()
# Narayanan et al. 2021's A100 table priced with NCCL (`auto`, as `ringtree plan` prices it): +0.6% ..
# +6.1% reached (benchmarks/published_figures.py; -5.6% .. +5.4% under the ring the API used before)
ANCHOR_LOW, ANCHOR_HIGH = -0.061, 0.061


def _script(name: str) -> ModuleType:
    return load(name)


@cache
def published() -> list[dict[str, object]]:
    """Every published run through the contract command, in this process."""
    bench = _script("published_runs")
    return [bench.run_row(row, in_process=True) for row in bench.load()["rows"]]


def test_auto_prices_a_transformers_collectives_with_nccl_on_gpu_clusters(tmp_path: Path) -> None:
    assert default_algorithm(get("dgx-h100").cluster(2)) == "native"
    assert default_algorithm(get("dgx-a100").cluster(1)) == "native"
    cpu = Cluster(2, 4, Link("shm", 1e-6, 1e10), Link("eth", 1e-5, 1e9))
    assert default_algorithm(cpu) == "ring"  # no NCCL model of a cluster that is not NVLink or PCIe
    steps = {}
    for algorithm in ("auto", "native", "ring"):
        out = tmp_path / f"{algorithm}.json"
        args = ["plan", "--model", "llama3-8b", "--global-batch", "32", "--tp", "4", "--nodes", "2",
                "--cluster", "dgx-h100", "--algorithm", algorithm, "--json", str(out)]  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        steps[algorithm] = (data["algorithm"], data["step_s"])
    assert steps["auto"] == steps["native"] and steps["auto"][0] == "native"
    assert steps["ring"][1] > steps["native"][1]  # NCCL's NVLS/tree beat a flat ring on H100 nodes


def test_the_python_api_prices_auto_as_the_cli_does() -> None:
    """One planner: `plan` and `search` default to `auto`, NCCL's model on GPU clusters."""
    model, cluster = Transformer(8, 2048, 16, 2048, 51200), get("dgx-a100").cluster(2)
    run = Training(64, 1, 8, 2, "fp16", "full")
    default, native, ring = (
        plan(model, run, cluster, A100_80),
        *(plan(model, run, cluster, A100_80, a) for a in ("native", "ring")),
    )
    assert default.algorithm == "native" and default.step_s == native.step_s != ring.step_s
    found = search(model, 64, cluster, A100_80, "fp16", ("full",))
    assert found.rows and all(row.algorithm == "native" for row in found.rows)


def test_uneven_stages_put_the_shortfall_on_the_first_and_last() -> None:
    assert stage_layers(126, 16) == (7, *(8,) * 14, 7)  # Llama 3 405B (Dubey et al. 2024, sec. 3.3.2)
    assert stage_layers(70, 12) == (5, *(6,) * 10, 5)  # BLOOM 176B's 70 blocks on 12 stages
    assert stage_layers(96, 8) == (12,) * 8 and sum(stage_layers(105, 35)) == 105


def test_the_last_stage_holds_the_logits_and_sets_the_pace() -> None:
    """Megatron-LM's last stage computes the output layer and the loss: with a large vocabulary it is
    the slowest stage, and a pipeline runs at its slowest stage's pace (the replay agrees)."""
    model, run = Transformer(8, 2048, 16, 2048, 256000), Training(32, 1, 1, 4, "fp16", "none")
    w = work(model, run, A100_80, 2)
    head_f = compute.logits_s(model, 2048, 1, A100_80, "fp16")
    assert w.stage_forward_s[:3] == (w.stage_forward_s[0],) * 3
    assert w.stage_forward_s[3] == pytest.approx(w.stage_forward_s[0] + head_f)
    assert (w.forward_s, w.backward_s) == (w.stage_forward_s[3], w.stage_backward_s[3])
    free = Cluster(4, 1, Link("nv", 0.0, 1e15), Link("net", 0.0, 1e15))
    fs, bs = (1.0, 1.0, 1.0, 1.5), (2.0, 2.0, 2.0, 3.0)
    slow_last = StepWork(1.5, 3.0, 8, 0, 2, stage_forward_s=fs, stage_backward_s=bs)
    for schedule in ("1f1b", "gpipe"):
        for fast in (False, True):
            step = predict(slow_last, free, "ring", Layout(pp=4, schedule=schedule), fast).step_s
            assert step == pytest.approx(8 * 4.5 + 3 * 3.0)  # m (f + b) of the slowest + the others' fill


def test_fsdp_reduce_scatters_overlap_the_backward_and_zero_1_only_when_asked() -> None:
    """FSDP (ZeRO-3) reduce-scatters each layer's gradients in the backward; ZeRO-1 after it unless
    --overlap (Megatron's --overlap-grad-reduce)."""
    slow = Cluster(4, 1, Link("nv", 1e-6, 1e11), Link("net", 1e-5, 1e9))
    work = StepWork(0.1, 0.2, 4, 64 << 20, 2, bucket_mb=8, layers=4)
    for zero in (1, 3):
        alone = predict(work, slow, "ring", Layout(zero=zero))
        asked = predict(StepWork(**{**work.__dict__, "overlap": True}), slow, "ring", Layout(zero=zero))
        assert alone.dp_allreduce_s == pytest.approx(asked.dp_allreduce_s) and alone.dp_allreduce_s > 0
        if zero == 3:
            assert alone.exposed_dp_s == pytest.approx(asked.exposed_dp_s)
            assert alone.exposed_dp_s < alone.dp_allreduce_s
        else:
            assert alone.exposed_dp_s == pytest.approx(alone.dp_allreduce_s)
            assert asked.exposed_dp_s < alone.exposed_dp_s


def test_matmuls_run_at_each_gpus_measured_share_of_its_peak() -> None:
    """The A100's large-GEMM rate stays 0.72 of its peak; Hopper and Blackwell reach less of theirs
    (MAMF 80.1% and 77.6% against the A100's 85.9%)."""
    n = 8192

    def rate(gpu: GPU) -> float:
        seconds = compute.gemm_s(n, n, n, gpu, "bf16") - compute.KERNEL_S
        return 2 * n**3 / seconds / gpu.peak("bf16")

    assert rate(A100_80) == pytest.approx(0.72)
    assert rate(H100) == pytest.approx(0.72 * 0.801 / 0.859)
    assert rate(B200) < rate(H100) < rate(A100_80)


def test_published_runs_hold_the_accuracy_reached() -> None:
    results = published()
    assert all(r["status"] == "ok" for r in results), [r for r in results if r["status"] != "ok"]
    errors = [abs(float(r["error"])) for r in results]  # type: ignore[arg-type]
    assert statistics.median(errors) <= MEDIAN_ABS_ERROR
    assert max(errors) <= MAX_ABS_ERROR
    assert statistics.fmean(errors) <= MEAN_ABS_ERROR
    assert {str(r["id"]) for r in results if not r["fits"]} == NOT_FITTING


def test_the_2021_a100_anchors_stay_within_their_errors() -> None:
    rows = _script("published_figures").megatron()
    assert len(rows) == 10
    for name, predicted, published_tflops in rows:
        assert ANCHOR_LOW - 1e-3 <= predicted / published_tflops - 1 <= ANCHOR_HIGH + 1e-3, name


def test_megatron_figures_13_to_15_hold_their_errors() -> None:
    """Narayanan et al. 2021 figures 13-15 (read off the plots): TP 16 and 32 across 8-GPU nodes
    (figure 13) within 25% (22% reached), PP x DP (figure 14) within 15%; figure 15's 5.9B TP x DP
    rows miss at every TP, inside a node too (docs/results/planner-accuracy.md): held where they are."""
    rows = _script("published_figures").megatron_figures()
    errors: dict[int, list[float]] = {13: [], 14: [], 15: []}
    for name, predicted, published_tflops in rows:
        errors[int(name.split("fig. ")[1][:2])].append(abs(predicted / published_tflops - 1))
    assert [len(e) for e in errors.values()] == [10, 10, 13]
    assert max(errors[13]) <= 0.225 and max(errors[14]) <= 0.15 and max(errors[15]) <= 0.81
    across = [r for r in rows if "fig. 13" in r[0] and ("t=16" in r[0] or "t=32" in r[0])]
    assert len(across) == 4 and all(abs(p / q - 1) <= 0.25 for _, p, q in across)
    # what TP 16 and 32 across nodes cost over TP 8 in one node, as a step-time ratio: within 20% of
    # the published one in both figures (9-15% short reached), figure 15's absolute miss aside
    by = {
        (n.split(", t=")[0], n.split("batch ")[1], n.split("t=")[1].split(" ")[0]): (p, q) for n, p, q in rows
    }
    for (figure, batch, t), (predicted, published_tflops) in by.items():
        if t in ("16", "32") and (figure, batch, "8") in by:
            p8, q8 = by[(figure, batch, "8")]
            assert abs((p8 / predicted) / (q8 / published_tflops) - 1) <= 0.20, (figure, batch, t)


def test_a_run_without_flash_attention_is_slower_and_holds_its_scores() -> None:
    """The published runs of 2021-2022 (--no-flash-attention) store the s x s scores unless recomputed."""
    model, cluster = Transformer(24, 2048, 16, 2048, 51200), get("dgx-a100").cluster(1)
    fused, unfused = (
        plan(model, Training(64, 2, 2, dtype="fp16", flash_attention=f), cluster, A100_80)
        for f in (True, False)
    )
    assert unfused.compute_s > fused.compute_s
    assert unfused.memory is not None and fused.memory is not None
    assert unfused.memory["activations_GiB"] > fused.memory["activations_GiB"]


def test_flashattention2_reaches_35_percent_on_hopper_and_60_on_ampere() -> None:
    """--attention-kernel flash2 (PyTorch's SDPA): as fast as the fused kernel on an A100, for which it
    was written; on Hopper 35% of the peak (FlashAttention-3 paper) against the fused kernel's 60%."""
    model = Transformer(32, 4096, 32, 8192, 128256, 8, 14336, "swiglu")

    def ratio(gpu: GPU) -> float:
        fused, flash2 = (
            compute.attention_s(model, 2, 1, 1, gpu, "bf16", True, kernel) - compute.KERNEL_S
            for kernel in ("fused", "flash2")
        )
        return flash2 / fused

    assert ratio(A100_80) == pytest.approx(1.0)
    assert ratio(H100) == pytest.approx(0.6 / 0.35)
    run = Training(8, 1, dtype="bf16", attention_kernel="flash2")
    slow, fast = (plan(model, r, get("dgx-h100").cluster(1), H100) for r in (run, Training(8, 1)))
    assert slow.compute_s > fast.compute_s


def test_llama3_interleaving_counts_the_embedding_and_the_loss_as_layers() -> None:
    """126 layers on PP 16 x V 8 (Dubey et al. 2024, 3.3.2): 128 one-layer chunks, the first holding only
    the embedding and the last only the loss, so 7 layers on the first and last stage, 8 elsewhere."""
    llama = Transformer(126, 1024, 8, 256, 1000)
    assert check(llama, Training(128, pp=16, virtual_stages=8), 128) == 8
    assert stage_layers(126, 16) == (7, *(8,) * 14, 7)
    for layers in (125, 127):  # neither l nor l + 2 is a multiple of 128
        with pytest.raises(ValueError, match="must divide --layers"):
            check(dataclasses.replace(llama, layers=layers), Training(128, pp=16, virtual_stages=8), 128)


def test_grand_teton_h100_holds_what_torchtitan_measured() -> None:
    """torchtitan's Llama 3.1 8B FSDP on 8 GPUs measured 82.4 GiB: over an 80 GB H100, within the
    96 GB HBM2e part of the grand-teton-h100 preset, whose 2.4 TB/s and lower peak make it slower."""
    model = Transformer(32, 4096, 32, 8192, 128256, 8, 14336, "swiglu", False, False)
    run = Training(16, 2, dtype="bf16", recompute="selective", zero=3)
    teton, dgx = (plan(model, run, get(n).cluster(1), get(n).gpu) for n in ("grand-teton-h100", "dgx-h100"))
    assert teton.memory is not None and dgx.memory is not None
    assert 80 < dgx.memory["total_GiB"] < 96
    assert teton.memory["fits"] and not dgx.memory["fits"]
    assert teton.step_s > dgx.step_s
