"""Bad input to `ringtree calibrate` and `ringtree sim`: exit 2 and one sentence naming input and fix."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli import app

runner = CliRunner()
DATA = Path(__file__).parent / "data" / "nccl-tests"


def row(nbytes: int, time_us: float) -> dict[str, object]:
    return {"collective": "all_reduce", "algorithm": "ring", "bytes": nbytes, "count": nbytes // 4,
            "dtype": "float32", "op": "sum", "world_size": 4, "time_us": time_us}  # fmt: skip


def write(name: str, content: object) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        (tmp / name).write_text(content if isinstance(content, str) else json.dumps(content))
        return str(tmp / name)

    return make


ONE_ROW = write("one.json", [row(1 << 20, 500.0)])
FLAT = write("flat.json", [row(1 << k, 100.0) for k in range(10, 20)])  # time does not grow: beta = 0
MALFORMED = write("bad.json", '[{"collective": "all_reduce",')
NOT_ROWS = write("dict.json", {"alpha_s": 1})
BENCH = write("bench.json", [row(1 << k, 50.0 + (1 << k) / 1e3) for k in range(10, 20)])
ZERO_BETA = write(
    "zero.json",
    {"alpha_s": 1e-5, "beta_s_per_byte": 0.0, "gamma_s_per_byte": 0.0, "world_size": 4, "rows": 9,
     "rms_rel_error": 0.1, "max_rel_error": 0.2},
)  # fmt: skip


def out(tmp: Path) -> str:
    return str(tmp / "o.json")


CASES = [
    ("one row", lambda t: ["calibrate", ONE_ROW(t), "--out", str(t / "o.json")], "at least 3 rows"),
    ("beta 0", lambda t: ["calibrate", FLAT(t), "--out", str(t / "o.json")], "no intra-node bandwidth cost"),
    ("out is input", lambda t: ["calibrate", BENCH(t), "--out", BENCH(t)], "is one of the input files"),
    (
        "malformed",
        lambda t: ["calibrate", MALFORMED(t), "--out", str(t / "o.json")],
        "bad.json is not valid JSON",
    ),
    (
        "not rows",
        lambda t: ["calibrate", NOT_ROWS(t), "--out", str(t / "o.json")],
        "expected the list of rows",
    ),
    (
        "truncated log",
        lambda t: ["calibrate", str(DATA / "truncated.log"), "--out", str(t / "o.json")],
        "line 54",
    ),
    (
        "not nccl",
        lambda t: ["calibrate", str(DATA / "not-nccl.log"), "--out", str(t / "o.json")],
        "not-nccl.log",
    ),
    ("missing", lambda t: ["calibrate", str(t / "nope.json"), "--out", str(t / "o.json")], "cannot read"),
    (
        "one nccl size",
        lambda t: [
            "calibrate",
            write(
                "one.log",
                "\n".join(
                    [
                        line
                        for line in (DATA / "a100-1x8-step.log").read_text().splitlines()
                        if not line.strip()[:1].isdigit() or line.split()[0] == "4194304"
                    ]
                )
                + "\n",
            )(t),
            "--out",
            str(t / "o.json"),
        ],
        "cannot fit 2 corrections",
    ),
    (
        "inter without logs",
        lambda t: ["calibrate", BENCH(t), "--inter", "ib-hdr", "--out", str(t / "o.json")],
        "--inter describes",
    ),
    ("zero beta file", lambda t: ["sim", "--calibration", ZERO_BETA(t)], "unusable costs"),
    ("malformed calibration", lambda t: ["sim", "--calibration", MALFORMED(t)], "bad.json is not valid JSON"),
    (
        "replay of thousands",
        lambda t: [
            "sim",
            "--intra",
            "nvlink-a100",
            "--inter",
            "ib-hdr",
            "--nodes",
            "512",
            "--method",
            "replay",
        ],
        "--method auto or closed-form",
    ),
    (
        "no NICs",
        lambda t: ["calibrate", str(DATA / "a100-2x8-mpirun.log"), "--nics-per-node", "0"],
        "at least 1",
    ),
    ("out is a folder", lambda t: ["calibrate", BENCH(t), "--out", str(t)], "is a folder"),
    ("json is a folder", lambda t: ["sim", "--intra", "nvlink-a100", "--json", str(t)], "is a folder"),
    (
        "plot without sweep",
        lambda t: ["sim", "--intra", "nvlink-a100", "--plot", str(t / "p.png")],
        "needs --sweep",
    ),
]


def flat(text: str) -> str:
    """The message without rich's box and line wrapping."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize(("name", "args", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_a_sentence(
    name: str, args: Callable[[Path], list[str]], fragment: str, tmp_path: Path
) -> None:
    result = runner.invoke(app, args(tmp_path))
    assert result.exit_code == 2, result.output
    assert fragment in flat(result.output)
    assert "Traceback" not in result.output
    assert not (tmp_path / "o.json").exists()


def test_default_outputs_are_never_overwritten_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    bench = BENCH(tmp_path)
    assert runner.invoke(app, ["calibrate", bench]).exit_code == 0  # machine.json did not exist: written
    first = (tmp_path / "machine.json").read_text()
    result = runner.invoke(app, ["calibrate", bench])
    assert result.exit_code == 2 and "machine.json already exists" in flat(result.output)
    assert (tmp_path / "machine.json").read_text() == first
    assert runner.invoke(app, ["calibrate", bench, "--out", "machine.json"]).exit_code == 0  # named: replaced


def test_sim_sweep_writes_only_what_it_is_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["sim", "--cluster", "p5.48xlarge", "--nodes", "2", "--algorithm", "native", "--sweep", "sizes"]
    result = runner.invoke(app, [*args, "--max-bytes", "1M", "--json", "out.json"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no picture unless --plot
    assert len(json.loads((tmp_path / "out.json").read_text())) == 9  # 8 B .. 512 KiB, x4


def test_calibration_json_is_strict_json(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert runner.invoke(app, ["calibrate", BENCH(tmp_path), "--out", str(out)]).exit_code == 0
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in calibration JSON"))
    assert data["bandwidth_Bps"] > 0
