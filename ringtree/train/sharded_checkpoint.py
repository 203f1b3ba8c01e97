"""Sharded checkpoints with torch.distributed.checkpoint: every rank writes its own pieces, keyed in
the dense model's coordinates, so that any layout reads them back.

A save is a folder `step-<N>.dcp` written by DCP. Each parameter is one logical tensor,
`model.<name>`, of its dense shape; each rank writes the boxes it holds of it (its ZeRO shard's
flat range, cut by TP, as ringtree.train.layout maps it), and the optimizer's states the same way
under `optim.<kind>.<name>`. A run at another TP, PP, ZeRO stage or DP size asks for the boxes
it now holds and DCP's resharding reads the overlapping pieces; a dense model asks for whole
tensors. `ringtree.json` inside the folder records the step, the model, the layout it was saved
at and every file's size and SHA-256. The folder is written as `.step-<N>.dcp.tmp` and renamed,
with its record, once every rank finished: a save cut short (or a crash during an asynchronous
one) leaves the previous checkpoint the newest usable one. Loading walks from the newest to the
oldest, skipping (and reporting) one whose files are missing or differ from the record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ringtree.parallel.mismatch import check_keys
from ringtree.parallel.sharded import ShardedDataParallel
from ringtree.parallel.shards import FlatBucket, local
from ringtree.train.checkpoint import CheckpointError
from ringtree.train.layout import Chunk, Place, chunks

RECORD = "ringtree.json"
_DIR = re.compile(r"^step-(\d+)\.dcp$")
Key = tuple[str, tuple[int, ...]]  # (fqn, offsets in the dense tensor)
Wanted = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]  # fqn -> (offsets, box to fill)
State = tuple[dict[str, Any], dict[Key, torch.Tensor], dict[str, tuple[int, ...]]]  # plain, boxes, shapes


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of a parameter (flattened, TP-local), at shard[lo : lo + length]."""

    place: Place
    shape: tuple[int, ...]  # the TP-local parameter's
    start: int
    bucket: FlatBucket
    lo: int
    length: int

    def chunks(self) -> list[Chunk]:
        return chunks(self.place, self.shape, self.start, self.length)


def pieces(sdp: ShardedDataParallel, places: dict[int, Place]) -> Iterator[Piece]:
    """This rank's pieces of every parameter: where its shard of each bucket cuts the parameters."""
    for b in sdp.buckets:
        lo, hi = b.block.start, b.block.stop
        for p, off in zip(b.params, b.offsets, strict=True):
            a, c = max(off, lo), min(off + p.numel(), hi)
            if a < c:
                yield Piece(places[id(p)], tuple(p.shape), a - off, b, a - lo, c - a)


# -- torch.distributed.checkpoint with boxes of dense tensors ------------------------------------


class _BoxSaver(DefaultSavePlanner):
    """The default planner, plus this rank's boxes of the dense tensors (DCP dedups equal ones)."""

    def __init__(self, boxes: dict[Key, torch.Tensor], sizes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.boxes, self.sizes = boxes, sizes

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [_write_item(fqn, at, t, self.sizes[fqn]) for (fqn, at), t in self.boxes.items()]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.sizes:
            return self.boxes[(index.fqn, tuple(index.offset or ()))]
        return super().lookup_object(index)


def _write_item(fqn: str, at: tuple[int, ...], t: torch.Tensor, size: tuple[int, ...]) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(at)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(at), sizes=t.size()),
            properties=TensorProperties.create_from_tensor(t),
            size=torch.Size(size),
        ),
    )


class _BoxLoader(DefaultLoadPlanner):
    """The default planner, plus boxes of dense tensors to fill (DCP reads what overlaps them)."""

    def __init__(self, wanted: Wanted) -> None:
        super().__init__(allow_partial_load=True)
        self.wanted = wanted

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = list(plan.items)
        for fqn, boxes in self.wanted.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if isinstance(md, TensorStorageMetadata):
                mine = [ChunkStorageMetadata(torch.Size(at), t.size()) for at, t in boxes]
                items += create_read_items_for_chunk_list(fqn, md, mine)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.wanted:
            return self.wanted[index.fqn][index.index or 0][1]
        return super().lookup_tensor(index)


def read(
    path: Path, plain: dict[str, Any], wanted: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]
) -> None:
    """Fill `plain`'s tensors and the wanted boxes from the checkpoint (this rank alone)."""
    with warnings.catch_warnings():  # dcp warns that no_dist means one process: it does
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(plain, checkpoint_id=str(path), planner=_BoxLoader(wanted), no_dist=True)


# -- saving ----------------------------------------------------------------------------------


def save(
    directory: str | Path,
    step: int,
    model_name: str,
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    buffers: dict[str, torch.Tensor],
    keep: int,
    layout: dict[str, int] | None = None,
    async_group: dist.ProcessGroup | None = None,
) -> Future[Any] | None:
    """Every rank writes its pieces (collective over the world); rank 0 seals and prunes.

    With `async_group` (a process group of its own) the files are written by DCP's asynchronous
    save while training goes on: the returned future is done once the save is sealed."""
    return save_state(
        directory, step, model_name, state_of(sdp, optimizer, places, buffers), keep, layout, async_group
    )


def save_state(
    directory: str | Path,
    step: int,
    model_name: str,
    state: State,
    keep: int,
    layout: dict[str, int] | None = None,
    async_group: dist.ProcessGroup | None = None,
) -> Future[Any] | None:
    """Write (plain entries, this rank's boxes, each boxed tensor's dense shape) as the folder of
    step `step` (collective over the world); what `save` does once it has the state."""
    folder = Path(directory)
    final = folder / f"step-{step:08d}.dcp"
    tmp = folder / f".{final.name}.tmp"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before its rename
    dist.barrier()
    plain, boxes, sizes = state
    record = {"step": step, "model_name": model_name, "layout": layout or {}}

    def seal() -> None:
        if dist.get_rank() == 0:
            _seal(folder, tmp, final, record, keep)

    if async_group is None:
        dcp_save(plain, checkpoint_id=str(tmp), planner=_BoxSaver(boxes, sizes))
        seal()
        dist.barrier()
        return None
    future: Future[Any] = dcp_async_save(  # type: ignore[assignment]
        plain, checkpoint_id=str(tmp), planner=_BoxSaver(boxes, sizes), process_group=async_group
    )
    sealed: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        try:
            f.result()
            seal()
            sealed.set_result(None)
        except BaseException as e:  # carried to the training thread, which waits for it
            sealed.set_exception(e)

    future.add_done_callback(done)
    return sealed


def _seal(folder: Path, tmp: Path, final: Path, record: dict[str, Any], keep: int) -> None:
    """Record every file's size and SHA-256, rename the folder into place, drop the oldest."""
    files = {f.name: digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    (tmp / RECORD).write_text(json.dumps(record | {"files": files}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in folders(folder)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def state_of(
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    buffers: dict[str, torch.Tensor],
) -> State:
    """(plain entries, this rank's boxes, each boxed tensor's dense shape), copied to the host."""
    plain: dict[str, Any] = {"rng": torch.get_rng_state()}
    plain |= {f"buffer.{k}": v.detach().cpu().clone() for k, v in buffers.items()}
    boxes: dict[Key, torch.Tensor] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for piece in pieces(sdp, places):
        cut = slice(piece.lo, piece.lo + piece.length)
        tensors = {"model": piece.bucket.local.detach()[cut]}
        for kind, value in optimizer.state.get(piece.bucket.shard, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == piece.bucket.shard.shape:
                tensors[f"optim.{kind}"] = local(value)[cut]
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                plain[f"optim_scalar.{kind}"] = (
                    value.detach().cpu().clone()
                )  # Adam's step: the same everywhere
        for prefix, values in tensors.items():
            fqn = f"{prefix}.{piece.place.name}"
            sizes[fqn] = piece.place.shape
            for chunk in piece.chunks():
                boxes[(fqn, chunk.offsets)] = chunk.view(values).cpu().clone()
    return plain, boxes, sizes


def digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


# -- finding -----------------------------------------------------------------------------------


def folders(folder: Path) -> list[Path]:
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
    found = folders(folder)
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
        if digest(file) != expected:
            raise CheckpointError(
                f"{file} differs from the one recorded when saved (a shard of another save, or damaged)"
            )
    return record


def find(
    directory: str | Path, report: Callable[[str], None] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest usable sharded checkpoint (folder, record); None when there is none at all."""
    problems = []
    for path in folders(Path(directory)):
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


def tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor the checkpoint holds: fqn -> (dense shape, dtype)."""
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if any(k.startswith("param/") for k in meta):
        raise CheckpointError(
            f"{path} was written by an earlier ringtree, which keyed each rank's flat pieces (param/<name>/"
            "<start>); resume it with that version, or start fresh in another --checkpoint-dir"
        )
    return {
        k: (tuple(m.size), m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }


def model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model's parameters and buffers the checkpoint holds, with their dense shapes."""
    out = {}
    for k, (shape, _) in tensors(path).items():
        for prefix in ("model.", "buffer."):
            if k.startswith(prefix):
                out[k.removeprefix(prefix)] = shape
    return out


def check_model(path: Path, dense: dict[str, tuple[int, ...]]) -> None:
    """MismatchError naming the first tensor the checkpoint and the model (dense shapes) disagree on."""
    saved = {k: torch.empty(v, device="meta") for k, v in model_shapes(path).items()}
    model = {k: torch.empty(v, device="meta") for k, v in dense.items()}
    check_keys(model, saved, f"the checkpoint {path}")


def plain_entries(path: Path) -> dict[str, torch.Tensor]:
    """The entries outside the boxed tensors: rng, optimizer scalars, buffers, expert counts (empty,
    to be filled)."""
    out = {}
    for k, (shape, dtype) in tensors(path).items():
        if k == "rng" or k.startswith(("optim_scalar.", "buffer.", "expert_parallel.")):
            out[k] = torch.empty(shape, dtype=dtype)
    return out


def load_sharded(
    path: Path,
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    module: nn.Module,
) -> None:
    """Resume a ZeRO run (any TP, PP, DP size and stage) from a sharded checkpoint."""
    saved = tensors(path)
    kinds = sorted({k.split(".")[1] for k in saved if k.startswith("optim.")})
    mine = list(pieces(sdp, places))
    flats: dict[tuple[str, int], torch.Tensor] = {}  # (prefix, piece) -> its values, to be filled
    wanted: Wanted = {}
    for i, piece in enumerate(mine):
        for prefix in ("model", *(f"optim.{k}" for k in kinds)):
            fqn = f"{prefix}.{piece.place.name}"
            if fqn not in saved:
                if prefix == "model":
                    raise CheckpointError(f"{path} has no values for parameter {piece.place.name}")
                continue
            flat = flats[(prefix, i)] = torch.full((piece.length,), float("nan"))
            wanted.setdefault(fqn, []).extend((c.offsets, c.view(flat)) for c in piece.chunks())
    extras = plain_entries(path)
    read(path, extras, wanted)
    with torch.no_grad():
        for (prefix, i), flat in flats.items():
            piece = mine[i]
            cut = slice(piece.lo, piece.lo + piece.length)
            if prefix == "model":
                piece.bucket.local[cut] = flat
                piece.bucket.version = -1  # the whole parameters are gathered again before use
                continue
            state = optimizer.state[piece.bucket.shard]
            local(state.setdefault(prefix[6:], torch.zeros_like(piece.bucket.shard)))[cut] = flat
        for b in {p.bucket.index: p.bucket for p in mine}.values():
            for k, v in extras.items():
                if k.startswith("optim_scalar."):
                    optimizer.state[b.shard][k.removeprefix("optim_scalar.")] = v.clone()
    load_buffers(module, {k.removeprefix("buffer."): v for k, v in extras.items() if k.startswith("buffer.")})
    torch.set_rng_state(extras["rng"])


def dense_state(
    path: Path, dense: list[tuple[str, tuple[int, ...]]], optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """A sharded checkpoint assembled into the dense form `checkpoint.load` returns (`dense`: the
    dense model's parameters in order, which keys the optimizer's state)."""
    saved = tensors(path)
    kinds = sorted({k.split(".")[1] for k in saved if k.startswith("optim.")})
    wanted: Wanted = {}
    for name, shape in dense:
        for prefix in ("model", *(f"optim.{k}" for k in kinds)):
            if f"{prefix}.{name}" in saved:
                wanted[f"{prefix}.{name}"] = [((0,) * len(shape), torch.zeros(shape))]
    extras = plain_entries(path)
    read(path, extras, wanted)
    model = {k.removeprefix("buffer."): v for k, v in extras.items() if k.startswith("buffer.")}
    scalars = {k.removeprefix("optim_scalar."): v for k, v in extras.items() if k.startswith("optim_scalar.")}
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for j, (name, _) in enumerate(dense):
        if f"model.{name}" not in wanted:
            raise CheckpointError(f"{path} has no values for parameter {name}")
        model[name] = wanted[f"model.{name}"][0][1]
        state = {k: wanted[f"optim.{k}.{name}"][0][1] for k in kinds if f"optim.{k}.{name}" in wanted}
        if state:
            per_param[j] = state | {k: v.clone() for k, v in scalars.items()}
    record = json.loads((path / RECORD).read_text())
    groups = [] if optimizer is None else optimizer.state_dict()["param_groups"]
    return {
        "step": record["step"],
        "model_name": record["model_name"],
        "model": model,
        "optimizer": {"state": per_param, "param_groups": groups},
        "rng": extras["rng"],
    }


def consolidate(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's state_dict from a sharded checkpoint (every parameter and buffer, dense)."""
    shapes = tensors(path)
    names = [k.removeprefix("model.") for k in shapes if k.startswith("model.")]
    state = dense_state(path, [(n, shapes[f"model.{n}"][0]) for n in names], None)
    return dict(state["model"])


def from_dense(
    state: dict[str, Any],
    sdp: ShardedDataParallel,
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    module: nn.Module,
) -> None:
    """Resume a ZeRO run from a dense checkpoint (model and optimizer state_dicts); `places` covers
    the whole model, in its parameters' order (which keys the dense optimizer state)."""
    position = {pl.name: j for j, pl in enumerate(places.values())}
    dense_opt = state["optimizer"]["state"]
    scalars = {
        k: v for s in dense_opt.values() for k, v in s.items() if isinstance(v, torch.Tensor) and not v.dim()
    }
    with torch.no_grad():
        for piece in pieces(sdp, places):
            cut = slice(piece.lo, piece.lo + piece.length)
            name = piece.place.name
            own = dense_opt.get(position[name], {})
            sources = {"model": state["model"][name]} | {
                k: v for k, v in own.items() if isinstance(v, torch.Tensor) and v.dim()
            }
            for kind, full in sources.items():
                flat = torch.empty(piece.length)
                for c in piece.chunks():
                    c.view(flat).copy_(
                        full[tuple(slice(o, o + z) for o, z in zip(c.offsets, c.sizes, strict=True))]
                    )
                if kind == "model":
                    piece.bucket.local[cut] = flat
                    piece.bucket.version = -1
                else:
                    opt_state = optimizer.state[piece.bucket.shard]
                    local(opt_state.setdefault(kind, torch.zeros_like(piece.bucket.shard)))[cut] = flat
            for kind, value in scalars.items():
                optimizer.state[piece.bucket.shard][kind] = value.clone()
    load_buffers(module, state["model"])


def load_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    own = dict(module.named_buffers())
    with torch.no_grad():
        for k, v in buffers.items():
            if k in own:
                own[k].copy_(v)
