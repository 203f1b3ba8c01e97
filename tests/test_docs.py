"""The documentation: its fast commands run, its reference pages are the code's, its summaries are
the data's, and the guide stays short and free of work history."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from docs_commands import ROOT, Block, Shown, blocks, commands, shown
from typer.testing import CliRunner

from ringtree.cli import reference
from ringtree.cli.app import app

DOCS = ROOT / "docs"
GUIDE = [
    p for p in DOCS.rglob("*.md") if not {"results", "reference", "data"} & set(p.relative_to(DOCS).parts)
]


@pytest.mark.parametrize("block", blocks(ci_only=True), ids=lambda b: b.name)
def test_the_fast_documented_commands_run(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (one torch import for all): `make docs-check` runs every block as a shell script."""
    monkeypatch.chdir(tmp_path)
    for argv in commands(block):
        assert argv[0] == "ringtree", f"{block.name}: a ci block holds ringtree commands only, not {argv[0]}"
        result = CliRunner().invoke(app, argv[1:])
        assert result.exit_code == 0, f"{block.name}: {' '.join(argv)}\n{result.output[-3000:]}"


def test_there_are_runnable_commands_in_the_readme_and_the_guide() -> None:
    pages = {b.page for b in blocks()}
    assert {"README.md", "docs/getting-started.md", "docs/how-to/plan-a-cluster.md"} <= pages


def test_the_reference_pages_are_generated_from_the_code(tmp_path: Path) -> None:
    for path in reference.write(tmp_path):
        committed = DOCS / "reference" / path.name
        assert committed.read_text() == path.read_text(), (
            f"docs/reference/{path.name} is stale: run `python -m ringtree.cli.reference docs/reference`"
        )


def test_every_command_and_option_is_in_the_reference() -> None:
    text = (DOCS / "reference" / "commands.md").read_text()
    for name in ("bench", "doctor", "emulate", "show", "plan", "sim", "calibrate", "train"):
        assert f"## ringtree {name}" in text
    assert "`--plot`" in text and "`--zero`" in text and "`--virtual-stages`" in text


def test_the_accuracy_summary_is_the_data_s() -> None:
    table = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "accuracy_summary.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert table.strip() in (DOCS / "results" / "planner-accuracy.md").read_text()


def test_the_guide_has_no_work_history_and_short_pages() -> None:
    words = r"\bissue ?#?\d+|\bround \d|\bwave \d|\bddp[34]\b|^#+ what changed|merged on main"
    history = re.compile(words, re.I | re.M)
    for path in [*GUIDE, ROOT / "README.md", ROOT / "README.ko.md"]:
        text = path.read_text()
        assert not history.search(text), f"{path}: {history.search(text)}"
        if path.parent.is_relative_to(DOCS):
            assert text.count("\n") <= 320, f"{path} has {text.count(chr(10))} lines; split it"


def test_the_version_is_the_package_s() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"ringtree {importlib.metadata.version('ringtree')}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{importlib.metadata.version('ringtree')}]" in changelog


@pytest.mark.parametrize("example", shown(), ids=lambda s: s.name)
def test_the_shown_commands_print_what_the_page_shows(
    example: Shown, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `$ COMMAND` with its output under it: the output is today's (all of it, or where the page
    abridges it with `...` or `# tail`, each line it shows)."""
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(example.command, comments=True)
    env = dict(a.split("=", 1) for a in argv if re.match(r"^[A-Z_]+=", a))
    argv = [a for a in argv if not re.match(r"^[A-Z_]+=", a)]
    assert argv[0] == "ringtree"
    result = CliRunner().invoke(app, argv[1:], env={"COLUMNS": "80", **env})
    assert result.exit_code == 0, result.output
    actual = [line.rstrip() for line in result.output.splitlines()]
    expected = [line.rstrip() for line in example.output.splitlines()]
    cut = [line for line in expected if "..." in line or line.startswith("(")]  # where the page abridges
    if "# tail" in example.command or cut:
        missing = [line for line in expected if line not in cut and line not in actual]
        assert not missing, f"{example.name}: not in today's output: {missing[:3]}"
    else:
        assert actual == expected, f"{example.name}: the page shows another output; today's:\n{result.output}"


def test_the_readmes_link_to_files_that_exist() -> None:
    for readme in ("README.md", "README.ko.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / readme).read_text()):
            if "://" not in target:
                assert (ROOT / target).exists(), f"{readme} links to {target}, which does not exist"


def test_the_readmes_stay_a_quick_start_and_the_makefile_points_at_their_sections() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("README.md", "README.ko.md"):
        assert len((ROOT / name).read_text().splitlines()) <= 150, name
    for section in re.findall(r"README\.md, '([^']+)'", (ROOT / "Makefile").read_text()):
        assert f"## {section}\n" in readme, section
