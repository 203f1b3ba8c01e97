"""The nccl-tests all_reduce_perf parser on real and synthetic logs of every layout, and on garbage."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtree.sim.network.nccl_tests import NcclTestsError, looks_like_nccl_tests, parse, parse_text

DATA = Path(__file__).parent / "data" / "nccl-tests"
A100_4X8 = (DATA / "a100-4x8.log").read_text()


@pytest.mark.parametrize(
    ("name", "ranks", "nodes", "rows", "first", "last"),
    [
        # old layout: no root column, 'error', device lines without '#', one process driving 8 GPUs
        ("a100-1x8-old.log", 8, 1, 28, 8, 1 << 30),
        # header and device block printed twice (two mpirun ranks), NCCL INFO lines inside the table
        ("a100-2x8-mpirun.log", 16, 2, 11, 1024, 1 << 30),
        # no Group column; 4 hosts
        ("a100-4x8.log", 32, 4, 28, 8, 1 << 30),
        # sizes in a linear step pattern (-b 4M -e 64M -i 4M)
        ("a100-1x8-step.log", 8, 1, 16, 4 << 20, 64 << 20),
        # published 8 x A100 (-g 8) and 2 x 8 H100 runs (sources in tests/data/nccl-tests/README.md)
        ("a100-1x8-galvatron.log", 8, 1, 11, 1 << 20, 1 << 30),
        ("h100-2x8-a3mega.log", 16, 2, 31, 8, 8 << 30),
    ],
)
def test_layouts_of_every_version(
    name: str, ranks: int, nodes: int, rows: int, first: int, last: int
) -> None:
    (run,) = parse(DATA / name)
    assert (run.world_size, run.nodes, run.ranks_per_node) == (ranks, nodes, ranks // nodes)
    assert len(run.rows) == rows
    assert (run.rows[0].nbytes, run.rows[-1].nbytes) == (first, last)
    assert all(r.count * 4 == r.nbytes for r in run.rows)
    assert "A100" in run.gpu or "H100" in run.gpu


def test_times_read_from_the_right_columns() -> None:
    (run,) = parse(DATA / "h100-2x8-a3mega.log")
    one_gib = next(r for r in run.rows if r.nbytes == 1 << 30)
    assert (one_gib.out_of_place_us, one_gib.in_place_us) == (6759.0, 6737.4)
    (m,) = [m for m in run.measurements() if m["bytes"] == 1 << 30]
    assert m["time_us"] == pytest.approx((6759.0 + 6737.4) / 2)
    assert (m["nodes"], m["ranks_per_node"], m["world_size"]) == (2, 8, 16)


def test_two_runs_in_one_file_and_zero_byte_rows() -> None:
    text = (DATA / "a100-4x8.log").read_text()
    zero = f"{0:12d}  {0:12d}     float     sum      -1  5.70  0.00  0.00  0  5.54  0.00  0.00  0\n"
    lines = text.splitlines(keepends=True)
    units = next(i for i, line in enumerate(lines) if "(elements)" in line)
    lines.insert(units + 1, zero)
    runs = parse_text("".join(lines) + (DATA / "a100-1x8-step.log").read_text(), "two.log")
    assert [r.world_size for r in runs] == [32, 8]
    assert runs[0].rows[0].nbytes == 0 and all(m["bytes"] > 0 for m in runs[0].measurements())


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ((DATA / "truncated.log").read_text(), "truncated.log: line 54: expected 13 columns"),
        ((DATA / "reduce-scatter.log").read_text(), "reduce_scatter_perf output"),
        (
            (DATA / "a100-4x8.log").read_text().split("# Out of bounds")[0],
            "ends without nccl-tests' '# Avg bus",
        ),
        ("# nThread 1 nGpus 1\n# Using devices\nhello\n", "no all_reduce_perf table found"),
        (
            "\n".join(
                line for line in (DATA / "a100-4x8.log").read_text().splitlines() if "Rank" not in line
            ),
            "no 'Rank ... on HOST device ...' lines",
        ),
        (
            (DATA / "a100-4x8.log").read_text().replace("on  dgx-a100-03", "on  dgx-a100-02", 3),
            "ranks per host",
        ),
        (
            (DATA / "a100-4x8.log").read_text().replace("  2097152  ", "  2O97152  ", 1),
            "cannot read a size and times",
        ),
    ],
)
def test_garbage_names_the_file_and_line(text: str, fragment: str) -> None:
    name = "truncated.log" if "truncated" in fragment else "log.txt"
    with pytest.raises(NcclTestsError, match="line") as e:
        parse_text(text, name)
    assert fragment in str(e.value)
    assert str(e.value).startswith(name)


def test_content_sniffing() -> None:
    assert looks_like_nccl_tests((DATA / "a100-1x8-old.log").read_text())
    assert not looks_like_nccl_tests((DATA / "not-nccl.log").read_text())


def test_device_block_repeated_after_the_column_header() -> None:
    lines = (DATA / "a100-4x8.log").read_text().splitlines()
    ranks = [line for line in lines if "Rank" in line]
    rest = [line for line in lines if "Rank" not in line]
    header = next(i for i, line in enumerate(rest) if line.lstrip("#").split()[:2] == ["size", "count"])
    (run,) = parse_text("\n".join(rest[: header + 1] + ranks + ranks + rest[header + 1 :]), "late.log")
    assert (run.world_size, run.nodes) == (32, 4) and run.gpu.endswith("A100-SXM4-80GB")
