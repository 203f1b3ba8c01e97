"""Each command's documented JSON keys (ringtree.json_keys, the registry docs/reference/json.md is
generated from), and a JSON object's keys to hold them to."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ringtree.json_keys import OUTPUTS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def documented(page: str, command: str) -> list[str]:
    """The registry's keys for COMMAND; for an output not in it yet, the table after
    `<!-- json-keys: COMMAND -->` in docs/PAGE (move such a table into ringtree/json_keys.py)."""
    if command in OUTPUTS:
        return list(OUTPUTS[command].keys)
    text = (DOCS / page).read_text()
    table = text.split(f"<!-- json-keys: {command} -->", 1)[1].strip().split("\n\n", 1)[0]
    return [m.group(1) for line in table.splitlines()[2:] if (m := re.match(r"\| `([^`]+)` \|", line))]


def keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The object's keys, and those of its lists' items as `list[].key`."""
    out = []
    for k, v in data.items():
        out.append(prefix + k)
        if isinstance(v, list) and v and isinstance(v[0], dict):
            out += keys(v[0], f"{prefix}{k}[].")
    return out
