"""Finding a run's trace files and reading them: every refusal names the file and the problem."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any

SUFFIXES = (".json", ".json.gz")
_RANK_IN_NAME = re.compile(r"(?i)rank[-_]?(\d+)")


def discover(paths: list[Path]) -> list[Path]:
    """The trace files named, and those directly inside the folders named, in order."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
            if not inside:
                raise ValueError(
                    f"{path} holds no trace files (*.json or *.json.gz); name the folder of one run"
                )
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f"{path} does not exist; name trace files or the folder holding them")
    return found


def load(path: Path) -> dict[str, Any]:
    """The trace document, or a ValueError naming the file and what is wrong with it."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (EOFError, gzip.BadGzipFile, zlib.error):
        raise ValueError(f"{path} is a truncated or damaged gzip file; copy the trace again") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        where = (
            f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        )
        raise ValueError(
            f"{path} is not JSON{where}; pass a torch.profiler trace (.json or .json.gz)"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace (no traceEvents list); pass a torch.profiler trace")
    if not any(isinstance(e, dict) and e.get("ph") == "X" for e in doc["traceEvents"]):
        raise ValueError(
            f"{path} holds no events (traceEvents has no timed 'X' events); profile at least one step"
        )
    return doc


def rank_of(doc: dict[str, Any], path: Path) -> int:
    """The trace's rank: its distributedInfo, else its file name (rank-3, rank3_trace), else refused."""
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    m = _RANK_IN_NAME.search(path.name)
    if m:
        return int(m.group(1))
    raise ValueError(
        f"{path}: cannot tell its rank (no distributedInfo.rank in the trace, no rank-N in its name); "
        "rename it, e.g. rank0.json"
    )
