"""docs/data/published-runs.json is well formed, and benchmarks/published_runs.py builds the
contract command, converts published figures and reports refusals without crashing."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ringtree.sim.network.clusters import CLUSTERS
from tests.benchmark_scripts import load

METRICS = {"step_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"}


def bench() -> ModuleType:
    return load("published_runs")


@cache
def data() -> dict[str, Any]:
    loaded: dict[str, Any] = bench().load()
    return loaded


def rows() -> list[dict[str, Any]]:
    return list(data()["rows"])


def row(run_id: str) -> dict[str, Any]:
    return next(r for r in rows() if r["id"] == run_id)


def test_enough_runs_from_enough_independent_sources() -> None:
    sources = data()["sources"]
    assert len(rows()) >= 25
    assert len({r["id"] for r in rows()}) == len(rows()), "row ids must be unique"
    organizations = {sources[r["source"]]["organization"].split(" (")[0] for r in rows()}
    assert len(organizations) >= 4, organizations
    gpus = {r["system"]["gpu"].split(" ")[0] for r in rows()}
    assert {"A100", "H100"} <= gpus
    t = [r["training"] for r in rows()]
    assert any(x["sequence_parallel"] for x in t) and any(x["cp"] > 1 for x in t)
    assert any(x["virtual_stages"] > 1 for x in t) and any(x["zero"] == 1 for x in t)
    assert any(r["model"]["mlp"] == "swiglu" for r in rows()) and any(
        r["model"]["mlp"] == "gelu" for r in rows()
    )


def test_every_source_is_cited_and_quoted() -> None:
    for key, source in data()["sources"].items():
        for field in ("organization", "citation", "url", "quote", "metric_definition", "hardware"):
            assert source.get(field), f"source {key} has no {field}"
    for r in rows():
        assert r["source"] in data()["sources"], r["id"]
        assert r["where"] and r["measured"]["as_published"], r["id"]


@pytest.mark.parametrize("run_id", [r["id"] for r in bench().load()["rows"]])
def test_row_is_consistent(run_id: str) -> None:
    r = row(run_id)
    m, t, s = r["model"], r["training"], r["system"]
    assert m["hidden"] % m["heads"] == 0 and m["heads"] % m["kv_heads"] == 0
    assert m["mlp"] in {"gelu", "swiglu"} and m["ffn_hidden"] > m["hidden"]
    assert m["heads"] % t["tp"] == 0 and (m["kv_heads"] % t["tp"] == 0 or t["tp"] % m["kv_heads"] == 0)
    model_parallel = t["tp"] * t["pp"] * t["cp"]
    assert s["gpus"] % model_parallel == 0 and s["gpus"] % s["gpus_per_node"] == 0
    dp = s["gpus"] // model_parallel
    assert t["global_batch"] % (dp * t["micro_batch"]) == 0, "global batch = DP x micro-batch x accumulation"
    assert m["seq"] % (2 * t["cp"]) == 0 if t["cp"] > 1 else True  # CP splits the sequence in 2 x CP chunks
    if "uneven pipeline" not in r.get("notes", ""):
        assert m["layers"] % (t["pp"] * t["virtual_stages"]) == 0
    assert t["virtual_stages"] == 1 or t["pp"] > 1
    assert t["zero"] in {0, 1, 2, 3} and t["recompute"] in {"none", "selective", "full", "op", "dots"}
    assert (
        t["recompute"] != "op"
        or "selective_ac_option = 'op'" in r["assumed"]["recompute"]
        or ("per op SAC" in r["assumed"]["recompute"])
    ), "torchtitan's per-op AC: quote where the source says so"
    assert t["recompute"] != "dots" or "save_dot_except_mlpwi" in r["assumed"]["recompute"]
    assert t["dtype"] in {"fp16", "bf16"}
    assert t.get("elementwise", "fused") in {"fused", "eager"}
    # every row says whether it trained with dropout and in which dtype it reduced its gradients, and why
    assert isinstance(m["dropout"], bool) and r["assumed"]["dropout"]
    assert "bucket_mb" not in t or (t["bucket_mb"] > 0 and r["assumed"]["bucket_mb"])
    assert t["grad_dtype"] in {"fp32", t["dtype"]} and r["assumed"]["grad_dtype"].startswith(t["grad_dtype"])
    if r["source"] == "torchtitan":  # eager or compiled: each torchtitan row says which, and from where
        assert "compile" in r["assumed"]["elementwise"], "quote what the source says of torch.compile"
    assert s["cluster"] in CLUSTERS
    assert s["cluster_exact"] or s.get("cluster_note"), (
        "say how the published machine differs from the preset"
    )
    assert r["measured"]["metric"] in METRICS and r["measured"]["value"] > 0
    assert bench().measured_step_s(r) is None or bench().measured_step_s(r) > 0


def test_published_step_times_match_published_throughputs() -> None:
    """A transcription check: where a source gives both, tokens/s = global batch x seq / step."""
    checked = 0
    for r in rows():
        tokens = r.get("also_published", {}).get("tokens_per_s")
        if r["measured"]["metric"] == "step_s" and tokens:
            implied = r["training"]["global_batch"] * r["model"]["seq"] / r["measured"]["value"]
            assert implied == pytest.approx(tokens, rel=0.01), r["id"]
            checked += 1
    assert checked >= 10


def test_llm_foundry_throughputs_match_their_mfu_and_per_gpu_columns() -> None:
    """A transcription check of every LLM Foundry row: its T/s is its T/s/GPU x GPUs, and gives the
    MFU column by the README's own formula, (3 x 2 N s + 3 x 4 l h s^2) x samples/s / (GPUs x peak),
    with N its NumParams and the peak 989 (H100) or 312 (A100) TFLOP/s."""
    checked = 0
    for r in rows():
        if r["source"] != "llm-foundry-benchmarks":
            continue
        m, also, gpus = r["model"], r["also_published"], r["system"]["gpus"]
        tokens_per_s = r["measured"]["value"]
        assert tokens_per_s == pytest.approx(also["tokens_per_s_per_gpu"] * gpus, rel=0.01), r["id"]
        s = m["seq"]
        per_sample = 3 * 2 * also["num_params"] * s + 3 * 4 * m["layers"] * m["hidden"] * s * s
        peak = 989e12 if r["system"]["gpu"].startswith("H100") else 312e12
        assert per_sample * tokens_per_s / s / (gpus * peak) == pytest.approx(also["mfu"], rel=0.01), r["id"]
        checked += 1
    assert checked == 31


def test_ibm_fms_fsdp_throughputs_match_their_mfu_column() -> None:
    """A transcription check of the IBM fms-fsdp rows: tokens/s/GPU gives the MFU column by the
    formula the README names (nanoGPT's and PaLM's 6 N + 12 l h q T FLOPs per token, T the sequence),
    N Llama 2 7B's parameters, the peak 312 (A100) or 989 (H100) TFLOP/s; rounded to 0.01."""
    checked = 0
    for r in rows():
        if r["source"] != "ibm-fms-fsdp":
            continue
        m = r["model"]
        h, f, v, layers = m["hidden"], m["ffn_hidden"], m["vocab"], m["layers"]
        params = layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h  # untied, RMSNorm weights
        assert params == pytest.approx(6.74e9, rel=0.001)  # Llama 2 7B
        per_token = 6 * params + 12 * layers * h * m["seq"]
        peak = 989e12 if r["system"]["gpu"].startswith("H100") else 312e12
        mfu = per_token * r["measured"]["value"] / peak
        assert mfu == pytest.approx(r["also_published"]["mfu"], abs=0.006), r["id"]  # H100: 0.455 shown 0.46
        assert r["training"]["shard_group"] == r["system"]["gpus_per_node"]  # HSDP: one node's ranks
        checked += 1
    assert checked == 2


def test_megatron_table_tflops_match_its_mfu_column() -> None:
    """Megatron-LM's table: per-GPU TFLOP/s / 989 is the MFU column (rounded to 1%)."""
    table = [
        r
        for r in rows()
        if r["source"] == "megatron-readme-2024" and r["measured"]["metric"] == "tflops_per_gpu"
    ]
    assert len(table) == 9
    for r in table:
        assert r["measured"]["value"] / 989 == pytest.approx(r["also_published"]["mfu"], abs=0.006), r["id"]


def test_conversions_to_a_step_time() -> None:
    b = bench()
    # tokens/s per GPU: 16 sequences of 8192 tokens on 8 GPUs at 5,762 tokens/s each
    assert b.measured_step_s(row("torchtitan-h100-llama3.1-8b-8gpu")) == pytest.approx(16 * 8192 / (5762 * 8))
    # tokens/s of the whole job: 2048 sequences of 2048 tokens at 7,500 tokens/s
    assert b.measured_step_s(row("nemo-megatron-a100-gpt3-175b-64gpu")) == pytest.approx(2048 * 2048 / 7500)
    # Megatron-Core's count for the 1.7B GPT (h 2048, 24 layers, s 4096, V 131072, batch 192):
    # 12 B s L h^2 (2 + s/h + 4 + V / (2 L h)), at 408.8 TFLOP/s on 48 GPUs
    flops = 12 * 192 * 4096 * 24 * 2048**2 * (2 + 2 + 4 + 131072 / (2 * 24 * 2048))
    megatron = row("megatron-h100-gpt-1.7b")
    assert b.model_flops(megatron, "megatron-2024") == pytest.approx(flops)
    assert b.measured_step_s(megatron) == pytest.approx(flops / (408.8e12 * 48))
    # SwiGLU counts its third matrix and GQA its narrower K/V, as Megatron-Core does
    llama = row("dgxc-llama3.1-70b-64gpu")
    m = llama["model"]
    attention = 1 + 8 / 64 + 8192 / 8192
    expected = (
        12 * 128 * 8192 * 80 * 8192**2 * (attention + 28672 / 8192 * 1.5 + m["vocab"] / (2 * 80 * 8192))
    )
    assert b.model_flops(llama, "megatron-2024") == pytest.approx(expected)
    # a published step time is the step time; a figure with no stated FLOP count is not converted
    assert b.measured_step_s(llama) == 14.72
    assert b.measured_step_s(row("llama3-405b-8192gpu")) is None
    with pytest.raises(ValueError, match="unknown FLOP count"):
        b.model_flops(llama, "6N")


def test_contract_command() -> None:
    out = Path("plan.json")
    assert bench().command(row("dgxc-llama3.1-70b-64gpu"), out) == [
        "plan", "--model", "transformer", "--layers", "80", "--hidden", "8192", "--heads", "64",
        "--kv-heads", "8", "--ffn-hidden", "28672", "--mlp", "swiglu", "--no-dropout", "--seq", "8192",
        "--vocab", "128256",
        "--global-batch", "128", "--micro-batch", "1", "--tp", "4", "--pp", "4", "--cp", "2",
        "--virtual-stages", "5", "--sequence-parallel", "--zero", "2", "--overlap", "--grad-dtype", "bf16",
        "--nodes", "8", "--cluster", "dgx-h100", "--dtype", "bf16", "--recompute", "none",
        "--json", "plan.json",
    ]  # fmt: skip
    # defaults are left out, so a GPT row runs on a planner without the new options
    gpt = bench().command(row("mt-nlg-530b-2240gpu"), out)
    assert not {"--kv-heads", "--ffn-hidden", "--mlp", "--cp", "--virtual-stages", "--zero"} & set(gpt)
    assert gpt[gpt.index("--nodes") + 1] == "280" and "--sequence-parallel" not in gpt
    assert "--no-flash-attention" in gpt and "--overlap" not in gpt  # MT-NLG: 2021, no overlap
    assert "--elementwise" not in gpt  # fused, the default
    assert "--grad-dtype" not in gpt  # fp16 under --dtype fp16, the default
    assert "--no-dropout" not in gpt and "--no-dropout" in bench().command(row("llama3-405b-8192gpu"), out)
    # Megatron-Core's default bucket, max(40M, 1M x dp) fp32 gradients: dp 48 -> 48M x 4 bytes
    megatron = bench().command(row("megatron-h100-gpt-32b"), out)
    assert megatron[megatron.index("--bucket-mb") + 1] == "183.1" and "--bucket-mb" not in gpt
    assert "--grad-dtype" not in bench().command(row("llama3-405b-8192gpu"), out)  # fp32 under bf16
    eager, compiled = (
        bench().command(row(f"torchtitan-h100-llama3.1-8b-8gpu{x}"), out) for x in ("", "-compile")
    )
    assert eager[eager.index("--elementwise") + 1] == "eager" and "--elementwise" not in compiled


def test_refusals_are_reported_not_raised() -> None:
    b = bench()
    r = row("dgxc-llama3.1-8b-8gpu")
    refused = b.outcome(r, 2, "Usage: x\n│ No such option: --kv-heads │\n", None)
    assert refused == {"status": "not supported", "reason": "No such option: --kv-heads"}
    assert b.outcome(r, 1, "Traceback ...", None)["status"] == "failed"
    assert b.outcome(r, 0, "", {"step_s": 1.0})["status"] == "not supported"
    ran = b.outcome(r, 0, "", {"step_s": 12.91 * 1.1, "mfu": 0.5, "memory": {"fits": True}})
    assert ran["status"] == "ok" and ran["error"] == pytest.approx(0.1) and ran["fits"] is True
    # no step published and no FLOP count: the planner's own TFLOP/s, error as the implied step ratio
    paper = b.outcome(row("llama3-405b-8192gpu"), 0, "", {"step_s": 9.0, "mfu": 0.4, "tflops_per_gpu": 400.0})
    assert paper["error"] == pytest.approx(430 / 400 - 1)
    results = [{"id": r["id"], **ran}, {"id": r["id"], **refused}, {"id": "llama3-405b-8192gpu", **paper}]
    stats = b.summary(results)
    assert stats["compared"] == 2 and stats["not_supported"] == 1
    assert stats["median_abs_error"] == pytest.approx((0.1 + 0.075) / 2)
    table = b.markdown(data(), results)
    assert "2 of 3 rows compared" in table and "- No such option: --kv-heads (1 rows)" in table


@pytest.mark.timeout(120)
def test_one_row_runs_through_the_planner() -> None:
    """The MT-NLG row needs no new option: it runs on today's planner and is compared."""
    result = bench().run_row(row("mt-nlg-530b-2240gpu"))
    assert result["status"] == "ok", result
    assert result["measured_step_s"] == 60.1 and result["predicted_step_s"] > 0
    assert result["command"].startswith("ringtree plan --model transformer --layers 105")
