"""Bad input, everywhere: each gets exit code 2 and one sentence naming the input and the fix,
before any process starts: no traceback, nothing written. One table for every command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.train import checkpoint

# (arguments, a fragment the message must hold); "{tmp}" is an existing folder, "{file}" a file in it.
CASES: list[tuple[list[str], str]] = [
    (["bench", "--algorithms", ""], "names no algorithm"),
    (["bench", "--algorithms", "ring,butterfly"], "unknown all_reduce algorithm(s) butterfly"),
    (["bench", "--max-bytes", "lots"], "lots"),
    (["bench", "--json", "{tmp}"], "is a folder; name a file inside it"),
    (["bench", "--plot", "{file}/x.png"], "is a file, not a folder"),
    (["bench", "--device", "tpu"], "unknown device 'tpu'"),
    (["train", "--model", "vit", "--tp", "3", "--nproc", "4"], "does not divide the 4 ranks"),
    (["train", "--pp", "10", "--nproc", "10"], "more stages than the"),
    (["train", "--tp", "2"], "--tp 2 needs a plan of which layers to split: MLP carries none"),
    (["train", "--model", "vit", "--pp", "5", "--nproc", "5"], "more stages than the"),
    (["train", "--mode", "dp", "--pp", "2"], "--mode dp steps the whole model on rank 0"),
    (["train", "--mode", "dp-threads", "--nproc", "2"], "use --nproc 1"),
    (["train", "--threads", "2"], "sets the devices of --mode dp-threads"),
    (["train", "--mode", "dp-threads", "--algorithm", "tree"], "--algorithm: not supported by --mode"),
    (["train", "--max-restarts", "1"], "pass --checkpoint-dir DIR"),
    (["train", "--keep-checkpoints", "3"], "needs --checkpoint-dir"),
    (["train", "--schedule", "gpipe"], "--pp"),
    (["train", "--micro-batches", "4"], "--micro-batches needs --pp 2 or more"),  # flags, not fields
    (["train", "--distill-alpha", "0.3"], "--teacher"),
    (["train", "--json", "{tmp}"], "is a folder"),
    (["train", "--teacher", "{file}"], "cannot be read as a checkpoint"),
    (["train", "--resume", "--checkpoint-dir", "{tmp}"], "no usable checkpoint"),
    (["train", "--config", "{bin}"], "--config {bin} is not a text file (byte 0xa8 at offset 0"),
    (["plan", "--from-run", "{bin}"], "--from-run {bin} is not a text file"),
    (["plan", "--nodes", "2", "--json", "{tmp}"], "is a folder; name a file inside it"),
    (["doctor", "--json", "{file}/x.json"], "is a file, not a folder"),  # before the check runs
    (["emulate", "--json", "{file}/x.json", "--", "bench"], "is a file, not a folder"),
    (["show", "ring", "--json", "{file}/x.json"], "is a file, not a folder"),
    (["train", "--checkpoint-dir", "{file}"], "is a file, not a folder"),  # not at the first save
    (["train", "--compression", "powersgd", "--powersgd-rank", "0"], "--powersgd-rank must be at least 1"),
    (["train", "--powersgd-rank", "2"], "--powersgd-rank configures --compression powersgd; add it"),
    (
        ["train", "--compression", "powersgd", "--powersgd-start-iter", "-1"],
        "--powersgd-start-iter must be 0",
    ),
    (["train", "--checkpoint-dir", "{run}"], "pass --resume to continue that run, or name a new folder"),
    (["train", "--resume", "--model", "vit", "--checkpoint-dir", "{run}"], "holds model 'mlp', not 'vit'"),
    (["train", "--nproc", "100000"], "GB per worker) and this machine has"),
]
# Every command's output paths: a folder that does not exist is refused before any work, not made.
OUTPUTS = [
    ["bench", "--json"], ["bench", "--plot"], ["plan", "--json"], ["plan", "--plot"],
    ["sim", "--cluster", "dgx-a100", "--json"],
    ["sim", "--cluster", "dgx-a100", "--sweep", "sizes", "--plot"],
    ["train", "--json"], ["train", "--trace"], ["show", "ring", "--json"], ["show", "ring", "--png"],
    ["trace", "{tmp}", "--json"], ["trace", "{tmp}", "--plot"], ["doctor", "--json"],
    ["checkpoint", "inspect", "{run}", "--json"], ["emulate", "--json"], ["calibrate", "{file}", "--out"],
]  # fmt: skip
CASES += [
    ([*args, "{tmp}/no/such/out.png" if args[-1] in ("--png", "--plot") else "{tmp}/no/such/out.json"],
     "the folder {tmp}/no/such does not exist; create it")
    for args in OUTPUTS
]  # fmt: skip
if not torch.cuda.is_available():
    CASES.append((["bench", "--device", "cuda"], "needs a CUDA GPU and this machine has none"))


def _one_sentence(output: str) -> str:
    """The message inside typer's error box, joined back into one line."""
    lines = [line.strip(" │╭╮╰╯─") for line in output.splitlines() if line.startswith("│")]
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


@pytest.mark.parametrize(("args", "fragment"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_exits_2_with_one_sentence(tmp_path: Path, args: list[str], fragment: str) -> None:
    _exits_2(tmp_path, args, fragment)


def test_a_bad_transport_setting_exits_2(tmp_path: Path) -> None:
    fragment = "RINGTREE_TRANSPORT='tcp' is not a transport; use one of shm, p2p"
    _exits_2(tmp_path, ["bench"], fragment, {"RINGTREE_TRANSPORT": "tcp"})


def test_a_bad_mailbox_poll_setting_exits_2(tmp_path: Path) -> None:
    fragment = "RINGTREE_MAILBOX_SPIN_US='soon' is not a number of microseconds; set it to e.g. 500"
    _exits_2(tmp_path, ["bench"], fragment, {"RINGTREE_MAILBOX_SPIN_US": "soon"})


def test_a_bad_pin_setting_exits_2(tmp_path: Path) -> None:
    fragment = "RINGTREE_PIN_RANKS='yes' is not 0 or 1; set it to 0 to never pin ranks to cores"
    _exits_2(tmp_path, ["bench"], fragment, {"RINGTREE_PIN_RANKS": "yes"})


def _exits_2(tmp_path: Path, args: list[str], fragment: str, env: dict[str, str] | None = None) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "bin").write_bytes(b"\xa8\x00\xff\x01")  # not UTF-8: what a .pt or .png starts like
    (tmp_path / "last.pt").write_text("not a checkpoint")  # what --resume finds in {tmp}
    run = tmp_path / "run"  # another run's checkpoint folder: a dense checkpoint of the mlp
    checkpoint.save(run, {"model_name": "mlp", "model": {}, "step": 3})
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    names = {"{tmp}": tmp_path, "{file}": tmp_path / "file", "{bin}": tmp_path / "bin", "{run}": run}
    filled, fragment = [_fill(a, names) for a in args], _fill(fragment, names)
    result = CliRunner().invoke(app, filled, env=env)
    message = _one_sentence(result.output)
    assert result.exit_code == 2, result.output
    assert fragment in message, message
    assert "Traceback" not in result.output
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == before  # nothing written, nothing left over


def _fill(text: str, names: dict[str, Path]) -> str:
    for key, path in names.items():
        text = text.replace(key, str(path))
    return text


def test_many_more_workers_than_cores_is_a_warning_with_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ringtree.cli.train import _check_machine

    _check_machine(16, 2, 64.0)
    said = capsys.readouterr().err
    assert said.startswith("warning: --nproc 16 workers share 2 core(s), 0.12 of a core each"), said
    _check_machine(4, 2, 64.0)  # two per core: no word
    assert capsys.readouterr().err == ""
    refused = r"--nproc 16 needs about 6.4 GB .* has 2.0 GB available; use --nproc 5 or fewer"
    with pytest.raises(ValueError, match=refused):
        _check_machine(16, 2, 2.0)
