"""`ringtree emulate`: a real two-node torchrun job over shaped links, cleaned up afterwards.

Tests that build namespaces skip without root/CAP_NET_ADMIN; the refusal itself is tested by
pretending the capability is missing (RINGTREE_EMULATE_NO_NET_ADMIN=1).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from json_tables import documented, keys
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.cli.emulate import absolute_paths, parse_slow
from ringtree.emulate import network

ROOT = Path(__file__).resolve().parents[1]
needs_net_admin = pytest.mark.skipif(
    not network.has_net_admin(), reason="emulate needs root or CAP_NET_ADMIN to create namespaces"
)


def emulate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it (a separate process: Ctrl-C and exit paths are the real ones)."""
    command = [sys.executable, "-m", "ringtree", "emulate", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def leftovers() -> tuple[list[str], list[str]]:
    return network.list_netns(), network.host_links()


def test_rates_bursts_and_arguments() -> None:
    assert network.parse_rate("100mbit") == 1e8 and network.parse_rate("10gbit") == 1e10
    assert network.format_rate(1e9) == "1gbit" and network.format_rate(2.5e8) == "250mbit"
    assert network.burst_bytes(1e9) == 125_000  # 1 ms of line rate
    assert network.burst_bytes(1e6) == 2 * 1514  # but never under two full frames
    assert parse_slow(["2:100mbit"]) == {2: 1e8}
    assert absolute_paths(["bench", "--json", "r.json", "--plot=p.png"]) == [
        "bench",
        "--json",
        str(Path("r.json").absolute()),
        f"--plot={Path('p.png').absolute()}",
    ]
    with pytest.raises(ValueError, match="100mbit"):
        network.parse_rate("fast")


def test_without_net_admin_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTREE_EMULATE_NO_NET_ADMIN", "1")
    result = CliRunner().invoke(app, ["emulate", "--nodes", "2", "--", "bench"])
    assert result.exit_code == 2 and "CAP_NET_ADMIN" in result.output
    assert not network.has_net_admin()


@needs_net_admin
def test_bad_input_exits_2_before_building_anything() -> None:
    for args, word in (
        (["--slow", "5:1gbit", "--", "bench"], "--slow"),
        (["--inter-bw", "fast", "--", "bench"], "100mbit"),
        ([], "after --"),
    ):
        result = CliRunner().invoke(app, ["emulate", "--nodes", "2", *args])
        assert result.exit_code == 2 and word in result.output, result.output
    assert leftovers() == ([], [])


@needs_net_admin
def test_two_node_bench_brings_rows_back_and_leaves_nothing(tmp_path: Path) -> None:
    rows_path, record_path = tmp_path / "rows.json", tmp_path / "cluster.json"
    bench = ["bench", "--algorithms", "ring,native", "--min-bytes", "64K", "--max-bytes", "64K"]
    bench += ["--iters", "2", "--warmup", "1", "--json", str(rows_path)]
    done = emulate("--nodes", "2", "--inter-bw", "1gbit", "--json", str(record_path), "--", *bench)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# emulated cluster: 2 nodes x 1 ranks per node" in done.stdout
    assert "world_size=2" in done.stdout and "local_world_size=1" in done.stdout
    rows = json.loads(rows_path.read_text())
    assert {r["algorithm"] for r in rows} == {"ring", "native"}
    assert all((r["nodes"], r["ranks_per_node"], r["wrong"]) == (2, 1, 0) for r in rows)
    record = json.loads(record_path.read_text())
    table = documented("emulate.md", "emulate")
    assert sorted(keys(record)) == sorted(table)  # docs/how-to/emulate-a-cluster.md's table, exactly
    (link,) = record["links"]
    assert link["configured_gbps"] == 1.0 and 0.3 < link["measured_gbps"] < 1.05  # tbf caps it
    sent = [n["sent"] for n in record["link_bytes"]]
    received = [n["received"] for n in record["link_bytes"]]
    assert min(sent) > 2 * 3 * (64 << 10) // 2  # 2 algorithms x 3 all-reduces, half of 64 KiB each way
    assert abs(sent[0] - received[1]) < 0.05 * sent[0] and abs(sent[1] - received[0]) < 0.05 * sent[1]
    assert leftovers() == ([], [])


@needs_net_admin
def test_failing_command_and_cleanup_leave_nothing() -> None:
    done = emulate("--nodes", "2", "--no-measure", "--", "no-such-command")
    assert done.returncode != 0 and "no-such-command" in done.stdout + done.stderr
    assert leftovers() == ([], [])
    stray = network.build([1e8])  # as an interrupted run would leave it
    stray.created.clear()  # forget it, so only --cleanup can remove it
    assert sorted(network.list_netns()) == sorted([stray.bridge_netns, stray.nodes[0].netns])
    done = emulate("--cleanup")
    assert done.returncode == 0 and "removed 2" in done.stdout
    assert leftovers() == ([], [])


@needs_net_admin
def test_doctor_names_the_node_behind_the_slow_link(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    done = emulate(
        "--nodes", "3", "--inter-bw", "1gbit", "--slow", "2:100mbit", "--no-measure", "--",
        "doctor", "--size", "256K", "--iters", "2", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr  # exit 1: a suspect was found
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("suspect: node 2"), done.stdout  # its last word
    report = json.loads(out.read_text())
    assert (report["nodes"], report["ranks_per_node"]) == (3, 1)
    assert [(s["node"], s["kind"]) for s in report["suspects"]] == [(2, "link")]
    assert report["suspects"][0]["measured"] < 0.2  # Gbit/s: under the 100mbit cap
    assert leftovers() == ([], [])


@needs_net_admin
def test_a_job_past_its_timeout_is_stopped_and_cleaned_up() -> None:
    done = emulate("--nodes", "2", "--no-measure", "--timeout", "2", "--", "bench", "--max-bytes", "64M")
    assert done.returncode == 1 and "did not finish within 2s" in done.stderr, done.stderr
    assert leftovers() == ([], [])


@needs_net_admin
def test_ctrl_c_stops_the_job_and_removes_the_nodes() -> None:
    command = [sys.executable, "-m", "ringtree", "emulate", "--nodes", "2", "--no-measure", "--"]
    job = subprocess.Popen(
        [*command, "bench", "--max-bytes", "64M"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        time.sleep(6)
        state = _signal_state(job.pid)  # on a failure, says whether SIGINT could reach it
        job.send_signal(signal.SIGINT)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
        network.cleanup()  # a failed run must not leave nodes to the tests after it
    assert job.returncode == 130 and b"interrupted" in err, (state, err[-2000:])
    assert b"Traceback" not in err and b"SignalException" not in err, err[-2000:]  # one line, no torch
    assert leftovers() == ([], [])


def _signal_state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        wanted = ("State", "SigBlk", "SigIgn", "SigCgt")
        return " ".join(line.strip() for line in f if line.startswith(wanted))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop itself
def test_an_interrupt_python_dropped_is_still_acted_on() -> None:
    """A KeyboardInterrupt raised inside a finalizer is printed and dropped by Python; the flag the
    signal set still stops the wait for the agents."""
    from ringtree.emulate import interrupt

    class Finalized:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)  # lands while __del__ runs: Python drops it

    with interrupt.interruptible():
        interrupt.check()  # nothing came in yet
        Finalized()  # collected at once; its KeyboardInterrupt goes to sys.unraisablehook
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    interrupt.check()  # cleared on leaving: the next run starts clean


def test_an_ignored_sigint_inherited_from_a_background_shell_still_stops_the_run() -> None:
    """`cmd &` in a script starts cmd with SIGINT ignored (and CI runners often do): the run still
    takes Ctrl-C, and the ignored disposition comes back when it ends."""
    from ringtree.emulate import interrupt

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), interrupt.interruptible():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_the_nodes_are_removed_waits_for_the_end() -> None:
    from ringtree.emulate import interrupt

    done: list[str] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # pytest's, or inherited
    with pytest.raises(KeyboardInterrupt), interrupt.interruptible(), interrupt.deferred():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        done.append("removed")
    assert done == ["removed"]
    assert {s: signal.getsignal(s) for s in before} == before  # both restored


def test_bench_rows_carry_the_node_shape(tmp_path: Path) -> None:
    """Without emulation too: --local-size 1 makes two spawned ranks two nodes of one rank."""
    out = tmp_path / "rows.json"
    args = ["bench", "--nproc", "2", "--local-size", "1", "--algorithms", "ring", "--min-bytes", "1K"]
    result = CliRunner().invoke(app, [*args, "--max-bytes", "1K", "--iters", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert [(r["nodes"], r["ranks_per_node"]) for r in json.loads(out.read_text())] == [(2, 1)]
