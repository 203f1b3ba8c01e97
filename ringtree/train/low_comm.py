"""--sync: local SGD, DiLoCo or Streaming DiLoCo around the trainer's inner optimizer, and what
each --sync (DDP's included) sent to other nodes.

The parallelize step builds DDP (or ZeRO-1/2's ShardedDataParallel) over this rank's replica
(ringtree.parallel.outer_groups cuts the mesh's DP group at the replica's edges); `attach` then
hooks the trainer's optimizer with ringtree.parallel.LocalSGD or DiLoCo over the outer group
(rank j of every replica). The trainer's loop is unchanged: a step the fp16 scaler skipped
(agreed by every rank) is counted by `skip_step`, so every replica keeps the same schedule
(ZeRO's whole parameters are then still those gathered for the step's forward). Checkpoints add
one file per rank (DIR/outer/rank{R}.pt: its local model, inner optimizer and outer state), since
replicas differ between synchronisations; resumed with the dense checkpoint of the same step,
bit-identical.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtree import comm
from ringtree.parallel import DiLoCo, DistributedDataParallel, LocalSGD, Mesh
from ringtree.parallel.outer_buckets import layers_of
from ringtree.parallel.outer_groups import ReplicaGroups, split
from ringtree.parallel.pipeline.partition import balance, param_costs
from ringtree.parallel.pipeline.partition import split as split_stages
from ringtree.parallel.sharded import ShardedDataParallel
from ringtree.schedules import Request, build
from ringtree.schedules.traffic import bytes_sent_off_node
from ringtree.topology import Topology
from ringtree.train import checkpoint
from ringtree.train.config import TrainConfig, replicas_of
from ringtree.train.pipelining import ChunkDDPs
from ringtree.train.stages import model_layers

OuterSync = DiLoCo | LocalSGD


def replicas(cfg: TrainConfig) -> int:
    """The replica groups the mesh is laid out with (1 under --sync ddp)."""
    return 1 if cfg.sync == "ddp" else replicas_of(cfg, dist.get_world_size())


def groups(cfg: TrainConfig, mesh: Mesh) -> ReplicaGroups | None:
    """The replica groups of a --sync other than ddp (made before the parallelize step builds DDP)."""
    if cfg.sync == "ddp":
        return None
    return split(mesh, mesh.shape.replicas)


def attach(
    cfg: TrainConfig,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    made: ReplicaGroups | None,
    sharded: ShardedDataParallel | None = None,
) -> OuterSync | None:
    """Hook `optimizer` (over `module`'s parameters: the model, or this rank's stage) as --sync says.

    Under --zero 1/2 (`sharded`, over the replica's group) the optimizer steps this rank's shards;
    a hook registered before the outer sync's all-gathers the stepped shards into `module`'s whole
    parameters after every step (what the next forward would do, so no extra traffic), and the
    outer sync reads and writes those: their blocks are the shards' own storage.
    """
    if made is None:
        return None
    if sharded is not None:
        assert sharded.zero < 3, "the config refuses --sync with --zero 3 (whole parameters needed)"
        optimizer.register_step_post_hook(lambda *_: sharded.gather_parameters())
    h, timeout = cfg.get("inner_steps"), cfg.get("timeout_s")
    algorithm = cfg.algorithm if cfg.algorithm in comm.algorithms("all_reduce") else "ring"
    if cfg.sync == "local-sgd":
        return LocalSGD(module, optimizer, h, made.outer, algorithm=algorithm, timeout_s=timeout)
    momentum = cfg.get("outer_momentum")
    params = [p for p in module.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, lr=cfg.get("outer_lr"), momentum=momentum, nesterov=momentum > 0)
    return DiLoCo(
        module,
        optimizer,
        outer,
        h,
        fragments=cfg.get("fragments"),
        overlap_steps=cfg.get("overlap_steps"),
        merge_alpha=cfg.get("merge_alpha"),
        outer_dtype=cfg.get("outer_dtype"),
        group=made.outer,
        shard_group=made.gather,
        algorithm=algorithm,
        timeout_s=timeout,
    )


def check(net: nn.Module, cfg: TrainConfig) -> None:
    """ValueError when --fragments cannot be cut from the model's layers (each stage's under --pp)."""
    f = cfg.get("fragments")
    if cfg.sync != "streaming-diloco" or f == 1:
        return
    if cfg.pp == 1:
        n = len(layers_of(net))
        if f > n:
            raise ValueError(f"--fragments {f} is more than the model's {n} layers; use {n} or fewer")
        return
    if cfg.get("pp_balance") != "params":
        return  # a profiled cut is known only once the layers have run: DiLoCo checks it then
    layers = model_layers(net)
    sizes = [len(layers_of(stage)) for stage in split_stages(layers, balance(param_costs(layers), cfg.pp))]
    if f > min(sizes):
        raise ValueError(
            f"--fragments {f}: under --pp {cfg.pp} each stage cuts its own layers into the fragments, and "
            f"the stages hold {sizes} layers with parameters; use --fragments {min(sizes)} or fewer "
            "so that the fragments follow the stages"
        )


# -- what crossed to other nodes --------------------------------------------------------------


def node_of(ranks: list[int]) -> list[int]:
    """The node of each global rank (torchrun's LOCAL_WORLD_SIZE ranks a node)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return [r // max(1, local) for r in ranks]


def ddp_bytes_per_sync(ddp: DistributedDataParallel | ChunkDDPs | Any) -> int | None:
    """Bytes one gradient sync of `ddp` makes this rank send to other nodes, from the buckets'
    schedules (`native`: counted as the ring); None for a data parallelism without buckets."""
    if isinstance(ddp, ChunkDDPs):
        parts = [ddp_bytes_per_sync(d) for d in ddp.ddps]
        return None if None in parts else sum(p for p in parts if p is not None)
    if not isinstance(ddp, DistributedDataParallel) or ddp.compression not in (None, "fp16", "bf16"):
        return None  # ZeRO's halves, a low-rank compression: not counted here
    group = ddp.process_group
    p = ddp.world_size
    if p == 1:
        return 0
    ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(p)]
    nodes = node_of(ranks)
    me = dist.get_rank(group)
    algorithm = "ring" if ddp.algorithm == "native" else ddp.algorithm
    itemsize_of = {"fp16": 2, "bf16": 2}
    topology = _topology(group, p)
    total = 0
    for bucket in ddp.buckets:
        itemsize = itemsize_of.get(ddp.compression or "", bucket.buffer.element_size())
        schedule = build(Request("all_reduce", algorithm, topology, bucket.buffer.numel(), itemsize))
        total += bytes_sent_off_node(schedule, me, nodes, itemsize)
    return total


def _topology(group: dist.ProcessGroup | None, p: int) -> Topology:
    """The topology ringtree's collectives build their schedule on (as ringtree.comm does)."""
    if group is None or group is dist.group.WORLD:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", p))
        if local > 0 and p % local == 0:
            return Topology(p, local)
    return Topology.single_node(p)


def outer_off_node_fraction(made: ReplicaGroups) -> float:
    """The share of an outer average's bytes that go to other nodes: its peers off this node."""
    nodes = node_of(made.outer_ranks)
    mine = nodes[made.outer_ranks.index(dist.get_rank())]
    peers = len(nodes) - 1
    return sum(n != mine for n in nodes) / peers if peers else 0.0


def metrics(
    cfg: TrainConfig,
    outer: OuterSync | None,
    made: ReplicaGroups | None,
    ddp: Any,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    """The summary's sync keys: the largest figure of any rank (a collective)."""
    per_sync = ddp_bytes_per_sync(ddp)
    inner = float("nan") if per_sync is None else float(per_sync)
    outer_bytes = exposed = 0.0
    if outer is not None and made is not None:
        outer_bytes = outer.bytes_sent * outer_off_node_fraction(made) / max(1, steps)
        exposed = (outer.exposed_s if isinstance(outer, DiLoCo) else outer.comm_s) / max(1, steps)
    figures = torch.tensor([inner + outer_bytes, exposed], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    bytes_per_step, exposed_s = figures.tolist()
    return {
        "sync": cfg.sync,
        "replicas": 1 if made is None else made.layout.replicas,
        "inner_steps": 1 if cfg.sync == "ddp" else cfg.get("inner_steps"),
        "outer_syncs": None if outer is None else outer.outer_syncs,
        "inter_node_bytes_per_step": None if bytes_per_step != bytes_per_step else bytes_per_step,
        "outer_comm_exposed_s": None if outer is None else exposed_s,
        "outer_sync_wait_s": None if outer is None else sync_wait_s(outer.sync_s, device),
    }


def sync_wait_s(mine: list[float], device: torch.device) -> float | None:
    """Seconds per outer synchronisation a rank waited for the last replica to arrive: each sync's
    all-reduce time on a rank less the least any rank took for it (the last to arrive waits for
    nobody), averaged over the ranks and the syncs. Clock-free: every rank times its own calls.
    A collective; None when no sync ran."""
    n = torch.tensor([float(len(mine))], dtype=torch.float64, device=device)
    low = n.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    if n.item() != low.item() or n.item() == 0:
        return None  # the ranks synchronised a different number of times (a resumed run): not comparable
    times = torch.tensor(mine, dtype=torch.float64, device=device)
    every = [torch.empty_like(times) for _ in range(dist.get_world_size())]
    dist.all_gather(every, times)
    table = torch.stack(every)  # (ranks, syncs)
    return float((table - table.min(dim=0).values).mean())


# -- checkpoints --------------------------------------------------------------------------------


def _file(directory: str | Path) -> Path:
    return Path(directory) / "outer" / f"rank{dist.get_rank()}.pt"


def save(
    directory: str | Path, step: int, net: nn.Module, optimizer: torch.optim.Optimizer, outer: OuterSync
) -> None:
    """This rank's local model, inner optimizer and outer state at `step`, written atomically."""
    path = _file(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "outer": outer.state_dict(),
    }
    checkpoint.write_atomically(path, lambda f: torch.save(state, f))


def load(
    directory: str | Path, step: int, net: nn.Module, optimizer: torch.optim.Optimizer, outer: OuterSync
) -> None:
    """Resume this rank's replica as `save` left it at `step` (the dense checkpoint's step)."""
    path = _file(directory)
    if not path.exists():
        raise ValueError(
            f"{path} is missing: the checkpoint in {directory} was not written by a run with this --sync "
            "and layout; resume with the run's own --sync and --nproc, or start afresh"
        )
    state = torch.load(path, weights_only=True)
    if int(state["step"]) != step:
        raise ValueError(
            f"{path} holds step {state['step']} but the checkpoint resumed is step {step}; "
            "a newer save was interrupted: remove the newest checkpoint or start afresh"
        )
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    outer.load_state_dict(state["outer"])
