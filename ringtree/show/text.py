"""Short texts for the step tables: chunk lists, contributor sets, a rank's moves and holdings.

Notation (the source articles' "a0+b0 -> chunk0 (partial sum)", compressed): c3={0,1} is chunk 3
holding the partial sum of ranks 0 and 1's inputs; Σ is all p ranks' (fully reduced); →2 c3 sends
chunk 3 to rank 2; ←1 c2 (+) receives chunk 2 from rank 1 and adds it in, ←1 c2 copies it.
"""

from __future__ import annotations

from ringtree.show.steps import Move, members
from ringtree.units import format_size


def runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted values as (first, last) runs of consecutive numbers."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _join(values: list[int], prefix: str = "") -> str:
    """[0, 1, 2, 5, 6] -> '0..2,5,6' (runs of three or more shortened), each item prefixed."""
    parts = []
    for a, b in runs(values):
        parts += [f"{prefix}{a}..{b}"] if b - a >= 2 else [f"{prefix}{v}" for v in range(a, b + 1)]
    return ",".join(parts)


def chunk_list(chunks: list[int] | tuple[int, ...]) -> str:
    """[0, 1, 2, 5] -> 'c0..2,c5'."""
    return _join(list(chunks), "c")


def contributors(mask: int, p: int) -> str:
    """The ranks whose inputs a chunk holds: 'Σ' for all p, '{0,1}', or '{0..5,7}'."""
    ranks = members(mask)
    if len(ranks) == p and p > 1:
        return "Σ"
    return "{" + _join(ranks) + "}"


def moves_text(sends: tuple[Move, ...], recvs: tuple[Move, ...]) -> list[str]:
    """'→1 c3' per send and '←0 c2 (+)' per receive."""
    out = [f"→{m.peer} {chunk_list(m.chunks)}" for m in sends]
    return out + [f"←{m.peer} {chunk_list(m.chunks)}{' (+)' if m.reduce else ''}" for m in recvs]


def holds_text(holds: dict[int, int], initial: dict[int, int], p: int, most: int = 4) -> str:
    """What a rank holds, chunks with the same contributors grouped (fully reduced ones first, then
    at most `most` groups); chunks unchanged since the start are left out ('own data' when nothing
    changed, 'nothing' when it holds nothing)."""
    if not holds:
        return "nothing"
    groups: dict[int, list[int]] = {}
    for c, mask in holds.items():
        if initial.get(c) != mask:
            groups.setdefault(mask, []).append(c)
    if not groups:
        return "own data"
    full = (1 << p) - 1
    parts = sorted(groups.items(), key=lambda kv: (kv[0] != full, kv[1][0]))
    text = " ".join(f"{chunk_list(cs)}={contributors(mask, p)}" for mask, cs in parts[:most])
    return text + (f" (+{len(parts) - most} more)" if len(parts) > most else "")


def seconds(t: float) -> str:
    """0.00264 -> '2.64 ms'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns"


def size(nbytes: float) -> str:
    """Bytes as ringtree writes sizes ('3M', '1.5K'), with a B for clarity."""
    return f"{format_size(nbytes)}B"
