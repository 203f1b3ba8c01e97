"""`ringtree bench`: the table, the JSON rows, the plot, bad arguments, and torchrun across two nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.bench import ROW_KEYS, BenchConfig, busbw_factor
from ringtree.cli.app import app

ROOT = Path(__file__).resolve().parents[1]


def test_busbw_factors_follow_nccl_tests() -> None:
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("all_to_all", 4) == 0.75
    assert busbw_factor("broadcast", 4) == busbw_factor("reduce", 4) == 1.0


def test_config_sizes_and_errors() -> None:
    assert BenchConfig(min_bytes=8, max_bytes=64, step_factor=2).sizes() == [8, 16, 32, 64]
    assert BenchConfig(min_bytes=0, max_bytes=4, step_factor=4).sizes() == [0, 1, 4]
    with pytest.raises(ValueError, match="double_tree"):
        BenchConfig(algorithms=("butterfly",))
    with pytest.raises(ValueError, match="all_gather"):
        BenchConfig(collective="allgather")
    with pytest.raises(ValueError, match="--min-bytes 64 and --max-bytes 8"):
        BenchConfig(min_bytes=64, max_bytes=8)
    with pytest.raises(ValueError, match="dtype"):
        BenchConfig(dtype="float8")


def test_bench_writes_rows_plot_and_table(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--nproc", "3", "--algorithms", "native,ring,double_tree,bfb", "--min-bytes", "0"]
    args += ["--max-bytes", "4K", "--step-factor", "64", "--iters", "2", "--warmup", "1"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "busbw (GB/s)" in result.output and "world_size=3" in result.output
    rows = json.loads(out.read_text())
    assert [r["bytes"] for r in rows] == [0] * 4 + [64] * 4 + [4096] * 4  # 1 byte rounds to 0 floats
    for row in rows:
        assert tuple(row) == ROW_KEYS
        assert row["wrong"] == 0 and row["world_size"] == 3 and row["time_us"] > 0
        assert row["time_s"] == pytest.approx(row["time_us"] / 1e6)
        if row["bytes"]:
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 4 / 3)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("collective", "extra"),
    [
        ("all_gather", []),
        ("reduce_scatter", ["--op", "max"]),
        ("broadcast", ["--root", "1"]),
        ("reduce", ["--dtype", "bfloat16", "--op", "product"]),
        ("all-to-all", []),
    ],
)
def test_bench_other_collectives_check_their_results(
    tmp_path: Path, collective: str, extra: list[str]
) -> None:
    out = tmp_path / "rows.json"
    args = ["bench", "--nproc", "2", "--collective", collective, "--min-bytes", "1K", "--max-bytes", "1K"]
    result = CliRunner().invoke(app, [*args, "--iters", "1", "--warmup", "0", *extra, "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    name = collective.replace("-", "_")
    assert {r["algorithm"] for r in rows} == set(__import__("ringtree").comm.algorithms(name))
    assert all(r["wrong"] == 0 and r["collective"] == name for r in rows)
    reduces = name in ("reduce_scatter", "reduce")  # nccl-tests' redop column: none where nothing is
    assert {r["op"] for r in rows} == ({extra[-1]} if reduces else {"none"})


def test_bench_rejects_bad_arguments() -> None:
    result = CliRunner().invoke(app, ["bench", "--algorithms", "ring,butterfly"])
    assert result.exit_code == 2 and "butterfly" in result.output
    result = CliRunner().invoke(app, ["bench", "--max-bytes", "lots"])
    assert result.exit_code == 2 and "64M" in result.output
    result = CliRunner().invoke(app, ["bench", "--collective", "all-to-all", "--algorithms", "ring"])
    assert result.exit_code == 2 and "unknown all_to_all algorithm(s) ring" in result.output
    result = CliRunner().invoke(app, ["bench", "--collective", "all-gather", "--op", "max"])
    assert result.exit_code == 2 and "--op max reduces, and all-gather only moves data" in result.output


def test_bench_under_torchrun_on_two_nodes(tmp_path: Path) -> None:
    """Two torchrun agents on this machine stand in for two nodes of two ranks (c10d rendezvous)."""
    import socket

    with socket.socket() as s:  # a free port for the rendezvous, chosen by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rows.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=ringtree-test",
        "-m",
        "ringtree",
        "bench",
        "--algorithms",
        "hierarchical,ring,native",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "64K",
        "--step-factor",
        "16",
        "--iters",
        "2",
        "--warmup",
        "1",
    ]
    # is_host names the agent that serves the rendezvous store, so two agents on one host cannot race.
    agents = [
        subprocess.Popen(
            [
                *command[:8],
                f"--rdzv-conf=is_host={i == 0}",
                *command[8:],
                *(["--json", str(out)] if i == 0 else []),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=150)[0])
    finally:
        for agent in agents:
            agent.kill()
    assert all(a.returncode == 0 for a in agents), "\n".join(o[-2000:] for o in outputs)
    printed = "".join(outputs)
    assert "world_size=4" in printed and "local_world_size=2" in printed  # two nodes of two
    rows = json.loads(out.read_text())
    assert {r["algorithm"] for r in rows} == {"hierarchical", "ring", "native"}
    assert all(r["wrong"] == 0 and r["world_size"] == 4 for r in rows)


def test_a_sweep_where_no_bar_shows_says_each_size_done_and_the_time_left(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ringtree.bench import BenchConfig, SizesDone

    cfg = BenchConfig(algorithms=("ring", "tree"))
    ticks = iter([0.0, 1.0, 2.0, 3.0, 5.0])  # the start, then each size's end: 1 s, 1 s, 1 s, 2 s
    done = SizesDone(cfg, [8, 64, 1 << 20, 2 << 20, 4 << 20], clock=lambda: next(ticks))
    for _ in range(8):  # four sizes, each done when both algorithms are
        done(None)  # type: ignore[arg-type]  # the row itself is not read
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 4
    assert said[0] == "# 8 done (1 of 5 sizes) in 1.0 s; about 4.0 s left"  # 4 sizes left at alpha
    # 2M took 2 s: alpha 1 s plus 1 s per (2M - 8) bytes, so 4M takes about 3 s
    assert said[3] == "# 2M done (4 of 5 sizes) in 5.0 s; about 3.0 s left"
