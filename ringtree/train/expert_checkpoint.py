"""Expert-parallel runs in sharded checkpoints: every expert under its global index.

Expert parallelism keeps experts ep_rank x E/ep .. (ep_rank + 1) x E/ep - 1 of every MoE layer on
a rank, so its local expert j is global expert ep_rank x E/ep + j. As torchtitan saves an EP run
(its experts are DTensors sharded on dim 0 over the EP mesh), each expert weight is one logical
tensor `model.<name>` of the dense shape [E, ...]; a rank writes the box of the experts it holds at
offset ep_rank x E/ep along dim 0 (a TP-like cut of dim 0 in ringtree.train.layout's terms), and
their optimizer states the same way under `optim.<kind>.<name>`: whole with --zero 0, the flat range
of its ZeRO shard over the expert-data-parallel (EDP) group otherwise. The EDP replicas write equal
boxes, which torch.distributed.checkpoint's planner deduplicates. A run at another EP degree, ZeRO
stage or world size asks for the boxes it now holds; one without EP reads whole tensors.

Beside the experts, a --zero 0 run writes each of its other parameters (TP-local, whole) the same
way, and every run its persistent buffers (the routers' expert bias among them), the random state,
the optimizer's step, ExpertParallel's count of dropped and routed token copies and, under --amp
fp16, the loss scaler's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtree.parallel.expert import ExpertParallel
from ringtree.train import sharded_checkpoint
from ringtree.train.checkpoint import CheckpointError
from ringtree.train.layout import Place, chunks
from ringtree.train.sharded_checkpoint import Key, State, Wanted

COPIES = "expert_parallel.copies"  # [dropped, routed] token copies over the run, per pipeline stage
SCALER = "expert_parallel.scaler"  # --amp fp16's loss scale and its growth tracker


@dataclasses.dataclass(frozen=True)
class Part:
    """Elements [start, start + len(values)) of a (local) tensor keyed `prefix.<place.name>`;
    `values` is a flat view into the live tensor (a parameter or an optimizer state)."""

    prefix: str
    place: Place
    shape: tuple[int, ...]
    start: int
    values: torch.Tensor

    @property
    def fqn(self) -> str:
        return f"{self.prefix}.{self.place.name}"


def expert_places(places: dict[int, Place], experts: ExpertParallel) -> dict[int, Place]:
    """`places` with every split expert weight cut on dim 0 as EP cut it (rank ep_rank of ep)."""
    if experts.ep == 1:
        return places
    split = {id(p) for p in experts.params}
    return {
        k: dataclasses.replace(v, dim=0, stride=1, rank=experts.ep_rank, tp=experts.ep) if k in split else v
        for k, v in places.items()
    }


def _whole(prefix: str, p: torch.Tensor, place: Place, values: torch.Tensor) -> Part:
    return Part(prefix, place, tuple(p.shape), 0, values.detach().view(-1))


def expert_parts(
    experts: ExpertParallel,
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    kinds: list[str],
    owned: set[int] | None,
    create: bool = False,
) -> Iterator[Part]:
    """The experts' weights (whole) and their optimizer states `kinds` (whole, or this rank's ZeRO
    range of them), of the experts this rank's pipeline stage trains (`owned`: ids; None: all).
    create: make the missing states (zeros, for a load to fill); else parts only of existing ones."""
    mine = [p for p in experts.params if owned is None or id(p) in owned]
    for p in mine:
        yield _whole("model", p, places[id(p)], p)
    shards = experts.shards
    if shards is None:
        for p in mine:
            for kind in kinds:
                if (state := _state(optimizer, p, kind, create)) is not None:
                    yield _whole(f"optim.{kind}", p, places[id(p)], state)
        return
    lo, hi, offset = shards.rank * shards.size, (shards.rank + 1) * shards.size, 0
    for p in shards.params:
        a, c = max(offset, lo), min(offset + p.numel(), hi)
        if a < c and (owned is None or id(p) in owned):
            for kind in kinds:
                if (flat := _state(optimizer, shards.shard, kind, create)) is not None:
                    yield Part(
                        f"optim.{kind}", places[id(p)], tuple(p.shape), a - offset, flat[a - lo : c - lo]
                    )
        offset += p.numel()


def dense_parts(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    places: dict[int, Place],
    kinds: list[str],
    create: bool = False,
) -> Iterator[Part]:
    """Parameters the optimizer steps whole (--zero 0), with their optimizer states `kinds`."""
    for p in params:
        yield _whole("model", p, places[id(p)], p)
        for kind in kinds:
            if (state := _state(optimizer, p, kind, create)) is not None:
                yield _whole(f"optim.{kind}", p, places[id(p)], state)


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor, kind: str, create: bool) -> torch.Tensor | None:
    """The optimizer's state `kind` of p, flat; where it has none yet, zeros (create) or None."""
    state = optimizer.state[p]
    if kind not in state:
        if not create:
            return None
        state[kind] = torch.zeros_like(p)
    value: torch.Tensor = state[kind]
    return value.view(-1)


def kinds_of(optimizer: torch.optim.Optimizer) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The optimizer's per-element state kinds (AdamW: exp_avg, exp_avg_sq) and its scalars (step)."""
    kinds: set[str] = set()
    scalars: dict[str, torch.Tensor] = {}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1 and v.shape != p.shape:
                scalars[k] = v.detach().cpu().clone()
            elif isinstance(v, torch.Tensor) and v.shape == p.shape:
                kinds.add(k)
    return sorted(kinds), scalars


def boxes(parts: list[Part]) -> tuple[dict[Key, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The parts as boxes of the dense tensors (host copies) and each tensor's dense shape."""
    out: dict[Key, torch.Tensor] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    for part in parts:
        sizes[part.fqn] = part.place.shape
        for c in chunks(part.place, part.shape, part.start, part.values.numel()):
            out[(part.fqn, c.offsets)] = c.view(part.values).detach().cpu().clone()
    return out, sizes


def wanted(parts: list[Part], saved: set[str]) -> tuple[Wanted, list[tuple[Part, torch.Tensor]]]:
    """The boxes to read for `parts` (those the checkpoint holds), and where each part's values land."""
    want: Wanted = {}
    fills = []
    for part in parts:
        if part.fqn not in saved:
            continue
        flat = torch.full((part.values.numel(),), float("nan"))
        shape = part.shape
        want.setdefault(part.fqn, []).extend(
            (c.offsets, c.view(flat)) for c in chunks(part.place, shape, part.start, flat.numel())
        )
        fills.append((part, flat))
    return want, fills


@torch.no_grad()
def fill(fills: list[tuple[Part, torch.Tensor]]) -> None:
    for part, flat in fills:
        part.values.copy_(flat.to(part.values))


def from_dense(want: Wanted, state: dict[str, Any], dense: list[tuple[str, tuple[int, ...]]]) -> None:
    """Fill the wanted boxes from a dense checkpoint (model and optimizer state_dicts, the optimizer's
    keyed by the position of the parameter in `dense`)."""
    position = {name: j for j, (name, _) in enumerate(dense)}
    optim = state["optimizer"]["state"]
    for fqn, items in want.items():
        prefix, _, name = fqn.partition(".")
        if prefix == "model":
            full = state["model"][name]
        else:
            kind, _, name = name.partition(".")
            full = optim[position[name]][kind]
        for offsets, box in items:
            box.copy_(full[tuple(slice(o, o + z) for o, z in zip(offsets, box.shape, strict=True))])


def save_copies(experts: ExpertParallel, stage: int) -> dict[str, torch.Tensor]:
    return {f"{COPIES}.{stage}": experts.copies.clone()}


def load_copies(experts: ExpertParallel, stage: int, saved: dict[str, Any]) -> None:
    """Restore the run's dropped and routed token counts (the summary's tokens_dropped)."""
    value = saved.get(f"{COPIES}.{stage}")
    if isinstance(value, torch.Tensor):
        experts.copies.copy_(value)


# -- what the checkpointer calls -------------------------------------------------------------


@dataclasses.dataclass
class Share:
    """One rank's share of an expert-parallel run: what it writes and reads."""

    experts: ExpertParallel
    optimizer: torch.optim.Optimizer
    places: dict[int, Place]
    owned: set[int] | None  # ids of the parameters this rank's pipeline stage trains; None: all
    dense: list[nn.Parameter]  # the other parameters the optimizer steps whole (--zero 0; else none)
    buffers: dict[str, torch.Tensor]  # this stage's persistent buffers, by their name in the model
    stage: int  # this rank's pipeline stage
    scaler: torch.amp.GradScaler | None = None  # --amp fp16's loss scaler

    def parts(self, kinds: list[str], create: bool = False) -> list[Part]:
        """The share's parts: its parameters and their optimizer states `kinds` (the missing ones
        made, zero, with `create`: what a load fills)."""
        return [
            *dense_parts(self.dense, self.optimizer, self.places, kinds, create),
            *expert_parts(self.experts, self.optimizer, self.places, kinds, self.owned, create),
        ]

    def stepped(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps for this share (their scalars, Adam's step, restored)."""
        shards = self.experts.shards
        experts = [shards.shard] if shards is not None else [p for p in self.experts.params if self.mine(p)]
        return [*self.dense, *experts]

    def mine(self, p: torch.Tensor) -> bool:
        return self.owned is None or id(p) in self.owned


def state(share: Share, sharded: State | None) -> State:
    """(plain entries, boxes, dense shapes) of the share, joined to a ZeRO run's `sharded` ones."""
    kinds, scalars = kinds_of(share.optimizer)
    out, sizes = boxes(share.parts(kinds))
    plain: dict[str, Any] = {"rng": torch.get_rng_state()}
    plain |= {f"buffer.{k}": v.detach().cpu().clone() for k, v in share.buffers.items()}
    plain |= {f"optim_scalar.{k}": v for k, v in scalars.items()}
    plain |= save_copies(share.experts, share.stage)
    if share.scaler is not None and share.scaler.is_enabled():
        scaler = share.scaler.state_dict()
        plain |= {f"{SCALER}.{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in scaler.items()}
    if sharded is not None:
        plain |= sharded[0]
        out |= sharded[1]
        sizes |= sharded[2]
    return plain, out, sizes


def load(share: Share, path: Path) -> None:
    """Fill the share from a sharded checkpoint saved at any EP degree, ZeRO stage and world size
    (a ZeRO run's other parameters are load_sharded's, which also restores the random state)."""
    saved = sharded_checkpoint.tensors(path)
    kinds = sorted({k.split(".")[1] for k in saved if k.startswith("optim.")})
    want, fills = _wanted(share, kinds, set(saved), path)
    extras = sharded_checkpoint.plain_entries(path)
    sharded_checkpoint.read(path, extras, want)
    _apply(share, fills, extras)


def load_dense(
    share: Share, state: dict[str, Any], dense: list[tuple[str, tuple[int, ...]]], path: Path
) -> None:
    """Fill the share from a dense checkpoint (a run without EP and --zero 0 wrote it)."""
    optim = state["optimizer"]["state"]
    saved = {f"model.{k}" for k in state["model"]}
    saved |= {
        f"optim.{k}.{name}"
        for j, (name, _) in enumerate(dense)
        for k, v in optim.get(j, {}).items()
        if isinstance(v, torch.Tensor) and v.dim()
    }
    kinds = sorted({k.split(".")[1] for k in saved if k.startswith("optim.")})
    want, fills = _wanted(share, kinds, saved, path)
    from_dense(want, state, dense)
    extras: dict[str, Any] = {f"buffer.{k}": v for k, v in state["model"].items() if k in share.buffers}
    if "rng" in state:
        extras["rng"] = state["rng"]
    extras |= {
        f"optim_scalar.{k}": v
        for s in state["optimizer"]["state"].values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and not v.dim()
    }
    _apply(share, fills, extras)


def _wanted(
    share: Share, kinds: list[str], saved: set[str], path: Path
) -> tuple[Wanted, list[tuple[Part, torch.Tensor]]]:
    parts = share.parts(kinds, create=True)
    missing = next((p.place.name for p in parts if p.prefix == "model" and p.fqn not in saved), None)
    if missing is not None:
        raise CheckpointError(f"{path} has no values for parameter {missing}")
    return wanted(parts, saved)


@torch.no_grad()
def _apply(share: Share, fills: list[tuple[Part, torch.Tensor]], extras: dict[str, Any]) -> None:
    """The read values into the parameters, optimizer states, buffers; the scalars, counts, rng."""
    fill(fills)
    for k, v in extras.items():
        if k.startswith("optim_scalar."):
            for t in share.stepped():
                share.optimizer.state[t][k.removeprefix("optim_scalar.")] = v.clone()
        elif k.startswith("buffer.") and k.removeprefix("buffer.") in share.buffers:
            share.buffers[k.removeprefix("buffer.")].copy_(v)
    load_copies(share.experts, share.stage, extras)
    scaler = {k.removeprefix(f"{SCALER}."): v for k, v in extras.items() if k.startswith(f"{SCALER}.")}
    if share.scaler is not None and scaler:
        kinds = {k: type(v) for k, v in share.scaler.state_dict().items()}
        share.scaler.load_state_dict({k: kinds.get(k, float)(v.item()) for k, v in scaler.items()})
    if share.experts.shards is not None:
        share.experts.shards.refresh()
    if "rng" in extras:
        torch.set_rng_state(extras["rng"])
