"""`ringtree trace` on real public traces nobody here wrote (Holistic Trace Analysis's samples in
shared/traces/): the breakdown equals HTA's own figures (tests/data/hta_reference.json, written
by benchmarks/hta_reference.py with HTA 0.6.1), every collective is classified and sized from the
trace's own arguments, stragglers come from the cross-rank match, bad input is refused."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from json_tables import keys
from trace_docs import gpu_rank, write
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.json_keys import OUTPUTS
from ringtree.trace import files, kineto, load, names, report
from ringtree.trace.breakdown import idle_by_stream

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "shared" / "traces"
REFERENCE = json.loads((Path(__file__).parent / "data" / "hta_reference.json").read_text())
KNOWN_OPS = {
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "send",
    "recv",
}


@pytest.fixture(scope="module")
def reports() -> dict[str, report.Report]:
    return {name: report.analyse(load.read_all([TRACES / name])) for name in REFERENCE["sets"]}


@pytest.mark.parametrize("name", list(REFERENCE["sets"]))
def test_the_breakdown_equals_htas_within_one_point(reports: dict[str, report.Report], name: str) -> None:
    ours = {r["rank"]: r for r in reports[name].rank_rows()}
    for hta in REFERENCE["sets"][name]["ranks"]:
        mine = ours[hta["rank"]]
        for key in ("compute_pct", "non_compute_pct", "idle_pct", "comm_overlap_pct"):
            assert mine[key] == pytest.approx(hta[key], abs=1.0), (name, hta["rank"], key)
        # integer-microsecond traces agree exactly; HTA rounds fractional ones inward to whole us
        assert mine["kernel_s"] * 1e6 == pytest.approx(hta["kernel_us"], rel=1e-4)
        assert mine["exposed_comm_s"] + mine["exposed_memcpy_s"] == pytest.approx(mine["non_compute_s"])
        assert mine["idle_host_wait_s"] + mine["idle_kernel_wait_s"] + mine["idle_other_s"] == pytest.approx(
            mine["idle_s"]
        )


@pytest.mark.parametrize("name", list(REFERENCE["sets"]))
def test_idle_by_stream_equals_htas(reports: dict[str, report.Report], name: str) -> None:
    r = reports[name]
    for hta in REFERENCE["sets"][name]["ranks"]:
        i = [t.rank for t in r.traces].index(hta["rank"])
        ours = idle_by_stream(r.windows[i].busy(r.traces[i]))
        for row in hta["idle_by_stream"]:
            stream_total = sum(x["idle_us"] for x in hta["idle_by_stream"] if x["stream"] == row["stream"])
            mine = ours[row["stream"]][row["category"]] * 1e6
            assert mine == pytest.approx(row["idle_us"], abs=max(1.0, 0.01 * stream_total)), row


def test_integer_microsecond_traces_agree_exactly(reports: dict[str, report.Report]) -> None:
    """The old traces' timestamps are whole microseconds, so HTA's rounding changes nothing."""
    for name in ("a2a-a100", "fsdp-a100", "a2a-v100"):
        ours = {r["rank"]: r for r in reports[name].rank_rows()}
        for hta in REFERENCE["sets"][name]["ranks"]:
            mine = ours[hta["rank"]]
            assert round(mine["compute_s"] * 1e6) == hta["compute_us"]
            assert round(mine["idle_s"] * 1e6) == hta["idle_us"]
            assert round(mine["non_compute_s"] * 1e6) == hta["non_compute_us"]


@pytest.mark.parametrize("name", list(REFERENCE["sets"]))
def test_every_collective_is_classified_and_sized(reports: dict[str, report.Report], name: str) -> None:
    rows = reports[name].collectives
    assert rows
    for row in rows:
        assert row.op in KNOWN_OPS, row
        assert row.nbytes > 0 and row.dtype and row.group_size > 1, row


def test_sizes_come_from_the_kernels_own_arguments(reports: dict[str, report.Report]) -> None:
    """ddp-a100 (new format): bytes = In msg nelems x 4 (Float) on each kernel, group from its args."""
    doc = files.load(TRACES / "ddp-a100" / "nccl_data.json.gz")
    expected = {
        (
            "all_reduce" if e["args"]["Collective name"] == "allreduce" else e["args"]["Collective name"],
            e["args"]["In msg nelems"] * (4 if e["args"]["dtype"] == "Float" else 8),
        )
        for e in doc["traceEvents"]
        if e.get("cat") == "kernel" and "Collective name" in e.get("args", {})
    }
    got = {(r.op, r.nbytes) for r in reports["ddp-a100"].collectives}
    assert got <= expected and ("all_reduce", 26550272) in got  # 6,637,568 floats: a 26.5 MB DDP bucket
    assert {r.group for r in reports["ddp-a100"].collectives} == {"0"}


def test_sizes_of_old_traces_come_from_the_host_ops(reports: dict[str, report.Report]) -> None:
    """Old traces: nccl:all_reduce's Input Dims [[19618307]] float; c10d::_allgather_base_'s output
    1073741824 int8 over an input of 16777216 (a group of 64 of the 128 ranks); all-to-all's input."""
    rows = {(r.op, r.nbytes, r.dtype, r.group_size) for r in reports["a2a-a100"].collectives}
    assert ("all_reduce", 19618307 * 4, "float32", 128) in {
        (c.op, c.nbytes, c.dtype, c.group_size) for t in reports["a2a-a100"].traces for c in t.collectives
    }
    assert ("all_gather", 1073741824, "int8", 64) in rows
    assert ("all_to_all", 419430400, "uint8", 128) in rows
    fsdp = {(r.op, r.group_size) for r in reports["fsdp-a100"].collectives}
    assert {("reduce_scatter", 8), ("all_gather", 8), ("all_to_all", 16), ("all_reduce", 16)} <= fsdp


def _renamed(doc: dict[str, Any], drop_args: bool) -> dict[str, Any]:
    """The trace with NCCL >= 2.19's kernel names (and, drop_args, without the kernels' args)."""
    out = copy.deepcopy(doc)
    for e in out["traceEvents"]:
        name = e.get("name", "")
        m = re.match(r"ncclKernel_(\w+?)_RING_LL_Sum_(\w+?)\(", name)
        if e.get("cat") == "kernel" and m:
            ty = {"float": "f32", "int8_t": "i8"}[m.group(2)]
            e["name"] = f"ncclDevKernel_{m.group(1)}_Sum_{ty}_RING_LL"
            if drop_args:
                e["args"] = {k: v for k, v in e["args"].items() if k in ("stream", "correlation", "device")}
    return out


@pytest.mark.parametrize("drop_args", [False, True])
def test_nccl_2_19_kernel_names_read_the_same(tmp_path: Path, drop_args: bool) -> None:
    path = TRACES / "ddp-a100" / "nccl_data.json.gz"
    before = report.analyse(load.read_all([path]))
    after = report.analyse(
        load.read_all([write(_renamed(files.load(path), drop_args), tmp_path / "rank0.json")])
    )
    assert after.rank_rows()[0]["compute_pct"] == pytest.approx(before.rank_rows()[0]["compute_pct"])
    assert after.rank_rows()[0]["comm_overlap_pct"] == pytest.approx(
        before.rank_rows()[0]["comm_overlap_pct"]
    )
    ops = sorted((r.op, r.count) for r in after.collectives)
    if drop_args:  # the host's c10d ops and nccl:* record functions give op and size instead
        assert {op for op, _ in ops} == {"all_reduce", "broadcast"}
    else:
        assert ops == sorted((r.op, r.count) for r in before.collectives)


def test_kernel_names_of_every_nccl_version() -> None:
    assert names.kernel_op("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)") == "all_reduce"
    assert names.kernel_op("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert names.kernel_op("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reduce_scatter"
    assert names.kernel_op("ncclDevKernel_SendRecv") == "send_recv"
    assert names.kernel_op("ncclSymkDevKernel_AllReduce_Sum_f32") == "all_reduce"
    assert names.kernel_op("ampere_sgemm_128x64_nn") is None
    assert names.collective_op("c10d::_allgather_base_") == "all_gather"
    assert names.collective_op("nccl:_reduce_scatter_base") == "reduce_scatter"
    assert names.collective_op("gloo:all_to_all") == "all_to_all"
    assert names.collective_op("all_to_allv") == "all_to_all"


def test_all_to_all_and_pipeline_sends_are_told_apart(tmp_path: Path) -> None:
    """Both are ncclDevKernel_SendRecv; the kernel's `Collective name` tells them apart."""
    for op, name in (("all_to_all", "all_to_all"), ("send", "send"), ("recv", "recv")):
        doc = gpu_rank(0, 2, kernel="ncclDevKernel_SendRecv", collective=name)
        trace = kineto.read(doc, "x", 0)
        assert {c.op for c in trace.collectives} == {op}


@pytest.mark.parametrize("seq", [False, True])
def test_the_late_rank_is_the_straggler(tmp_path: Path, seq: bool) -> None:
    """4 ranks; rank 2 launches each step's all-reduce 2 ms after the others: found from the match
    (any kernel name), costing 2 ms a step; the transfer is the late rank's duration."""
    for r in range(4):
        write(gpu_rank(r, 4, late_us=2_000.0 if r == 2 else 0.0, seq=seq), tmp_path / f"rank{r}.json.gz")
    result = report.analyse(load.read_all([tmp_path]))
    assert [s.rank for s in result.stragglers] == [2]
    assert result.stragglers[0].late_s_per_step == pytest.approx(2e-3, rel=0.01)
    (row,) = result.collectives
    assert row.count == 3 and row.ranks == 4  # steps 0-2: the last step is left out, as HTA
    assert row.median_s == pytest.approx((9_000 - 8_005) * 1e-6)
    assert row.busbw_gbps == pytest.approx((1 << 22) / row.median_s / 1e9 * 1.5)


def test_no_late_rank_no_straggler(tmp_path: Path) -> None:
    for r in range(4):
        write(gpu_rank(r, 4, late_us=30.0 * r), tmp_path / f"rank{r}.json.gz")  # jitter, not a straggler
    result = report.analyse(load.read_all([tmp_path]))
    assert result.stragglers == []
    assert "no straggler" in " ".join(report.verdict(result))


def test_the_json_report_has_the_documented_keys(tmp_path: Path) -> None:
    for r in range(2):
        write(gpu_rank(r, 2, late_us=2_000.0 * r), tmp_path / "run" / f"rank{r}.json")
    out = tmp_path / "report.json"
    args = ["trace", str(tmp_path / "run"), "--json", str(out), "--cluster", "dgx-a100"]
    result = CliRunner().invoke(app, [*args, "--plot", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("the GPU computes")  # the verdict first, then the tables
    data = json.loads(out.read_text())
    assert sorted(keys(data)) == sorted(OUTPUTS["trace"].keys)
    assert data["collectives"][0]["model_busbw_gbps"] > 0
    assert (tmp_path / "r.png").stat().st_size > 0


def test_rank_from_the_file_name(tmp_path: Path) -> None:
    """A trace without distributedInfo.rank takes its rank from its name, else is refused."""
    src = TRACES / "no-rank" / "rank_not_found.json.gz"
    with pytest.raises(ValueError, match="cannot tell its rank"):
        load.read_all([src])
    named = tmp_path / "rank3.json"
    named.write_bytes(gzip.decompress(src.read_bytes()))  # and a plain .json
    (trace,) = load.read_all([named])
    assert trace.rank == 3 and trace.device == "cpu"


def _refused(args: list[str], tmp_path: Path, match: str) -> None:
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["trace", *args, "--json", str(out)], env={"COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    assert re.search(match, " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())), result.output
    assert "Traceback" not in result.output and not out.exists()


def test_bad_input_is_refused_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "rank0.json"
    bad.write_text("{not json")
    _refused([str(bad)], tmp_path, r"rank0.json is not JSON")
    cut = tmp_path / "rank1.json.gz"
    cut.write_bytes((TRACES / "ddp-a100" / "nccl_data.json.gz").read_bytes()[:5000])
    _refused([str(cut)], tmp_path, r"rank1.json.gz is a truncated or damaged gzip")
    empty = write({"traceEvents": [{"ph": "M", "name": "process_name"}]}, tmp_path / "rank2.json")
    _refused([str(empty)], tmp_path, r"rank2.json holds no events")
    same = tmp_path / "same"
    same.mkdir()
    for i in range(2):
        shutil.copy(TRACES / "ddp-a100" / "nccl_data.json.gz", same / f"copy{i}.json.gz")
    _refused([str(same)], tmp_path, r"copy0.json.gz and .*copy1.json.gz both hold rank 0")
    _refused([str(TRACES / "a2a-a100"), str(TRACES / "fsdp-a100")], tmp_path, r"world of 128 ranks .* of 16")
    _refused([str(TRACES / "ddp-a100"), str(TRACES / "a2a-v100")], tmp_path, r"different runs")
    _refused([str(TRACES / "ddp-a100"), "--steps", "7:9"], tmp_path, r"--steps 7:9 is outside the trace")
    _refused([str(TRACES / "ddp-a100"), "--steps", "x"], tmp_path, r"FIRST:LAST")
    _refused([str(tmp_path / "none")], tmp_path, r"does not exist")


def test_ringtree_timeline_reads_as_a_trace(tmp_path: Path) -> None:
    """`ringtree train --trace FILE` writes Kineto's vocabulary (ProfilerStep#, distributedInfo):
    one file for every rank, read per rank; its bucket spans are the collectives."""
    from ringtree.train.trace import Event
    from ringtree.train.trace import write as write_timeline

    events = []
    for rank in range(2):
        for k in range(4):
            t = 100.0 + k * 0.010
            late = 0.002 if rank == 1 else 0.0
            events += [
                Event(f"ProfilerStep#{k}", rank, "compute", t, t + 0.010),
                Event("forward", rank, "compute", t, t + 0.003 + late),
                Event("backward", rank, "compute", t + 0.003 + late, t + 0.009),
                Event("all_reduce bucket 0", rank, "comm", t + 0.006 + late, t + 0.009, {"bytes": 4096}),
            ]
    path = tmp_path / "timeline.json"
    write_timeline(path, events, "gloo")
    result = report.analyse(load.read_all([path]))
    assert [t.rank for t in result.traces] == [0, 1] and result.steps == [0, 1, 2]
    (row,) = result.collectives
    assert (row.op, row.nbytes, row.count, row.ranks) == ("all_reduce", 4096, 3, 2)
    assert row.median_s == pytest.approx(0.001)
    assert [s.rank for s in result.stragglers] == [1]
    assert result.stragglers[0].late_s_per_step == pytest.approx(0.002)
