"""Checkpoints that never strand a run: atomic, verified, the last K kept, a bad one skipped.

A folder holds `step-<N>.pt` for the last K saves, each with a `step-<N>.json` record of its
size and SHA-256, and `last.pt`, the newest (a hard link to it, or a copy where links fail).
A save writes a temporary file, fsyncs it, renames it, reads it back to check size and checksum,
and only then points last.pt at it and removes the oldest. So a crash or a full disk leaves the
previous checkpoints as they were. Loading walks from the newest to the oldest and takes the
first that is complete and readable (`torch.load(weights_only=True)`), reporting each one it had
to skip: which file and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LATEST = "last.pt"
KEEP = 2  # the newest and one before it: a truncated newest still leaves a resumable run
_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
_STEP_RECORD = re.compile(r"^step-(\d+)\.json$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, named with the reason."""


class RecordError(CheckpointError):
    """A checkpoint whose size and SHA-256 record is missing or damaged: it cannot be verified."""


def save(directory: str | Path, state: dict[str, Any], keep: int = KEEP) -> Path:
    """Write `state` (with its "step") as the newest checkpoint; keep the last `keep`. Returns it."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 checkpoint, got {keep}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{int(state['step']):08d}.pt"
    size, digest = _write_atomically(path, lambda f: torch.save(state, f))
    _verify(path, size, digest)  # read back before anything older is removed
    _write_atomically(
        _record(path), lambda f: f.write(json.dumps({"bytes": size, "sha256": digest}).encode())
    )
    _point_latest(folder, path)
    for old in _steps(folder)[keep:]:
        old.unlink(missing_ok=True)
        _record(old).unlink(missing_ok=True)
    return path


def load(directory: str | Path, report: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The newest usable checkpoint's state, or None when the folder has no checkpoint at all.

    A newest checkpoint that is truncated or unreadable, or whose record (step-N.json) is damaged
    or missing, is reported through `report` and the one before it is used. Only when no checkpoint
    verifies is one without a usable record taken, if it loads, with a warning; when checkpoints
    exist but none is usable, CheckpointError lists them all.
    """
    found = newest(directory, report)
    return None if found is None else found[1]


def newest(
    directory: str | Path, report: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """(file, state) of the newest usable checkpoint in `directory`, as `load` chooses it."""
    problems: list[str] = []
    unrecorded: list[Path] = []  # loadable perhaps, but with no record to verify them against
    for path in _candidates(Path(directory)):
        try:
            return path, read(path)
        except RecordError as e:
            unrecorded.append(path)
            _skip(problems, report, str(e))
        except CheckpointError as e:
            _skip(problems, report, str(e))
    for path in unrecorded:
        try:
            state = read(path, verify=False)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if report is not None:
            report(f"ringtree: warning: no checkpoint verifies; using {path}, which loads but is unverified")
        return path, state
    if problems:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: {'; '.join(problems)}; delete the folder's "
            "checkpoints or choose another --checkpoint-dir to start fresh"
        )
    return None


def newest_file(directory: str | Path) -> Path | None:
    """The newest step file in `directory` (not read: each was verified when it was saved), or None."""
    folder = Path(directory)
    return next(iter(_steps(folder)), None) if folder.is_dir() else None


def _skip(problems: list[str], report: Callable[[str], None] | None, why: str) -> None:
    problems.append(why)
    if report is not None:
        report(f"ringtree: skipping checkpoint {why}")


def read(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """One checkpoint file's state, checked against its size and checksum record when it has one.

    A step file whose record is damaged or missing raises RecordError (unless verify=False);
    last.pt is checked against the record of the step it is a link to.
    """
    path = Path(path)
    if _STEP_RECORD.match(path.name):
        raise CheckpointError(
            f"{path} is a checkpoint's size and SHA-256 record, not a checkpoint; "
            f"pass {path.with_suffix('.pt')} or its folder"
        )
    record = _record_of(path)
    if verify and record is not None:
        size, digest = _read_record(path, record)
        _verify(path, size, digest)
    return _torch_load(path)


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a damaged or foreign file
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        if "weights only" in why.lower():  # torch's advice to retry unsafely is not passed on
            why = "it is damaged or holds objects other than tensors, which a safe load refuses"
        raise CheckpointError(f"{path} cannot be read as a checkpoint ({why})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(
            f"{path} is not a ringtree checkpoint (no 'step'); delete it or pick another folder"
        )
    return state


def _record_of(path: Path) -> Path | None:
    """The record that vouches for `path`: step-N.json for step-N.pt; for last.pt, the record of
    the step file it is a link to (None when it is a copy or from an older ringtree)."""
    if _STEP_FILE.match(path.name):
        return _record(path)
    if path.name != LATEST or not path.exists():
        return None
    for step in _steps(path.parent):
        if os.path.samefile(step, path):
            return _record(step)
    return None


def _read_record(path: Path, record: Path) -> tuple[int, str]:
    """(bytes, sha256) from `record`; RecordError naming it and why when it is missing or damaged."""
    try:
        fields = json.loads(record.read_text())
        return int(fields["bytes"]), str(fields["sha256"])
    except FileNotFoundError:
        why = "is missing"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        why = f"is damaged ({type(e).__name__}: {str(e)[:120]})"
    raise RecordError(f"{path}: its record {record} {why}, so it cannot be verified")


def _candidates(folder: Path) -> list[Path]:
    """The step files, newest first (each verified against its record); last.pt only when a
    folder has none (written by an older ringtree)."""
    if not folder.is_dir():
        return []  # nothing saved yet (a run that died before its first checkpoint)
    steps = _steps(folder)
    if steps:
        return steps
    return [folder / LATEST] if (folder / LATEST).exists() else []


def _steps(folder: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _record(path: Path) -> Path:
    return path.with_suffix(".json")


def _write_atomically(path: Path, write: Callable[[Any], object]) -> tuple[int, str]:
    """Write through `write(file)` to a temporary file, fsync, rename; return (bytes, sha256)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a checkpoint is an ordinary file
        size, digest = _digest(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size, digest


def _verify(path: Path, size: int, digest: str) -> None:
    actual_size, actual = _digest(path) if path.exists() else (0, "")
    if actual_size != size:
        raise CheckpointError(f"{path} is truncated ({actual_size} of {size} bytes)")
    if actual != digest:
        raise CheckpointError(f"{path} is corrupt (its SHA-256 differs from the one recorded when saved)")


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return path.stat().st_size, h.hexdigest()


def _point_latest(folder: Path, path: Path) -> None:
    """Make folder/last.pt the newest checkpoint, atomically (a hard link, or a copy)."""
    tmp = folder / f".{LATEST}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:
        shutil.copyfile(path, tmp)
    os.replace(tmp, folder / LATEST)


def digest(path: Path) -> tuple[int, str]:
    """(bytes, SHA-256) of a file: what a checkpoint's record holds."""
    return _digest(path)


def steps(folder: Path) -> list[Path]:
    """The folder's step files, newest first."""
    return _steps(folder)


def write_atomically(path: Path, write: Callable[[Any], object]) -> tuple[int, str]:
    """Write a file through `write(file)` so that a crash leaves nothing half-written there."""
    return _write_atomically(path, write)
