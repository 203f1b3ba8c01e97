"""Byte sizes as people write them: 8, 4K, 64M, 1.5G (binary multiples, as nccl-tests reads them)."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """'64M' -> 67108864. Accepts K/M/G/T with an optional trailing B or iB."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _UNITS and s[-1:] else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot read size {text!r}; write it like 8, 4K, 64M or 1G") from None
    if value < 0:
        raise ValueError(f"size must not be negative, got {text!r}")
    return int(value * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """67108864 -> '64M'; sizes that are not whole multiples keep one decimal."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit]
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes:.0f}"
