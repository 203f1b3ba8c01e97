"""Checkpoints: written atomically (temporary file, then rename), read with weights_only=True."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "last.pt"


def save(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` to directory/last.pt so that a crash leaves either the old file or the new one."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{LATEST}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a checkpoint is an ordinary file
        os.replace(tmp, folder / LATEST)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / LATEST


def load(directory: str | Path) -> dict[str, Any] | None:
    """The state in directory/last.pt, or None when there is none yet (tensors only: weights_only)."""
    path = Path(directory) / LATEST
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} is not a ringtree checkpoint (no 'step'); delete it or pick another folder")
    return state
