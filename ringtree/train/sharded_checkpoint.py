"""Sharded checkpoints (--zero 1-3) with torch.distributed.checkpoint: every rank writes its own shard.

A save is a folder `step-<N>.dcp` written by `dcp.save`: each rank's file holds its pieces of
every parameter and optimizer state, keyed `<kind>/<name>/<start>` (kind: `param`, `exp_avg`,
...; start: the piece's first element in the parameter's flattened order). So any DP size, any
ZeRO stage, and ZeRO 0 (dense) load it back: a rank asks only for the pieces that overlap what it
now owns. `ringtree.json` inside the folder records the step, the model and every file's size
and SHA-256. The folder is written as `.step-<N>.dcp.tmp` and renamed, with its record, once
every rank finished: a save cut short leaves the previous checkpoint the newest usable one.
Loading walks from the newest to the oldest, skipping (and reporting) one whose files are
missing or differ from the record; when none is usable it names the files (CheckpointError).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ringtree.parallel.sharded import ShardedDataParallel
from ringtree.parallel.shards import FlatBucket, local
from ringtree.train.checkpoint import CheckpointError

RECORD = "ringtree.json"
_DIR = re.compile(r"^step-(\d+)\.dcp$")
Fetch = Callable[[str, str, int, int], torch.Tensor | None]  # (kind, name, start, length) -> values


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of parameter `name` (flattened), at shard[lo : lo + length]."""

    name: str
    start: int
    bucket: FlatBucket
    lo: int
    length: int


def pieces(sdp: ShardedDataParallel, names: dict[int, str]) -> Iterator[Piece]:
    """This rank's pieces of every parameter: where its shard of each bucket cuts the parameters."""
    for b in sdp.buckets:
        lo, hi = b.block.start, b.block.stop
        for p, off in zip(b.params, b.offsets, strict=True):
            a, c = max(off, lo), min(off + p.numel(), hi)
            if a < c:
                yield Piece(names[id(p)], a - off, b, a - lo, c - a)


# -- saving ----------------------------------------------------------------------------------


def save(
    directory: str | Path,
    step: int,
    model_name: str,
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    buffers: dict[str, torch.Tensor],
    keep: int,
) -> Path:
    """Every rank writes its pieces (collective over the world); rank 0 seals and prunes; the folder."""
    folder = Path(directory)
    final = folder / f"step-{step:08d}.dcp"
    tmp = folder / f".{final.name}.tmp"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before its rename
    dist.barrier()
    dcp_save(_state(sdp, optimizer, names, buffers), checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        files = {f.name: _digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        record = {"step": step, "model_name": model_name, "files": files}
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _folders(folder)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _state(
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    buffers: dict[str, torch.Tensor],
) -> dict[str, Any]:
    state: dict[str, Any] = {"rng": torch.get_rng_state()}
    state |= {f"buffer/{k}": v.detach().cpu() for k, v in buffers.items()}
    for piece in pieces(sdp, names):
        cut = slice(piece.lo, piece.lo + piece.length)
        key = f"{piece.name}/{piece.start}"
        state[f"param/{key}"] = piece.bucket.local.detach()[cut].cpu().clone()
        for kind, value in optimizer.state.get(piece.bucket.shard, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == piece.bucket.shard.shape:
                state[f"{kind}/{key}"] = local(value)[cut].cpu().clone()
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                state[f"scalar/{kind}"] = value.detach().cpu().clone()  # Adam's step: the same everywhere
    return state


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


# -- finding -----------------------------------------------------------------------------------


def _folders(folder: Path) -> list[Path]:
    """The sharded checkpoint folders, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def newest(
    directory: str | Path, report: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest usable sharded checkpoint, when the folder's newest save is sharded, else None
    (a dense step-<N>.pt as new or newer is checkpoint.load's to read)."""
    folder = Path(directory)
    dense = [
        int(m.group(1)) for p in folder.glob("step-*.pt") if (m := re.match(r"^step-(\d+)\.pt$", p.name))
    ]
    found = _folders(folder)
    if not found or (dense and max(dense) >= int(found[0].name[5:-4])):
        return None
    return find(folder, report)


def verify(path: Path) -> dict[str, Any]:
    """The folder's record, after checking every recorded file is there with its size and checksum."""
    record_file = path / RECORD
    if not record_file.exists():
        raise CheckpointError(f"{record_file} is missing (the save did not finish)")
    record: dict[str, Any] = json.loads(record_file.read_text())
    for name, expected in record["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing (one rank's shard of the checkpoint)")
        if _digest(file) != expected:
            raise CheckpointError(
                f"{file} differs from the one recorded when saved (a shard of another save, or damaged)"
            )
    return record


def find(
    directory: str | Path, report: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest usable sharded checkpoint (folder, record); None when there is none at all."""
    problems = []
    for path in _folders(Path(directory)):
        try:
            return path, verify(path)
        except CheckpointError as e:
            problems.append(str(e))
            if report is not None:
                report(f"ringtree: skipping checkpoint {e}")
    if problems:
        raise CheckpointError(
            f"no usable checkpoint in {directory}: {'; '.join(problems)}; restore the file or delete the "
            "folder's checkpoints to start fresh"
        )
    return None


# -- loading -----------------------------------------------------------------------------------


class Saved:
    """A sharded checkpoint's pieces, read on demand (each rank reads only what it asks for)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self.sizes = {k: int(m.size[0]) for k, m in meta.items() if hasattr(m, "size") and len(m.size) == 1}
        self.scalars = [k for k in meta if k.startswith("scalar/")]
        self.buffers = [k for k in meta if k.startswith("buffer/")]
        self.index: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for key in self.sizes:
            kind, _, rest = key.partition("/")
            name, _, start = rest.rpartition("/")
            if start.isdigit():
                self.index.setdefault((kind, name), []).append((int(start), key))
        self.kinds = sorted({kind for kind, _ in self.index} - {"param"})

    def read(self, keys: list[str], shapes: dict[str, torch.Size] | None = None) -> dict[str, torch.Tensor]:
        """The tensors under `keys` (every rank on its own: no collective)."""
        if not keys:
            return {}
        meta = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        want: dict[str, Any] = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}  # type: ignore[union-attr]
        with warnings.catch_warnings():  # dcp warns that no_dist means one process: it does
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(want, checkpoint_id=str(self.path), no_dist=True)
        return want

    def fetcher(self, wanted: list[tuple[str, str, int, int]]) -> Fetch:
        """A Fetch over the saved pieces that overlap the wanted (kind, name, start, length) ranges."""
        keys = sorted(
            {
                key
                for kind, name, start, length in wanted
                for s, key in self.index.get((kind, name), [])
                if s < start + length and start < s + self.sizes[key]
            }
        )
        loaded = self.read(keys)

        def fetch(kind: str, name: str, start: int, length: int) -> torch.Tensor | None:
            out, found = torch.empty(length), 0
            for s, key in self.index.get((kind, name), []):
                a, c = max(s, start), min(s + self.sizes[key], start + length)
                if a < c and key in loaded:
                    out[a - start : c - start] = loaded[key][a - s : c - s]
                    found += c - a
            return out if found == length else None

        return fetch


def restore(
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    fetch: Fetch,
    kinds: list[str],
    scalars: dict[str, torch.Tensor],
) -> None:
    """Fill this rank's shards and their optimizer states from `fetch` (any saved layout)."""
    with torch.no_grad():
        for piece in pieces(sdp, names):
            cut = slice(piece.lo, piece.lo + piece.length)
            values = fetch("param", piece.name, piece.start, piece.length)
            if values is None:
                raise CheckpointError(f"the checkpoint has no values for parameter {piece.name}")
            piece.bucket.local[cut] = values
            piece.bucket.version = -1  # the whole parameters are gathered again before use
            state = optimizer.state[piece.bucket.shard]
            for kind in kinds:
                saved = fetch(kind, piece.name, piece.start, piece.length)
                if saved is not None:
                    local(state.setdefault(kind, torch.zeros_like(piece.bucket.shard)))[cut] = saved
            for kind, value in scalars.items():
                state[kind] = value.clone()


def load_sharded(
    path: Path,
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    module: nn.Module,
) -> None:
    """Resume a ZeRO run (any DP size) from a sharded checkpoint."""
    saved = Saved(path)
    mine = list(pieces(sdp, names))
    wanted = [(k, p.name, p.start, p.length) for p in mine for k in ("param", *saved.kinds)]
    scalars = saved.read(saved.scalars + saved.buffers + ["rng"])
    restore(
        sdp,
        optimizer,
        names,
        saved.fetcher(wanted),
        saved.kinds,
        {k.removeprefix("scalar/"): v for k, v in scalars.items() if k.startswith("scalar/")},
    )
    _load_buffers(
        module, {k.removeprefix("buffer/"): v for k, v in scalars.items() if k.startswith("buffer/")}
    )
    torch.set_rng_state(scalars["rng"])


def dense_state(path: Path, net: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A sharded checkpoint assembled into the dense form `checkpoint.load` returns (for ZeRO 0)."""
    saved = Saved(path)
    named = list(net.named_parameters())
    wanted = [(k, n, 0, p.numel()) for n, p in named for k in ("param", *saved.kinds)]
    fetch = saved.fetcher(wanted)
    extra = saved.read(saved.scalars + saved.buffers + ["rng"])
    model = {k.removeprefix("buffer/"): v for k, v in extra.items() if k.startswith("buffer/")}
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for j, (n, p) in enumerate(named):
        values = fetch("param", n, 0, p.numel())
        if values is None:
            raise CheckpointError(f"{path} has no values for parameter {n}")
        model[n] = values.view_as(p)
        state = {k: v.view_as(p) for k in saved.kinds if (v := fetch(k, n, 0, p.numel())) is not None}
        if state:
            per_param[j] = state | {k.removeprefix("scalar/"): extra[k] for k in saved.scalars}
    record = json.loads((path / RECORD).read_text())
    groups = [] if optimizer is None else optimizer.state_dict()["param_groups"]
    return {
        "step": record["step"],
        "model_name": record["model_name"],
        "model": model,
        "optimizer": {"state": per_param, "param_groups": groups},
        "rng": extra["rng"],
    }


def from_dense(
    state: dict[str, Any], sdp: ShardedDataParallel, optimizer: torch.optim.Optimizer, net: nn.Module
) -> None:
    """Resume a ZeRO run from today's dense checkpoint (model and optimizer state_dicts)."""
    named = list(net.named_parameters())
    names = {id(p): n for n, p in named}
    dense_opt = state["optimizer"]["state"]
    position = {n: j for j, (n, _) in enumerate(named)}
    kinds = sorted(
        {k for s in dense_opt.values() for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim()}
    )
    scalars = {
        k: v for s in dense_opt.values() for k, v in s.items() if isinstance(v, torch.Tensor) and not v.dim()
    }

    def fetch(kind: str, name: str, start: int, length: int) -> torch.Tensor | None:
        owner = state["model"] if kind == "param" else dense_opt.get(position[name], {})
        source = owner.get(name if kind == "param" else kind)
        return None if source is None else source.reshape(-1)[start : start + length].float()

    restore(sdp, optimizer, names, fetch, kinds, scalars)
    _load_buffers(net, {k: v for k, v in state["model"].items() if k not in position})


def _load_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    own = dict(module.named_buffers())
    with torch.no_grad():
        for k, v in buffers.items():
            if k in own:
                own[k].copy_(v)
