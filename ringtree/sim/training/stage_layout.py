"""Uneven pipeline layouts: what each of the PP x VP model chunks holds.

Megatron-Core's `pipeline_model_parallel_layout` names every chunk's contents in one string: `E` the
embedding, `t` a transformer layer, `m` a multi-token-prediction layer, `L` the output layer and loss,
`|` the end of a chunk, `x*k` and `(...)*k` repetition. Chunk i runs on pipeline rank i mod PP as
its virtual stage i // PP (Megatron-Core's `PipelineParallelLayerLayout`), and the layers are
numbered in chunk order. DeepSeek-V3's 61 layers on PP 4 x VP 4 are `Et*4|(t*4|)*14tmL` in
Megatron-Bridge's recipes: 4 layers and the embedding in the first chunk, 4 in each of the next 14,
and the last layer, the MTP layer and the loss in the last.

`--first-stage-layers` and `--last-stage-layers` (Megatron-Core's `num_layers_in_first_pipeline_stage`
and `num_layers_in_last_pipeline_stage`) write the same thing shorter: the first (last) pipeline rank
holds that many layers, the other ranks share the rest evenly, and with VP each rank's layers split
evenly over its chunks (Megatron-Core refuses the split where they do not divide; so does this).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = "EtmL"
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_SINGLE = re.compile(r"([^|])\*(\d+)")


@dataclass(frozen=True)
class Chunk:
    """One model chunk: its transformer layers (from layer `start`), MTP layers, embedding and loss."""

    start: int
    layers: int
    mtp: int = 0
    embedding: bool = False
    loss: bool = False


def expand(text: str) -> list[str]:
    """The chunks of a layout string, repetitions unrolled (`Et*2|(t|)*2tL` -> Ett, t, t, tL)."""
    s = text.replace(",", "").replace(" ", "")
    while _GROUP.search(s):
        s = _GROUP.sub(lambda g: g.group(1) * int(g.group(2)), s)
    s = _SINGLE.sub(lambda g: g.group(1) * int(g.group(2)), s)
    bad = sorted(set(s) - set(KINDS + "|"))
    if bad:
        raise ValueError(
            f"--pp-layout {text!r} has {''.join(bad)!r}: write it with E (embedding), t (layer), m (MTP "
            "layer), L (loss), | (chunk end), x*k and (...)*k, as Megatron-Core's pipeline layout"
        )
    return s.split("|")


def parse(text: str, layers: int, pp: int, virtual_stages: int) -> tuple[Chunk, ...]:
    """The PP x VP chunks of `text`, checked against the model's layers, or a ValueError saying why."""
    parts = expand(text)
    want = pp * virtual_stages
    if len(parts) != want:
        raise ValueError(
            f"--pp-layout {text!r} has {len(parts)} chunks but --pp {pp} x --virtual-stages "
            f"{virtual_stages} needs {want}: one | between each two chunks"
        )
    found = sum(p.count("t") for p in parts)
    if found != layers:
        raise ValueError(
            f"--pp-layout {text!r} places {found} transformer layers (t) but the model has {layers}; "
            "place each layer once"
        )
    joined = "".join(parts)
    if joined.count("E") != 1 or "E" not in parts[0]:
        raise ValueError(f"--pp-layout {text!r} must hold the embedding (E) once, in its first chunk")
    if joined.count("L") != 1 or "L" not in parts[-1]:
        raise ValueError(f"--pp-layout {text!r} must hold the loss (L) once, in its last chunk")
    if "m" in joined and "t" in joined[joined.index("m") :]:
        raise ValueError(f"--pp-layout {text!r} puts an MTP layer (m) before a transformer layer (t)")
    chunks, start = [], 0
    for p in parts:
        n = p.count("t")
        chunks.append(Chunk(start, n, p.count("m"), "E" in p, "L" in p))
        start += n
    return tuple(chunks)


def edges(layers: int, pp: int, virtual_stages: int, first: int, last: int) -> str:
    """The layout string of `--first-stage-layers first --last-stage-layers last` (0: not given)."""
    if min(first, last) < 0 or pp < 2:
        raise ValueError(
            "--first-stage-layers and --last-stage-layers must be at least 1 and need --pp 2 or more"
        )
    given = [n for n in (first, last) if n]
    middle, rest = pp - len(given), layers - sum(given)
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        raise ValueError(
            f"--first-stage-layers {first} and --last-stage-layers {last} leave {rest} of the {layers} "
            f"layers for {middle} other stages: they must share them evenly"
        )
    even = rest // max(middle, 1)
    per = [first or even, *[even] * (pp - 2), last or even]
    if any(n % virtual_stages for n in per):
        raise ValueError(
            f"with --virtual-stages {virtual_stages} each stage's layers ({', '.join(map(str, per))}) "
            "must split evenly over its chunks; change the first or last stage's layers"
        )
    chunks = [["t" * (per[j] // virtual_stages)] for _ in range(virtual_stages) for j in range(pp)]
    chunks[0].insert(0, "E")
    chunks[-1].append("L")
    return "|".join("".join(c) for c in chunks)
