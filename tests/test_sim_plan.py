"""The planner: the reference ViT-Base case, buckets, overlap, accumulation, compression, advice."""

from __future__ import annotations

import dataclasses

import pytest

from ringtree.sim import Cluster, Link, make_cluster
from ringtree.sim.training.plan import StepConfig, predict_step, recommend, speedup_vs_one_node

VIT_BASE = StepConfig(86_000_000, 0.4, "fp16")
REFERENCE = make_cluster(3, 8, "pcie-gen3", "eth-10g")


def test_reference_vit_base_on_three_nodes_of_pcie_and_10g_ethernet() -> None:
    """172 MB of fp16 gradients, ring, no overlap (the DESIGN.md worked example)."""
    assert VIT_BASE.grad_bytes == 172_000_000
    three = predict_step(VIT_BASE, REFERENCE, "ring")
    one = predict_step(VIT_BASE, REFERENCE.with_nodes(1), "ring")
    assert 0.26 <= three.dp_allreduce_s <= 0.275
    assert three.step_s == pytest.approx(0.675, abs=0.01)
    assert one.step_s == pytest.approx(0.42, abs=0.005)
    assert speedup_vs_one_node(VIT_BASE, REFERENCE, "ring") == pytest.approx(1.86, abs=0.03)


def test_buckets_cut_whole_elements() -> None:
    cfg = StepConfig(10 * (1 << 20), 0.1, "fp32", bucket_mb=16)
    assert cfg.buckets() == [16 << 20, 16 << 20, 8 << 20]
    assert dataclasses.replace(cfg, compression="bf16").buckets() == [16 << 20, 4 << 20]


def test_overlap_hides_buckets_behind_the_backward() -> None:
    # Latency-free link of 1 GB/s between two ranks: one bucket of n bytes takes n/1e9 s (p=2: 2 x n/2).
    link = Link("1GB/s", 0.0, 1e9)
    two = Cluster(1, 2, link, link, 0.0)
    cfg = StepConfig(3 * (1 << 20), 0.3, "fp32", bucket_mb=4)  # 12 MiB: three 4 MiB buckets
    bucket = (4 << 20) / 1e9
    assert predict_step(cfg, two).step_s == pytest.approx(0.3 + 3 * bucket)
    # Backward is the last 0.2 s; buckets are ready at 0.1 + 0.2 * (1, 2, 3) / 3, and run back to back.
    ends = 0.0
    for ready in (0.1 + 0.2 / 3, 0.1 + 0.4 / 3, 0.3):
        ends = max(ends, ready) + bucket
    overlapped = predict_step(dataclasses.replace(cfg, overlap=True), two)
    assert overlapped.step_s == pytest.approx(ends)
    # Accumulation: four micro-steps of compute, one all-reduce, four times the samples.
    acc = predict_step(dataclasses.replace(cfg, accumulate=4), two)
    assert acc.step_s == pytest.approx(1.2 + 3 * bucket)
    assert acc.samples_per_s == pytest.approx(4 * 32 * 2 / acc.step_s)


def test_what_each_change_does_on_the_reference_cluster() -> None:
    ring = predict_step(VIT_BASE, REFERENCE, "ring")
    fp32 = predict_step(dataclasses.replace(VIT_BASE, grad_dtype="fp32"), REFERENCE, "ring")
    assert fp32.dp_allreduce_s == pytest.approx(2 * ring.dp_allreduce_s, rel=0.02)
    assert predict_step(VIT_BASE, REFERENCE, "hierarchical").step_s < ring.step_s
    assert predict_step(dataclasses.replace(VIT_BASE, overlap=True), REFERENCE, "ring").step_s < 0.5
    fast = make_cluster(3, 8, "pcie-gen3", "eth-100g")
    assert predict_step(VIT_BASE, fast, "ring").dp_allreduce_s < 0.05
    best, reason = recommend(VIT_BASE, REFERENCE)
    assert best == "hierarchical" and "inter (eth-10g)" in reason and "--overlap" in reason


def test_bad_configurations_name_the_value() -> None:
    with pytest.raises(ValueError, match="fp8"):
        StepConfig(1, 0.1, "fp8")
    with pytest.raises(ValueError, match="accumulate"):
        StepConfig(1, 0.1, accumulate=0)
    with pytest.raises(ValueError, match="hypercube"):
        predict_step(VIT_BASE, REFERENCE, "hypercube")
