"""benchmarks/moe_host_time.py's arithmetic, and the CUDA graph scopes the Megatron-Bridge rows of
docs/data/published-runs-moe.json record (docs/results/planner-accuracy-moe.md, "Host-bound MoE
layers")."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import pytest

from ringtree.sim.training.transformer import MODELS
from tests.benchmark_scripts import load

SCOPES = {"attn", "moe_router", "moe_preprocess"}  # Megatron-Core's TE-scoped CUDA graph modules


def bench() -> ModuleType:
    return load("moe_host_time")


def rows() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = load("published_moe_runs").load()["rows"]
    return found


def test_every_megatron_bridge_row_records_its_recipes_cuda_graphs() -> None:
    mbridge = [r for r in rows() if r["source"].startswith("megatron-bridge")]
    assert len(mbridge) == 18
    for r in mbridge:
        scope = r["cuda_graph_scope"]
        assert isinstance(scope, list) and set(scope) <= SCOPES, r["id"]
        assert "moe_preprocess" not in scope or "moe_router" in scope, "Megatron: preprocess needs router"
        quoted = r["assumed"]["cuda_graphs"]
        assert "cuda_graph_impl" in quoted and all(s in quoted for s in scope), r["id"]
    assert all("cuda_graph_scope" not in r for r in rows() if r not in mbridge), "only what a recipe says"


def test_host_time_is_the_published_step_less_the_rest_over_micro_batches_and_layers() -> None:
    """10 s predicted: 4 micro-batches of 2 s (1.5 compute, 0.5 exposed EP) and 2 s outside them; a
    published step of 14 s asks (14 - 2) / (4 x 48) of the host per MoE layer and micro-batch."""
    model = MODELS["qwen3-30b-a3b"]
    plan = {
        "details": {"model": dataclasses.asdict(model)},
        "micro_batches": 4,
        "pp": 1,
        "step_s": 10.0,
        "tokens_per_s_per_gpu": 512 * 4096 / 8 / 10.0,
        "breakdown": {"compute_s": 6.0, "tp_comm_s": 0.0, "cp_comm_s": 0.0, "ep_comm_s": 2.0},
    }
    row = {
        "id": "synthetic",
        "model": {"seq": 4096},
        "training": {"global_batch": 512},
        "system": {"gpus": 8},
        "measured": {"metric": "step_s", "value": 14.0},
    }
    found = bench().host_time(row, plan)
    assert model.moe_layer_count == 48 and found["moe_layers"] == 48
    assert found["gpu_s"] == pytest.approx(2.0 / 48)
    assert found["needed_s"] == pytest.approx(12.0 / (4 * 48))
    assert found["error"] == pytest.approx(14.0 / 10.0 - 1)
    assert found["cuda_graph_scope"] is None
    dense = {**plan, "details": {"model": dataclasses.asdict(MODELS["llama3-8b"])}}
    assert bench().host_time(row, dense) is None


def test_the_b200_qwen3_235b_rows_would_be_host_bound_the_gb200_ones_not() -> None:
    """The page's reading: the eager B200 row needs more host than its GPU time, the GB200 row with
    scoped CUDA graphs about its GPU time."""
    picked = [r for r in rows() if r["id"].startswith("mbridge-26.04.01-") and "qwen3-235b" in r["id"]]
    found = {f["id"].split("-")[2]: f for f in bench().run([r for r in picked if "h100" not in r["id"]])}
    b200, gb200 = found["b200"], found["gb200"]
    assert b200["cuda_graph_scope"] == [] and b200["needed_s"] > 1.3 * b200["gpu_s"]
    assert set(gb200["cuda_graph_scope"]) == SCOPES
    assert gb200["needed_s"] == pytest.approx(gb200["gpu_s"], rel=0.1)
