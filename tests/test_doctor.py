"""`ringtree doctor`: the report's shape, a slow rank named as a compute suspect, the suspect rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.doctor import DoctorConfig, link_pairs, suspects

SUSPECT_KEYS = ["node", "rank", "kind", "measured", "expected"]


def test_slow_rank_is_a_compute_suspect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of one spawned rank each; rank 1 sleeps in its matmul timing and is the only suspect."""
    monkeypatch.setenv("RINGTREE_DOCTOR_SLOW_RANK", "1")
    out = tmp_path / "doctor.json"
    args = ["doctor", "--nproc", "2", "--local-size", "1", "--size", "64K", "--iters", "2"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 1, result.output  # suspects found
    report = json.loads(out.read_text())
    assert (report["nodes"], report["ranks_per_node"], report["world_size"]) == (2, 1, 2)
    assert report["mismatches"] == [] and report["versions"]["backend"] == "gloo"
    compute = [s for s in report["suspects"] if s["kind"] == "compute"]
    assert [(s["node"], s["rank"]) for s in compute] == [(1, 1)]
    assert all(list(s) == SUSPECT_KEYS for s in report["suspects"])
    assert compute[0]["measured"] < 0.5 * compute[0]["expected"]
    assert [(x["a"], x["b"], x["level"]) for x in report["links"]] == link_pairs(2, 1) == [(0, 1, "inter")]
    assert all(x["gbps"] > 0 and x["latency_us"] > 0 for x in report["links"])
    assert "suspect: node 1 rank 1 (compute)" in result.output


def test_link_pairs_cover_every_node_pair_and_every_node() -> None:
    inter = [(0, 2, "inter"), (0, 4, "inter"), (2, 4, "inter")]
    assert link_pairs(3, 2) == [*inter, (0, 1, "intra"), (2, 3, "intra"), (4, 5, "intra")]


def test_suspect_rules_name_only_the_slow_node() -> None:
    """Three nodes, node 2 behind a tenth of the bandwidth: its links are slow, node 0-1 is not."""
    links = [
        {"a": 0, "b": 1, "node_a": 0, "node_b": 1, "level": "inter", "gbps": 1.0},
        {"a": 0, "b": 2, "node_a": 0, "node_b": 2, "level": "inter", "gbps": 0.1},
        {"a": 1, "b": 2, "node_a": 1, "node_b": 2, "level": "inter", "gbps": 0.1},
    ]
    compute = [{"rank": r, "node": r, "gflops": 10.0} for r in range(3)]
    found = suspects(links, compute, 3, 1, DoctorConfig())
    assert found == [{"node": 2, "rank": 2, "kind": "link", "measured": 0.1, "expected": 1.0}]
    # an expected rate the user names overrides the median: every node falls short of 10 Gbit/s
    assert [s["node"] for s in suspects(links, compute, 3, 1, DoctorConfig(expect_gbps=10.0))] == [0, 1, 2]


def test_doctor_rejects_bad_arguments() -> None:
    result = CliRunner().invoke(app, ["doctor", "--threshold", "2"])
    assert result.exit_code == 2 and "threshold" in result.output
    result = CliRunner().invoke(app, ["doctor", "--expect-bw", "fast"])
    assert result.exit_code == 2 and "10gbit" in result.output
