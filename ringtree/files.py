"""Reading the user's input files: every error names the file and says what is wrong with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_text(path: str | Path, what: str = "") -> str:
    """The file's text, or a ValueError naming it (`what`: the option or kind, e.g. '--config')."""
    file = Path(path)
    name = f"{what} {file}" if what else str(file)
    try:
        return file.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not a text file (byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8); "
            "pass the text file ringtree wrote or expects"
        ) from None
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror}") from None


def read_json(path: str | Path, what: str = "") -> Any:
    """A JSON file's data, or a ValueError naming the file and where it stops being JSON."""
    file = Path(path)
    text = read_text(file, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        name = f"{what} {file}" if what else str(file)
        raise ValueError(f"{name} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
