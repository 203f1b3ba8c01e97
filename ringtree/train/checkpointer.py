"""One checkpointer for every layout: what the trainer calls to save a step and to resume.

`Checkpointer.save(step)` writes the run's state where --checkpoint-dir says: a dense, verified
`step-<N>.pt` (ringtree.train.checkpoint) gathered from every TP shard and pipeline stage, or
under --zero a torch.distributed.checkpoint folder every rank writes its shard of
(ringtree.train.sharded_checkpoint). `resume()` loads the newest usable one of either kind into
whatever layout this run has and returns the step it continues from (None: from the start).

With --checkpoint-async a save copies the state to the host and returns: DCP's async_save (on a
process group of its own, so its collectives never interleave with training's) or, for a dense
checkpoint, rank 0's writer thread finishes it while training goes on. The next save, and the
end of the run, first wait for the one in flight. `waits` holds the seconds the loop waited per
save (the summary's checkpoint_s). `inspect` and `consolidate` read a checkpoint without a run.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ringtree.parallel import DistributedDataParallel, Mesh
from ringtree.parallel.mismatch import check_keys
from ringtree.processes import restart_count
from ringtree.train import checkpoint, expert_checkpoint, layout, sharded_checkpoint, tensor_parallel
from ringtree.train.config import TrainConfig
from ringtree.train.parallelize import Parallelized
from ringtree.train.pipelining import gather_stages
from ringtree.train.techniques import MixedPrecision


class Checkpointer:
    """Save and resume one rank's share of a run (every rank calls both: they are collective)."""

    def __init__(
        self,
        cfg: TrainConfig,
        net: nn.Module,
        optimizer: torch.optim.Optimizer,
        parallel: Parallelized,
        mesh: Mesh,
        amp: MixedPrecision,
        model_name: str,
        dense: list[tuple[str, tuple[int, ...]]],
    ) -> None:
        """dense: the dense model's parameters (name, shape) in order, taken before TP cut it."""
        self.cfg, self.net, self.optimizer, self.parallel = cfg, net, optimizer, parallel
        self.mesh, self.amp, self.model_name, self.dense = mesh, amp, model_name, dense
        self.rank = dist.get_rank()
        self.layout = {"world_size": dist.get_world_size(), "dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}
        self.layout |= {"cp": getattr(mesh, "cp", 1), "zero": cfg.zero}
        if cfg.ep > 1:
            self.layout["ep"] = cfg.ep
        self.waits: list[float] = []
        self.pending: Future[Any] | None = None
        asynchronous = bool(cfg.checkpoint_async) and cfg.checkpoint_dir is not None
        # a group of its own: async_save's collectives run on a thread beside training's
        sharded = cfg.zero or cfg.ep > 1
        self.async_group = dist.new_group(backend="gloo") if asynchronous and sharded else None
        self.writer = ThreadPoolExecutor(1, "ringtree-checkpoint") if asynchronous else None

    @cached_property
    def places(self) -> dict[int, layout.Place]:
        """Where each of this rank's parameters sits in the dense model (asked for on first use)."""
        places = layout.places(self.net, self.dense)
        experts = self.parallel.experts
        return places if experts is None else expert_checkpoint.expert_places(places, experts)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The dense model's parameters and buffers with their shapes (what a checkpoint must hold)."""
        buffers = tensor_parallel.persistent_buffers(self.net)
        return dict(self.dense) | {n: tuple(b.shape) for n, b in buffers.items()}

    @property
    def directory(self) -> Path | None:
        return None if self.cfg.checkpoint_dir is None else Path(self.cfg.checkpoint_dir)

    # -- resuming ---------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Load the newest usable checkpoint when --resume asks for it, or when torch's elastic agent
        restarted this group after a failure; the step it continues from."""
        cfg = self.cfg
        if not (cfg.resume or restart_count()) or cfg.checkpoint_dir is None:
            return None
        report = print if self.rank == 0 else None
        sharded = sharded_checkpoint.newest(cfg.checkpoint_dir, report)
        if sharded is not None:
            return self._resume_sharded(*sharded)
        state = checkpoint.load(cfg.checkpoint_dir, report=report)
        if state is None:
            if self.rank == 0:
                print(f"# no checkpoint in {cfg.checkpoint_dir} yet: starting from step 0")
            return None
        name = self.model_name
        if state["model_name"] != name:
            raise ValueError(
                f"the checkpoint in {cfg.checkpoint_dir} holds model {state['model_name']!r}, not {name!r}; "
                f"pass --model {state['model_name']} or another --checkpoint-dir"
            )
        check_keys(_Shape.of(self.shapes()), state["model"], f"the checkpoint in {cfg.checkpoint_dir}")
        zero, share = self.parallel.sharded, self._share()
        if zero is not None:  # a dense checkpoint, cut into this rank's shards
            sharded_checkpoint.from_dense(state, zero, self.optimizer, self.places, self.net)
        if share is not None:  # and this rank's experts cut from it
            expert_checkpoint.load_dense(share, state, self.dense, Path(cfg.checkpoint_dir))
        elif zero is None:
            tensor_parallel.load(self.net, self.optimizer, self.dense, state)
        if "rng" in state:  # the run continues with the random stream it would have had
            torch.set_rng_state(state["rng"])
        if self.amp.scaler is not None and "scaler" in state:
            self.amp.scaler.load_state_dict(state["scaler"])
        self._load_powersgd(state.get("powersgd"))
        return int(state["step"])

    def _load_powersgd(self, saved: list[list[dict[str, Any]]] | None) -> None:
        """This rank's PowerSGD states (error buffers, P and Q memories, iteration) from a dense
        checkpoint whose ranks held the same buckets; otherwise they start afresh (the model
        resumes all the same: only the compression's memory of past steps is lost)."""
        mine = self.parallel.powersgd
        if not mine:
            return
        entries = None if saved is None or len(saved) != dist.get_world_size() else saved[self.rank]
        buckets = [_bucket_sizes(d) for d in mine]
        if entries is None or [e["buckets"] for e in entries] != buckets:
            if self.rank == 0:
                print("# the checkpoint holds no PowerSGD state for these buckets: its memories start afresh")
            return
        device = next(self.net.parameters()).device
        for ddp, entry in zip(mine, entries, strict=True):
            assert ddp.powersgd is not None
            ddp.powersgd.load_state_dict(entry["state"], device)

    def _resume_sharded(self, path: Any, record: dict[str, Any]) -> int:
        """Continue from a torch.distributed.checkpoint folder (saved with --zero, at any DP size)."""
        cfg, name = self.cfg, self.model_name
        if record["model_name"] != name:
            raise ValueError(
                f"the checkpoint {path} holds model {record['model_name']!r}, not {name!r}; "
                f"pass --model {record['model_name']} or another --checkpoint-dir"
            )
        sharded_checkpoint.check_model(path, self.shapes())
        zero, share = self.parallel.sharded, self._share()
        if share is not None:  # expert parallel: every rank reads its experts' boxes (and the rest)
            if zero is not None:
                sharded_checkpoint.load_sharded(path, zero, self.optimizer, self.places, self.net)
            expert_checkpoint.load(share, path)
        elif zero is None:  # --zero 0: the pieces assembled into the dense state
            state = sharded_checkpoint.dense_state(path, self.dense, self.optimizer)
            state["optimizer"] = self._owned_state(state["optimizer"])
            tensor_parallel.load(self.net, self.optimizer, self.dense, state)
            torch.set_rng_state(state["rng"])
            sharded_checkpoint.load_scaler(self.amp.scaler, state.get("scaler", {}))
        else:
            scaler = self.amp.scaler
            sharded_checkpoint.load_sharded(path, zero, self.optimizer, self.places, self.net, scaler)
        if self.rank == 0 and cfg.progress:
            print(f"# resumed from {path} (step {record['step']})")
        return int(record["step"])

    def _owned_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A dense optimizer state_dict cut to this rank's stage's parameters (all without --pp)."""
        owned = self._owned()
        if owned is None:
            return state
        return {**state, "state": {i: s for i, s in state["state"].items() if i in owned}}

    # -- saving -----------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Write the state after `step` optimizer steps (nothing without --checkpoint-dir); the
        seconds the loop waited for it go to `waits`."""
        if self.cfg.checkpoint_dir is None:
            return
        start = time.perf_counter()
        self.wait()
        self._save(step)
        self.waits.append(time.perf_counter() - start)

    def wait(self) -> None:
        """Wait for the save in flight, if any (its error, if it failed, is raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """The end of the run: the last save done, on every rank."""
        self.wait()
        if self.writer is not None:
            self.writer.shutdown(wait=True)
            dist.barrier()

    def checkpoint_s(self, device: torch.device) -> float | None:
        """The median seconds the loop waited per save, on the slowest rank (collective); None: none."""
        mine = torch.tensor([statistics.median(self.waits) if self.waits else -1.0], device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return None if mine.item() < 0 else float(mine.item())

    def _save(self, step: int) -> None:
        cfg = self.cfg
        zero, share = self.parallel.sharded, self._share()
        if share is not None:  # expert parallel: every rank writes its experts (and its other pieces)
            sharded = (
                None if zero is None else sharded_checkpoint.state_of(zero, self.optimizer, self.places, {})
            )
            self.pending = sharded_checkpoint.save_state(
                cfg.checkpoint_dir,  # type: ignore[arg-type]
                step,
                self.model_name,
                expert_checkpoint.state(share, sharded),
                cfg.get("keep_checkpoints"),
                self.layout,
                self.async_group,
            )
            return
        if zero is not None:  # every rank writes its own shard
            own = {id(b) for b in (zero.module.buffers())}
            kept = tensor_parallel.persistent_buffers(self.net)  # not those a model recomputes
            buffers = {n: b for n, b in self.net.named_buffers() if id(b) in own and n in kept}
            keep = cfg.get("keep_checkpoints")
            self.pending = sharded_checkpoint.save(
                cfg.checkpoint_dir,  # type: ignore[arg-type]
                step,
                self.model_name,
                zero,
                self.optimizer,
                self.places,
                buffers,
                keep,
                self.layout,
                self.async_group,
                self.amp.scaler,
            )
            return
        self._save_dense(step)

    def _save_dense(self, step: int) -> None:
        """Gather the dense state (every TP shard, every stage) and write it from rank 0."""
        cfg, pipe = self.cfg, self.parallel.pipe
        if pipe is not None:
            gather_stages(pipe.stages, self.mesh.pp_rank, self.mesh.pp_group)
        powersgd = self._gather_powersgd()
        model = tensor_parallel.model_state(self.net, self.dense)  # dense: resumes at any --tp
        optimizer = tensor_parallel.optimizer_state(self.net, self.optimizer, self._owned())
        if pipe is not None:
            optimizer = tensor_parallel.union_over(optimizer, self.mesh.pp_group, cfg.pp)
        if self.rank == 0:
            state = {
                "step": step,
                "model_name": self.model_name,
                "model": {k: v.cpu() for k, v in model.items()},
                "optimizer": tensor_parallel.to_cpu(optimizer),
                "rng": torch.get_rng_state(),
                "layout": self.layout,
            }
            if self.amp.scaler is not None:
                state["scaler"] = self.amp.scaler.state_dict()
            if powersgd is not None:
                state["powersgd"] = powersgd
            keep = cfg.get("keep_checkpoints")
            if self.writer is not None:  # a copy (training changes the tensors), written meanwhile
                copy = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)
                self.pending = self.writer.submit(checkpoint.save, cfg.checkpoint_dir, copy, keep)  # type: ignore[arg-type]
                return
            checkpoint.save(cfg.checkpoint_dir, state, keep=keep)  # type: ignore[arg-type]
        if self.writer is None:
            dist.barrier()  # no rank runs ahead of a checkpoint that may still be written

    def _gather_powersgd(self) -> list[list[dict[str, Any]]] | None:
        """Every rank's PowerSGD states, indexed by global rank (collective; None without PowerSGD):
        the error buffers differ from rank to rank, so rank 0 writes them all."""
        if self.cfg.compression != "powersgd":
            return None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [_powersgd_entry(d) for d in self.parallel.powersgd])
        return gathered

    def _share(self) -> expert_checkpoint.Share | None:
        """This rank's share of an expert-parallel run (None without EP: the other layouts' paths)."""
        experts = self.parallel.experts
        if experts is None or experts.ep == 1:
            return None
        params = list(self.net.parameters())
        owned = self._owned()
        ids = None if owned is None else {id(params[i]) for i in owned}
        split = {id(p) for p in experts.params}
        dense = []
        if self.parallel.sharded is None:  # --zero 0: the optimizer steps the other parameters whole
            dense = [p for p in params if id(p) not in split and (ids is None or id(p) in ids)]
        pipe = self.parallel.pipe
        stage = self.net if pipe is None else pipe.stages[self.mesh.pp_rank]
        own = {id(b) for b in stage.buffers()}
        kept = tensor_parallel.persistent_buffers(self.net)
        buffers = {n: b for n, b in self.net.named_buffers() if id(b) in own and n in kept}
        return expert_checkpoint.Share(
            experts, self.optimizer, self.places, ids, dense, buffers, self.mesh.pp_rank, self.amp.scaler
        )

    def _owned(self) -> set[int] | None:
        """Indices (in net.parameters()) of the parameters this rank's stage trains; None: all."""
        pipe = self.parallel.pipe
        if pipe is None:
            return None
        mine = {id(p) for p in pipe.stages[self.mesh.pp_rank].parameters()}
        return {i for i, p in enumerate(self.net.parameters()) if id(p) in mine}


def _powersgd_entry(ddp: DistributedDataParallel) -> dict[str, Any]:
    """What a checkpoint keeps of one DDP's PowerSGD: its state, and the buckets it belongs to."""
    assert ddp.powersgd is not None
    return {"buckets": _bucket_sizes(ddp), "state": ddp.powersgd.state_dict()}


def _bucket_sizes(ddp: DistributedDataParallel) -> list[int]:
    """The elements of each of a DDP's buckets: what PowerSGD's per-bucket memories are keyed by."""
    return [b.buffer.numel() for b in ddp.buckets]


def check_resumable(cfg: TrainConfig, model: nn.Module) -> None:
    """Raise, in the launching process, when --resume finds no usable checkpoint (CheckpointError)
    or one whose tensors do not fit `model` (MismatchError, naming the first). Without --resume,
    a folder that already holds checkpoints is refused: a fresh run would mix with that run's
    and prune them (unless torch's elastic agent restarted this run, which continues its own)."""
    if cfg.checkpoint_dir is None:
        return
    if not cfg.resume:
        _check_fresh(Path(cfg.checkpoint_dir))
        return
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    sharded = sharded_checkpoint.newest(cfg.checkpoint_dir)
    if sharded is not None:
        _check_model_name(str(sharded[0]), sharded[1].get("model_name"), cfg.model)
        sharded_checkpoint.check_model(sharded[0], shapes)
        return
    state = checkpoint.load(cfg.checkpoint_dir)
    if state is not None:
        _check_model_name(f"in {cfg.checkpoint_dir}", state.get("model_name"), cfg.model)
        check_keys(_Shape.of(shapes), state["model"], f"the checkpoint in {cfg.checkpoint_dir}")


def _check_fresh(folder: Path) -> None:
    """Refuse a fresh run into a folder that holds another run's checkpoints."""
    held = sharded_checkpoint.folders(folder)[:1] + (checkpoint.steps(folder)[:1] if folder.is_dir() else [])
    if held and not restart_count():
        raise checkpoint.CheckpointError(
            f"--checkpoint-dir {folder} already holds a run's checkpoints ({held[0].name}): pass "
            "--resume to continue that run, or name a new folder for a fresh one"
        )


def _check_model_name(where: str, held: str | None, name: str) -> None:
    """The sentence the workers would say (resume), said once by the launcher."""
    if held is not None and held != name:
        raise ValueError(
            f"the checkpoint {where} holds model {held!r}, not {name!r}; "
            f"pass --model {held} or another --checkpoint-dir"
        )


class _Shape:
    """A shape that check_keys reads as a tensor's."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    @staticmethod
    def of(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return {k: _Shape(v) for k, v in shapes.items()}


# -- what a checkpoint holds, and one dense file of it -----------------------------------------


def locate(path: str | Path) -> Path:
    """The checkpoint `path` names: itself (a step-N.dcp folder or step-N.pt file), or the newest
    in a --checkpoint-dir folder; CheckpointError when there is none there."""
    path = Path(path)
    if path.is_file() or path.name.endswith(".dcp"):
        return path
    folders = sharded_checkpoint.folders(path)
    files = checkpoint.steps(path) if path.is_dir() else []
    newest = [p for p in (folders[:1] + files[:1])]
    if not newest:
        raise checkpoint.CheckpointError(
            f"{path} holds no checkpoint (no step-<N>.pt or step-<N>.dcp); pass a --checkpoint-dir "
            "that a run wrote into"
        )
    return max(newest, key=lambda p: int(p.name[5:].split(".")[0]))


def inspect(path: str | Path) -> dict[str, Any]:
    """Step, model, layout saved at, every file's size and SHA-256, and whether it verifies."""
    found = locate(path)
    if found.is_dir():
        problem, record = None, _sharded_record(found)
        try:
            sharded_checkpoint.verify(found)
        except checkpoint.CheckpointError as e:
            problem = str(e)  # the record (model, step, layout) still says what was saved
        names = record.get("files") or {
            f.name: None for f in found.iterdir() if f.name != sharded_checkpoint.RECORD
        }
        files = [{"name": n} | _on_disk(found / n) for n in sorted(names)]
        return _report(found, "sharded", record, files, problem)
    problem, state = None, {}
    try:
        state = checkpoint.read(found)
    except checkpoint.CheckpointError as e:
        problem = str(e)
    size, digest = checkpoint.digest(found) if found.exists() else (0, "")
    files = [{"name": found.name, "bytes": size, "sha256": digest}]
    return _report(found, "dense", state, files, problem)


def _sharded_record(folder: Path) -> dict[str, Any]:
    """The folder's record as saved, whatever its shards hold now ({} when it cannot be read)."""
    try:
        record: dict[str, Any] = json.loads((folder / sharded_checkpoint.RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _on_disk(file: Path) -> dict[str, Any]:
    """A file's size and SHA-256 as it is now (a damaged shard shows its own; a missing one 0 bytes)."""
    return sharded_checkpoint.digest(file) if file.is_file() else {"bytes": 0, "sha256": "missing"}


def _report(
    path: Path, kind: str, record: dict[str, Any], files: list[dict[str, Any]], problem: str | None
) -> dict[str, Any]:
    step = record.get("step")
    return {
        "path": str(path),
        "kind": kind,
        "step": None if step is None else int(step),
        "model_name": record.get("model_name"),
        "layout": record.get("layout"),
        "files": files,
        "bytes": sum(int(f["bytes"]) for f in files),
        "verifies": problem is None,
        "problem": problem,
    }


def consolidate(path: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's whole model as one dense state_dict file that plain torch.load reads
    (CheckpointError, naming the file, for a damaged checkpoint: nothing is written then)."""
    found = locate(path)
    if found.is_dir():
        sharded_checkpoint.verify(found)
        model = sharded_checkpoint.consolidate(found)
    else:
        model = checkpoint.read(found)["model"]
    target = Path(out)
    checkpoint.write_atomically(target, lambda f: torch.save(model, f))
    return target
