"""The parallelize step: one rank's share of the model, wrapped in every parallel dim the config asks.

`parallelize(net, cfg, mesh, device, loss=..., sample=...)` applies, in this order:

1. tensor parallelism: the TP plan's column/row layers (the vit's blocks without a plan), with
   sequence parallelism when asked; the shards are made on the host, then the model is moved;
   then context parallelism (--cp): each sequence split over the CP group (the input sharded on
   its way into the first layer, the loss's labels alike), the attention over all of it;
2. activation checkpointing, of the whole model, or (under --pp) of each stage once cut: its
   segments never span two stages;
   then expert parallelism: every MoE layer keeps this rank's experts (--ep) and dispatches by
   all-to-all over its EP group (ringtree/parallel/expert.py);
3. the pipeline cut: pp stages, or pp x V chunks with this rank's V under interleaved 1F1B; the
   experts this rank reduces, steps and shards (ExpertParallel.params) become its stage's only;
4. data parallelism over the DP group (DP x CP under --cp: the CP ranks hold the same parameters
   and different tokens): ringtree's DistributedDataParallel (--zero 0) or ShardedDataParallel
   (--zero 1-3), one per stage or chunk; the master-rank `--mode dp` and the
   single-process `--mode dp-threads` in its place when asked.

The trainer runs the loop on the result and owns checkpoints, metrics and the summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ringtree.parallel import (
    ContextParallel,
    DistributedDataParallel,
    MasterDataParallel,
    Mesh,
    PowerSGD,
    ShardedDataParallel,
)
from ringtree.parallel.context import has_attention
from ringtree.parallel.dp_threads import ThreadedDataParallel
from ringtree.parallel.expert import ExpertParallel, expert_parameters, moe_layers
from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.parallel.pipeline.runtime import PipelineStage
from ringtree.schedules.pipeline import V_SHAPED, check_layers
from ringtree.train import low_comm, tensor_parallel
from ringtree.train.config import THREAD_MODES, TrainConfig, device_type
from ringtree.train.loss import TrainingLoss
from ringtree.train.pipelining import ChunkDDPs, ChunkPair, Chunks, Stage, checkpointed, cut, syncs_at_step
from ringtree.train.stages import model_layers
from ringtree.train.techniques.activation_checkpointing import enable_checkpointing

DataParallel = DistributedDataParallel | ShardedDataParallel  # --zero 0 | --zero 1-3


@dataclass
class Pipeline:
    """This rank's pipeline: every stage (sharing the model's parameters), its own, the runtime."""

    stages: list[nn.Sequential]  # interleaved: per rank, its chunks
    stage: Stage | Chunks
    runner: PipelineStage | InterleavedStage
    ddp: DataParallel | ChunkDDPs | None
    schedule: str


@dataclass
class Parallelized:
    """What parallelize made: one of model (replica), threaded or pipe; what the optimizer steps;
    the activation checkpoint segments (0: off)."""

    model: DataParallel | MasterDataParallel | None
    threaded: ThreadedDataParallel | None
    pipe: Pipeline | None
    trained: list[nn.Parameter]
    segments: int
    experts: ExpertParallel | None = None  # models with MoE layers: reduces and balances the experts

    @property
    def powersgd(self) -> list[DistributedDataParallel]:
        """This rank's DDPs (a stage's, each chunk's) that compress with PowerSGD, in order."""
        model = self.model if self.pipe is None else self.pipe.ddp
        ddps = model.ddps if isinstance(model, ChunkDDPs) else [model]
        return [d for d in ddps if isinstance(d, DistributedDataParallel) and d.powersgd is not None]

    @property
    def sharded(self) -> ShardedDataParallel | None:
        """This rank's ShardedDataParallel (--zero 1-3), if any."""
        model = self.model if self.pipe is None else self.pipe.ddp
        return model if isinstance(model, ShardedDataParallel) else None


def parallelize(
    net: nn.Module,
    cfg: TrainConfig,
    mesh: Mesh,
    device: torch.device,
    *,
    loss: TrainingLoss,
    sample: Callable[[], torch.Tensor],
) -> Parallelized:
    """Shard, checkpoint, cut and wrap `net` (in place) as `cfg` says, for this rank of `mesh`.

    loss: what a pipeline's last stage computes (its user loss_fn, what --mode dp-threads
    computes; its autocast, each stage's). sample: an input batch on `device`, asked for only
    under --pp (the cut profiles the layers on it when --pp-balance is time).
    """
    if cfg.tp > 1:  # 1. the shards are made on the host, then moved with the rest
        tensor_parallel.shard(net, cfg, mesh.tp_group)
    if cfg.cp > 1:
        loss.context = context_parallel(net, cfg, mesh)
    experts = _experts(net, cfg, mesh)
    net.to(device)
    if cfg.pp > 1:  # 2.-4. cut, then each stage checkpointed and in DP
        pipe, segments = _pipeline(net, cfg, mesh, device, loss, sample)
        if experts is not None:  # this stage's experts: the others' are their stages' to step
            experts.restrict(pipe.stages[mesh.pp_rank])
        return _result(net, None, None, pipe, segments, experts)
    body, segments = _checkpointed(net, cfg)  # 2.
    if cfg.mode == "dp":  # 4.
        master = MasterDataParallel(body, cfg.algorithm, timeout_s=cfg.get("timeout_s"))
        return _result(net, master, None, None, segments, experts)
    if cfg.mode in THREAD_MODES:
        balanced = cfg.mode.endswith("balanced")
        threaded = ThreadedDataParallel(body, thread_devices(cfg), balanced=balanced, loss_fn=loss.fn)
        return _result(net, None, threaded, None, segments, experts)
    model = data_parallel(body, cfg, mesh, bool(cfg.get("overlap")))
    return _result(net, model, None, None, segments, experts)


def _experts(net: nn.Module, cfg: TrainConfig, mesh: Mesh) -> ExpertParallel | None:
    """Expert parallelism over the data-parallel ranks (data x context parallel where CP runs), and
    the step's expert reduction and balancing; None for a model without MoE layers."""
    if not moe_layers(net) or cfg.mode != "ddp":
        return None  # --mode dp and dp-threads: one optimizer over the whole model, bias kept as is
    made = ExpertParallel(
        cfg.ep,
        mesh.shape.dp_cp_groups(),
        data_group=mesh.dp_cp_group,
        algorithm=cfg.get("a2a_algorithm"),
        overlap=bool(cfg.get("moe_shared_expert_overlap")),
    )
    made.apply(net)
    return made


def _result(
    net: nn.Module,
    model: DataParallel | MasterDataParallel | None,
    threaded: ThreadedDataParallel | None,
    pipe: Pipeline | None,
    segments: int,
    experts: ExpertParallel | None = None,
) -> Parallelized:
    """The result, with what the optimizer steps: the ZeRO shards (and the experts, which ZeRO leaves
    to ExpertParallel), or the whole model's parameters."""
    made = Parallelized(model, threaded, pipe, [], segments, experts)
    sharded = made.sharded
    if sharded is None:
        made.trained = list(net.parameters())
    elif experts is None:
        made.trained = sharded.shard_parameters() + expert_parameters(net)
    else:  # the experts' states sharded over their expert-data-parallel group
        made.trained = sharded.shard_parameters() + experts.shard_states(sharded.algorithm)
    return made


def context_parallel(net: nn.Module, cfg: TrainConfig, mesh: Mesh) -> ContextParallel:
    """`net`'s attention over the whole sequence, of which this rank of the CP group holds a share.

    The input is sharded as it enters the model (under --pp, its first layer) and, in eval mode,
    the output gathered as it leaves (the last layer); the loss shards the labels the same way.
    """
    cp = ContextParallel(mesh.cp_group, cfg.get("cp_comm"), timeout_s=cfg.get("timeout_s"))
    if cfg.pp > 1:
        layers = model_layers(net)
        cp.apply(net, layers[0], layers[-1])
    else:
        cp.apply(net)
    return cp


def data_parallel(module: nn.Module, cfg: TrainConfig, mesh: Mesh, overlap: bool) -> DataParallel:
    """`module` replicated over the DP x CP group: DDP's buckets (--zero 0), or ZeRO's shards (1-3)."""
    if cfg.zero:
        return ShardedDataParallel(
            module,
            mesh.dp_cp_group,
            zero=cfg.zero,
            algorithm=cfg.algorithm,
            bucket_cap_mb=cfg.get("bucket_mb"),
            timeout_s=cfg.get("timeout_s"),
        )
    return DistributedDataParallel(
        module,
        bucket_cap_mb=cfg.get("bucket_mb"),
        algorithm=cfg.algorithm,
        compression=compression(cfg),
        overlap=overlap,
        timeout_s=cfg.get("timeout_s"),
        process_group=mesh.dp_cp_group,
    )


def compression(cfg: TrainConfig) -> str | PowerSGD | None:
    """--compression for one DDP: powersgd is a state of its own per wrapper (stage, chunk)."""
    if cfg.compression != "powersgd":
        return cfg.compression
    return PowerSGD(rank=cfg.get("powersgd_rank"), start_iter=cfg.get("powersgd_start_iter"))


def _checkpointed(net: nn.Module, cfg: TrainConfig) -> tuple[nn.Module, int]:
    """The whole model with activation checkpointing when asked, and its segments (0: off)."""
    if not cfg.checkpoint_activations:
        return net, 0
    if isinstance(net, nn.Sequential):
        return checkpointed(net, cfg.checkpoint_segments, True)
    return net, enable_checkpointing(net, cfg.checkpoint_segments)


def _pipeline(
    net: nn.Module,
    cfg: TrainConfig,
    mesh: Mesh,
    device: torch.device,
    loss: TrainingLoss,
    sample: Callable[[], torch.Tensor],
) -> tuple[Pipeline, int]:
    """This rank's stage in DDP and the runtime that runs it; its checkpoint segments."""
    if cfg.schedule == "interleaved":
        return _interleaved(net, cfg, mesh, device, loss, sample())
    if cfg.schedule in V_SHAPED:
        return _v_shaped(net, cfg, mesh, device, loss, sample())
    stages = cut(model_layers(net), cfg.pp, cfg.get("pp_balance"), sample())
    body, segments = checkpointed(stages[mesh.pp_rank], cfg.checkpoint_segments, cfg.checkpoint_activations)
    schedule = cfg.get("schedule")
    ddp = None
    if any(p.requires_grad for p in body.parameters()):
        ddp = data_parallel(body, cfg, mesh, bool(cfg.get("overlap")) and not syncs_at_step(schedule))
    stage = Stage(ddp if ddp is not None else body, loss.amp.autocast)
    runner = PipelineStage(
        stage,
        mesh.pp_rank,
        mesh.pp_ranks,
        cfg.get("timeout_s"),
        loss_fn=loss,
        device=device,
        defer_weights=not segments,  # checkpointed: W with B (one recomputation, see split.py)
    )
    return Pipeline(stages, stage, runner, ddp, schedule), segments


def _interleaved(
    net: nn.Module,
    cfg: TrainConfig,
    mesh: Mesh,
    device: torch.device,
    loss: TrainingLoss,
    sample: torch.Tensor,
) -> tuple[Pipeline, int]:
    """Interleaved 1F1B: the model cut into pp x V chunks; this rank runs chunks c pp + pp_rank."""
    v = virtual_stages(cfg)  # c: chunk of this rank, j: pipeline rank
    virtual = cut(model_layers(net), cfg.pp * v, cfg.get("pp_balance"), sample)
    stages, ddps, segments = [], [], 0
    for c in range(v):
        body, chunk_segments = checkpointed(
            virtual[c * cfg.pp + mesh.pp_rank], cfg.checkpoint_segments, cfg.checkpoint_activations
        )
        segments = max(segments, chunk_segments)
        ddp = None
        if any(p.requires_grad for p in body.parameters()):
            ddp = data_parallel(body, cfg, mesh, False)
            assert isinstance(ddp, DistributedDataParallel)  # the config refuses --zero here
            ddps.append(ddp)
        stages.append(Stage(ddp if ddp is not None else body, loss.amp.autocast))
    runner = InterleavedStage(
        stages, mesh.pp_rank, mesh.pp_ranks, cfg.get("timeout_s"), loss_fn=loss, device=device
    )
    per_rank = [nn.Sequential(*(virtual[c * cfg.pp + j] for c in range(v))) for j in range(cfg.pp)]
    pipe = Pipeline(per_rank, Chunks(stages), runner, ChunkDDPs(ddps) if ddps else None, "interleaved")
    return pipe, segments


def _v_shaped(
    net: nn.Module,
    cfg: TrainConfig,
    mesh: Mesh,
    device: torch.device,
    loss: TrainingLoss,
    sample: torch.Tensor,
) -> tuple[Pipeline, int]:
    """ZB-V and DualPipeV: the model cut into 2 pp chunks; rank j runs chunks j and 2 pp - 1 - j,
    synchronized at the step: under ZeRO both in one ShardedDataParallel (a ChunkPair), under DDP
    one DDP per chunk as interleaved 1F1B has (each forward broadcasts its own chunk's buffers only,
    as a stage's forward does under 1F1B: an MoE router's token counts are buffers)."""
    p, j = cfg.pp, mesh.pp_rank
    virtual = cut(model_layers(net), 2 * p, cfg.get("pp_balance"), sample)
    bodies, segments = [], 0
    for layers in (virtual[j], virtual[2 * p - 1 - j]):
        body, chunk_segments = checkpointed(layers, cfg.checkpoint_segments, cfg.checkpoint_activations)
        bodies.append(body)
        segments = max(segments, chunk_segments)
    pair = ChunkPair(bodies)
    ddp: DataParallel | ChunkDDPs | None = None
    if not any(q.requires_grad for q in pair.parameters()):
        stages = [Stage(pair, loss.amp.autocast, chunk=c) for c in range(2)]
    elif cfg.zero:
        ddp = data_parallel(pair, cfg, mesh, False)
        stages = [Stage(ddp, loss.amp.autocast, chunk=c) for c in range(2)]
    else:
        wrapped = [
            data_parallel(b, cfg, mesh, False) if any(q.requires_grad for q in b.parameters()) else b
            for b in bodies
        ]
        ddp = ChunkDDPs([d for d in wrapped if isinstance(d, DistributedDataParallel)])
        stages = [Stage(d, loss.amp.autocast) for d in wrapped]
    runner = InterleavedStage(
        stages,
        j,
        mesh.pp_ranks,
        cfg.get("timeout_s"),
        loss_fn=loss,
        device=device,
        placement="v",
        defer_weights=not segments,  # checkpointed: W with B (one recomputation, see split.py)
    )
    per_rank = [nn.Sequential(virtual[k], virtual[2 * p - 1 - k]) for k in range(p)]
    return Pipeline(per_rank, Chunks(stages), runner, ddp, cfg.get("schedule")), segments


def virtual_stages(cfg: TrainConfig) -> int:
    """Model chunks per pipeline stage: --virtual-stages under interleaved 1F1B, 2 under the V
    schedules (zb-v, dualpipev), else 1."""
    if cfg.schedule in V_SHAPED:
        return 2
    return int(cfg.get("virtual_stages")) if cfg.schedule == "interleaved" else 1


def thread_devices(cfg: TrainConfig) -> list[torch.device]:
    """--mode dp-threads' devices: every GPU (or the first --threads), else --threads CPU copies."""
    if device_type(cfg) == "cuda":
        n = torch.cuda.device_count() if cfg.threads is None else min(cfg.threads, torch.cuda.device_count())
        return [torch.device("cuda", k) for k in range(n)]
    return [torch.device("cpu")] * cfg.get("threads")


def check(net: nn.Module, cfg: TrainConfig) -> None:
    """ValueError, before any training, for a model the asked parallelism cannot cut or shard."""
    tensor_parallel.check(net, cfg)
    low_comm.check(net, cfg)  # --fragments against the layers (each stage's under --pp)
    if cfg.cp > 1:
        check_context(net, cfg)
    if cfg.ep > 1:
        moes = moe_layers(net)
        if not moes:
            raise ValueError(
                f"--ep {cfg.ep} splits the experts of MoE layers, and {type(net).__name__} has none; "
                "use --model moe (or ringtree.parallel.MoE in your model) or drop --ep"
            )
        for layer in moes:
            if layer.num_experts % cfg.ep:
                raise ValueError(
                    f"--ep {cfg.ep} must divide the {layer.num_experts} experts of each MoE layer"
                )
    if cfg.pp > 1 and getattr(getattr(net, "cfg", None), "tied", False):
        raise ValueError(
            "--pp puts the embedding and the output head on different stages, so they cannot share "
            "their weight; use --model gpt (untied) with --pp"
        )
    if cfg.pp > 1:
        try:
            layers = model_layers(net if not isinstance(net, nn.ModuleList) else nn.Sequential(*net))
        except TypeError as e:
            raise ValueError(str(e)) from None
        if cfg.pp > len(layers):
            raise ValueError(
                f"--pp {cfg.pp} is more stages than the {len(layers)} layers of the model; "
                f"use --pp {len(layers)} or fewer"
            )
        if cfg.get("schedule") in V_SHAPED:
            check_layers(cfg.get("schedule"), cfg.pp, len(layers))
        chunks = cfg.pp * virtual_stages(cfg)
        if chunks > len(layers):
            raise ValueError(
                f"--pp {cfg.pp} x --virtual-stages {virtual_stages(cfg)} = {chunks} chunks, more than the "
                f"{len(layers)} layers of the model; use fewer virtual stages"
            )


def check_context(net: nn.Module, cfg: TrainConfig) -> None:
    """ValueError for --cp on a model without attention ContextParallel can split, or heads that
    --cp-comm all-to-all cannot share out."""
    if not has_attention(net):
        raise ValueError(
            f"--cp {cfg.cp} splits each sequence for the model's attention, but {type(net).__name__} has "
            "none (no ringtree.parallel.SDPA module); drop --cp or use --model gpt"
        )
    check_cp = getattr(net, "check_cp", None)
    if check_cp is not None:
        check_cp(cfg.cp, cfg.tp, cfg.get("cp_comm"))


def check_sequence(data: Dataset[Any], cfg: TrainConfig) -> None:
    """ValueError when the data set's sequences do not cut into 2 x cp chunks (head-tail)."""
    if cfg.cp == 1 or isinstance(data, IterableDataset):
        return
    first = data[0][0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(f"--cp {cfg.cp} splits sequences, but the inputs are not sequences; drop --cp")
    t, n = first.shape[0], 2 * cfg.cp
    if t % n:
        ok = [c for c in range(2, t // 2 + 1) if t % (2 * c) == 0]
        raise ValueError(
            f"--cp {cfg.cp} cuts each sequence into 2 x cp = {n} chunks (head-tail), but the sequences "
            f"hold {t} tokens; choose --cp among {ok} (2 x cp must divide {t})"
        )
