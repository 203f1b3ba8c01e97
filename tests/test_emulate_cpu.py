"""`ringtree emulate --cpus-per-node`: every node's processes in a cpu cgroup of their own, capped at
an equal share, removed afterwards. Tests that make groups skip without a writable cpu controller."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.emulate import cpu, network

ROOT = Path(__file__).resolve().parents[1]
needs_cgroups = pytest.mark.skipif(
    cpu.unavailable() is not None or not network.has_net_admin(),
    reason="needs root and a writable cgroup cpu controller",
)


def test_shares_are_read_and_never_add_up_to_more_than_the_cores() -> None:
    assert cpu.parse("shared", 3, cores=2) is None
    assert cpu.parse("auto", 3, cores=2) == 0.666  # rounded down: 3 x 0.666 <= 2
    assert cpu.parse("auto", 2, cores=2) == 1.0
    assert cpu.parse("0.5", 4, cores=2) == 0.5
    with pytest.raises(ValueError, match=r"asks for 3 cores, but this machine has 2; give at most 0\.666"):
        cpu.parse("1", 3, cores=2)
    with pytest.raises(ValueError, match="cannot read --cpus-per-node 'fast'"):
        cpu.parse("fast", 3, cores=2)
    with pytest.raises(ValueError, match=r"at least 0\.01"):
        cpu.parse("0", 3, cores=2)
    assert "6660 us per 10000 us" in cpu.describe(0.666)


def test_bad_shares_exit_2_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    if not network.has_net_admin():
        pytest.skip("emulate refuses first without CAP_NET_ADMIN")
    for value, word in (("fast", "cannot read --cpus-per-node"), ("64", "--cpus-per-node 64 on 2 nodes")):
        result = CliRunner().invoke(app, ["emulate", "--nodes", "2", "--cpus-per-node", value, "--", "bench"])
        assert result.exit_code == 2 and word in " ".join(result.output.split()), result.output
    monkeypatch.setattr(cpu, "root", lambda: None)  # a host without the controller
    result = CliRunner().invoke(app, ["emulate", "--nodes", "2", "--cpus-per-node", "auto", "--", "bench"])
    assert result.exit_code == 2 and "needs a cgroup cpu controller" in result.output, result.output
    assert "Traceback" not in result.output and network.list_netns() == []


@needs_cgroups
def test_a_wrapped_command_runs_in_its_capped_group_and_the_groups_go_away() -> None:
    with cpu.build("rtemu-test", 2, 0.25) as shares:
        _, version = cpu.root()  # type: ignore[misc]
        quota = (shares.groups[1] / ("cpu.cfs_quota_us" if version == 1 else "cpu.max")).read_text()
        assert quota.split()[0] == "2500"
        inside = subprocess.run(
            shares.wrap(1, ["cat", "/proc/self/cgroup"]), capture_output=True, text=True, check=True
        ).stdout
        assert "/rtemu-test-cpu1" in inside and "/rtemu-test-cpu0" not in inside
        sleeper = subprocess.Popen(shares.wrap(0, ["sleep", "30"]))  # still running when they are removed
        procs = shares.groups[0] / "cgroup.procs"
        for _ in range(100):  # until its shell has joined the group (and become `sleep`)
            if str(sleeper.pid) in procs.read_text().split():
                break
            time.sleep(0.05)
        assert str(sleeper.pid) in procs.read_text().split()
    try:
        assert cpu.listed() == []  # its process went back to the parent group, the group is gone
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


@needs_cgroups
def test_emulate_caps_the_nodes_and_cleanup_removes_a_left_group(tmp_path: Path) -> None:
    record_path = tmp_path / "cluster.json"
    bench = ["bench", "--algorithms", "ring", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "2"]
    # 1 core a node, not 0.5: the cap is recorded and applied the same, in half the time
    command = [sys.executable, "-m", "ringtree", "emulate", "--nodes", "2", "--cpus-per-node", "1"]
    done = subprocess.run(
        [*command, "--no-measure", "--json", str(record_path), "--", *bench],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(record_path.read_text())
    assert record["cpus_per_node"] == 1.0 and "every node capped at 1 cores" in record["cpu_policy"]
    assert "every node capped at 1 cores" in done.stdout
    assert cpu.listed() == [] and network.list_netns() == []
    stray = cpu.build("rtemu-stray", 1, 0.5)
    stray.groups = []  # forgotten, as an interrupted run would leave it
    done = subprocess.run(
        [sys.executable, "-m", "ringtree", "emulate", "--cleanup"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and "rtemu-stray-cpu0" in done.stdout, done.stdout + done.stderr
    assert cpu.listed() == []
