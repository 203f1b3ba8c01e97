"""Exercise every CUDA path of ringtree in under two minutes and write what was measured as JSON.

    python benchmarks/gpu_check.py --json gpu_check.json            # one rank per visible GPU
    python benchmarks/gpu_check.py --nproc 2 --json gpu_check.json  # or fewer

Checks, each on every rank (one per GPU, NCCL), each recorded as ok / skipped (with the reason) /
failed (with the error) so that one broken path does not hide the others:

- ddp: ringtree.DistributedDataParallel with every algorithm (comm.algorithms()): gradients
  against the plain all-reduce average, and ms per step;
- tp: a transformer block sharded with ringtree.parallel.tensor (ParallelBlock.from_dense):
  output and input gradient against the dense block (needs 2 or more GPUs);
- pp: the vit cut into one stage per rank (ringtree.parallel.pipeline), 1f1b with 8 micro-batches:
  gradients against the unpipelined model, and the measured bubble (needs 2 or more GPUs);
- zero_bubble: the split backward on the device (ringtree.parallel.pipeline.split: B, the input
  gradient, then W, the weights') of a transformer block against one backward, and with 2 or more
  GPUs the vit cut into 2p chunks under zb-v (rank r holding chunks r and 2p-1-r): gradients
  against the unpipelined model and the measured bubble;
- amp: the vit trained for a few steps under autocast fp16 (with torch.amp.GradScaler) and bf16;
- h2d: host-to-device copy bandwidth of 64 MiB from pinned and from pageable memory;
- zero: ringtree.ShardedDataParallel at ZeRO 1, 2 and 3 (native: NCCL's reduce-scatter and
  all-gather; ring: ringtree's schedule) against ringtree's DDP after two AdamW steps, the model
  state each holds (counted from the tensors) and, on CUDA, ZeRO-3's peak allocation during
  forward + backward against the whole parameters' size (each layer freed after use);
- moe: an MoE layer (ringtree.parallel.MoE) with its experts split over every rank
  (ExpertParallel: counts exchange, NCCL all-to-all dispatch and combine, the dispatch and the
  combine started before its shared expert computes and waited for after it), with torch's
  all_to_all_single (native) and ringtree's (auto), against the whole layer on the whole batch:
  output and input gradient, ms per forward + backward; on CUDA also the experts' grouped matmul
  (torch._grouped_mm, bf16) against the per-expert loop;
- checkpoint: peak memory of a deeper vit's forward + backward with and without activation
  checkpointing (torch.utils.checkpoint, through the vit's checkpoint_segments);
- diloco: ringtree.parallel.DiLoCo (what `ringtree train --sync diloco` runs): with H = 1, inner
  SGD and outer lr 1 against torch's DDP (the pseudo-gradients averaged by NCCL all-reduces of
  GPU copies of the pinned CPU buffers, on a side stream); Streaming DiLoCo (2 fragments, the
  all-reduce overlapping the next inner step, int8 on the wire): the global copy in pinned host
  memory, equal on every rank after each synchronisation;
- powersgd: ringtree's DDP with PowerSGD (rank 2, compressing from the third step; native: NCCL,
  ring: ringtree's schedule) and ringtree.powersgd_hook in torch's DDP, against torch's DDP with
  torch's powerSGD_hook: gradients of every step, ms per step;
- trace: steps of ringtree's DDP (native: NCCL) profiled by `--profile`'s StepProfiler (CUDA
  activity too), one file per rank, read back by `ringtree trace`'s analysis: kernels on streams,
  every collective classified and sized (whatever the NCCL version's kernel names), the NCCL
  kernel names seen.

Ranks are started by torch's elastic launcher (torch.distributed.launcher.api.elastic_launch),
not by hand. On a machine without CUDA it prints "no CUDA device: nothing to check", writes a JSON
saying so and exits 0. `--allow-cpu` runs the same checks on CPU with gloo (the CUDA-only ones
skipped): a way to test this script where there is no GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtree import DistributedDataParallel, ShardedDataParallel, comm
from ringtree.bench import environment
from ringtree.parallel.pipeline.interleaved import InterleavedStage
from ringtree.parallel.pipeline.partition import partition
from ringtree.parallel.pipeline.runtime import PipelineStage
from ringtree.parallel.pipeline.split import backward_input, backward_weight
from ringtree.parallel.tensor import ParallelBlock
from ringtree.processes import elastic_spawn
from ringtree.schedules.pipeline import build, theoretical_bubble_fraction
from ringtree.train.memory import model_state_bytes
from ringtree.train.models import Block, ViT
from ringtree.train.stages import model_layers

NO_CUDA = "no CUDA device: nothing to check"
TIMEOUT_S = 60.0  # a collective stuck longer than this fails its check instead of hanging the run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_ddp(device: torch.device) -> dict[str, Any]:
    """Every algorithm's DDP gradients against the plain average, and ms per step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 256, generator=g).to(device), torch.randn(64, 256, generator=g).to(device)
    reference = copy.deepcopy(base)
    F.mse_loss(reference(x), y).backward()
    expected = []
    for p in reference.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        expected.append(p.grad / world)
    out: dict[str, Any] = {}
    for algorithm in comm.algorithms():
        model = copy.deepcopy(base)
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, algorithm=algorithm, timeout_s=TIMEOUT_S)

        def step(ddp: nn.Module = ddp, model: nn.Module = model) -> None:
            model.zero_grad(set_to_none=True)
            F.mse_loss(ddp(x), y).backward()

        seconds = _timed(step, device)
        error = max(
            float((p.grad - e).abs().max())
            for p, e in zip(model.parameters(), expected, strict=True)
            if p.grad is not None
        )
        out[algorithm] = {"max_abs_grad_error": error, "ms_per_step": seconds * 1e3, "ok": error < 1e-4}
    return out


def _powersgd_grads(kind: str, base: nn.Module, device: torch.device, steps: int = 4) -> dict[str, Any]:
    """Every step's gradients and the median ms per step of `base` under one PowerSGD variant."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    import ringtree
    from ringtree.parallel import PowerSGD

    model = copy.deepcopy(base)
    ids = [device.index] if device.type == "cuda" else None
    if kind.startswith("ringtree-ddp"):
        algorithm = kind.rsplit("/", 1)[1]
        state = PowerSGD(rank=2, start_iter=2)
        ddp: nn.Module = DistributedDataParallel(
            model, device_ids=ids, algorithm=algorithm, compression=state, timeout_s=TIMEOUT_S
        )
    else:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if kind == "torch":
            ddp.register_comm_hook(torch_psgd.PowerSGDState(None, 2, 2), _torch_powersgd_in_order)
        else:
            ddp.register_comm_hook(PowerSGD(rank=2, start_iter=2), ringtree.powersgd_hook("native"))
    g = torch.Generator().manual_seed(dist.get_rank())
    grads, times = [], []
    for _ in range(steps):
        x, y = torch.randn(64, 256, generator=g).to(device), torch.randn(64, 256, generator=g).to(device)
        _sync(device)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        _sync(device)
        times.append(time.perf_counter() - start)
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
    return {"grads": grads, "ms_per_step": statistics.median(times[2:]) * 1e3}


def _torch_powersgd_in_order(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook, each bucket done before the next (gloo runs two buckets' chained
    callbacks in any order, and the ranks' all-reduces then pair up wrongly)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    fut = torch_psgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


_torch_powersgd_in_order.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}  # type: ignore[attr-defined]
)


def check_powersgd(device: torch.device) -> dict[str, Any]:
    """ringtree's PowerSGD (DDP, native and ring; the hook) against torch's powerSGD_hook."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
    reference = _powersgd_grads("torch", base, device)
    out: dict[str, Any] = {"torch": {"ms_per_step": reference["ms_per_step"], "ok": True}}
    for kind in ("ringtree-ddp/native", "ringtree-ddp/ring", "ringtree-hook/native"):
        run = _powersgd_grads(kind, base, device)
        error = max(
            float((a - b).abs().max())
            for got, want in zip(run["grads"], reference["grads"], strict=True)
            for a, b in zip(got, want, strict=True)
        )
        out[kind] = {"max_abs_grad_error": error, "ms_per_step": run["ms_per_step"], "ok": error < 1e-4}
    return out


def check_tp(device: torch.device) -> dict[str, Any]:
    """A block sharded over every rank against the dense block: output and input gradient."""
    if dist.get_world_size() < 2:
        return {"skipped": "tensor parallelism needs 2 or more ranks (GPUs)"}
    torch.manual_seed(0)
    dense = Block(256, 8).to(device)
    parallel = ParallelBlock.from_dense(dense, None, "ring").to(device)
    x = torch.randn(16, 33, 256, generator=torch.Generator().manual_seed(1)).to(device)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense(xd).sum().backward()
    out = parallel(xp)
    out.sum().backward()
    assert xd.grad is not None and xp.grad is not None
    with torch.no_grad():
        out_error = float((out - dense(x)).abs().max())
    grad_error = float((xp.grad - xd.grad).abs().max())
    seconds = _timed(lambda: parallel(x).sum().backward(), device)
    return {
        "max_abs_output_error": out_error,
        "max_abs_input_grad_error": grad_error,
        "ms_per_forward_backward": seconds * 1e3,
        "ok": max(out_error, grad_error) < 1e-3,
    }


def _measured_bubble(spans: list[Any], p: int) -> float:
    """1 - the stages' work / (p x the makespan over every rank), from this rank's spans (collective)."""
    work = [s for s in spans if s.kind != "step"]
    offset = time.time() - time.perf_counter()  # wall clock: comparable across processes
    window = (work[0].start + offset, max(s.end for s in work) + offset, sum(s.end - s.start for s in work))
    every: list[Any] = [None] * p
    dist.all_gather_object(every, window)
    makespan = max(w[1] for w in every) - min(w[0] for w in every)
    return 1 - sum(w[2] for w in every) / (p * makespan)


def check_pp(device: torch.device) -> dict[str, Any]:
    """The vit, one stage per rank, 1f1b over 8 micro-batches: gradients and the bubble."""
    p, rank, m = dist.get_world_size(), dist.get_rank(), 8
    if p < 2:
        return {"skipped": "pipeline parallelism needs 2 or more ranks (GPUs)"}
    torch.manual_seed(0)
    net = ViT().to(device)
    reference = copy.deepcopy(net)
    layers = model_layers(net)
    if p > len(layers):
        return {"skipped": f"the vit has {len(layers)} layers: at most {len(layers)} stages"}
    g = torch.Generator().manual_seed(2)
    x, y = torch.rand(256, 64, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(device)
    F.cross_entropy(reference(x), y).backward()
    stage = partition(layers, p)[rank]
    runner = PipelineStage(stage, rank, list(range(p)), TIMEOUT_S, device=device)
    batches = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))
    runner.run(build("1f1b", p, m), batches)
    ref = dict(reference.named_parameters())
    mine = {id(t) for t in stage.parameters()}
    errors = [
        float((t.grad - ref[n].grad).abs().max())
        for n, t in net.named_parameters()
        if id(t) in mine and t.grad is not None and ref[n].grad is not None
    ]
    runs = []
    for _ in range(3):
        dist.barrier()
        runs.append(_measured_bubble(runner.run(build("1f1b", p, m), batches).spans, p))
    error = max(errors, default=0.0)
    return {
        "max_abs_grad_error": error,
        "bubble_fraction": statistics.median(runs),
        "theoretical_bubble_fraction": theoretical_bubble_fraction(p, m),
        "ok": error < 1e-4,
    }


def check_zero_bubble(device: torch.device) -> dict[str, Any]:
    """B then W of a block equals one backward on the device; zb-v's gradients and bubble (2+ GPUs)."""
    torch.manual_seed(0)
    block = Block(64, 4).to(device)
    split = copy.deepcopy(block)
    x = torch.randn(8, 16, 64, device=device)
    dy = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward(block(xa), dy)
    backward_weight(backward_input(split(xb), dy, xb))
    params = zip(block.parameters(), split.parameters(), strict=True)
    pairs = [(xb.grad, xa.grad), *((b.grad, a.grad) for a, b in params)]
    split_error = max(float((b - a).abs().max()) for b, a in pairs if a is not None and b is not None)
    out: dict[str, Any] = {"split_max_abs_grad_error": split_error, "ok": split_error < 1e-5}
    p, rank, m = dist.get_world_size(), dist.get_rank(), 8
    net = ViT(depth=2 * p).to(device)
    layers = model_layers(net)
    if p < 2 or 2 * p > len(layers):
        return {**out, "pipeline": "skipped: zb-v needs 2 or more ranks (GPUs)"}
    reference = copy.deepcopy(net)
    g = torch.Generator().manual_seed(2)
    x, y = torch.rand(256, 64, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(device)
    F.cross_entropy(reference(x), y).backward()
    chunks = partition(layers, 2 * p)
    mine = [chunks[rank], chunks[2 * p - 1 - rank]]
    runner = InterleavedStage(mine, rank, list(range(p)), TIMEOUT_S, device=device, placement="v")
    batches = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))
    schedule = build("zb-v", p, m, 2)
    runner.run(schedule, batches)
    ref = dict(reference.named_parameters())
    held = {id(t) for c in mine for t in c.parameters()}
    errors = [
        float((t.grad - ref[n].grad).abs().max())
        for n, t in net.named_parameters()
        if id(t) in held and t.grad is not None and ref[n].grad is not None
    ]
    runs = []
    for _ in range(3):
        dist.barrier()
        runs.append(_measured_bubble(runner.run(schedule, batches).spans, p))
    error = max(errors, default=0.0)
    return {
        **out,
        "zb_v_max_abs_grad_error": error,
        "zb_v_bubble_fraction": statistics.median(runs),
        "ok": out["ok"] and error < 1e-4,
    }


def check_amp(device: torch.device) -> dict[str, Any]:
    """The vit for a few steps under fp16 autocast with a GradScaler, and under bf16 autocast."""
    if device.type != "cuda":
        return {"skipped": "fp16 with loss scaling is a CUDA path"}
    out: dict[str, Any] = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            out[name] = {"skipped": f"{torch.cuda.get_device_name(device)} has no bf16"}
            continue
        torch.manual_seed(0)
        net = ViT(dim=128, depth=4).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
        g = torch.Generator().manual_seed(3)
        x, y = (
            torch.rand(512, 64, generator=g).to(device),
            torch.randint(0, 10, (512,), generator=g).to(device),
        )
        losses: list[torch.Tensor] = []

        def step(  # the loop's values bound as defaults
            net: nn.Module = net,
            opt: Any = opt,
            scaler: Any = scaler,
            dtype: Any = dtype,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
            losses: list[torch.Tensor] = losses,
        ) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype):
                loss = F.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())

        seconds = _timed(step, device, repeats=10)
        values = torch.stack(losses).float().tolist()  # one read at the end, not per step
        out[name] = {
            "ms_per_step": seconds * 1e3,
            "first_loss": values[0],
            "last_loss": values[-1],
            "ok": all(v == v and abs(v) < 1e4 for v in values) and values[-1] < values[0],
        }
    return out


def check_h2d(device: torch.device) -> dict[str, Any]:
    """Host-to-device GB/s of 64 MiB, pinned against pageable memory (CUDA events, median of 5)."""
    if device.type != "cuda":
        return {"skipped": "host-to-device copies need a GPU"}
    n = 64 << 20
    target = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict[str, Any] = {"bytes": n}
    for name, source in (
        ("pageable", torch.ones(n, dtype=torch.uint8)),
        ("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()),
    ):
        times = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[f"{name}_gb_per_s"] = n / statistics.median(times[1:]) / 1e9
    out["ok"] = out["pinned_gb_per_s"] >= out["pageable_gb_per_s"]
    return out


def check_checkpoint(device: torch.device) -> dict[str, Any]:
    """Peak memory of a deeper vit's forward + backward, plain and with activation checkpointing."""
    if device.type != "cuda":
        return {"skipped": "peak memory is measured with torch.cuda.max_memory_allocated"}
    torch.manual_seed(0)
    net = ViT(dim=256, depth=8, heads=8).to(device)
    x = torch.rand(1024, 64, generator=torch.Generator().manual_seed(4)).to(device)
    y = torch.zeros(1024, dtype=torch.long, device=device)
    out: dict[str, Any] = {}
    for segments in (0, 3):  # 3: about sqrt(8) segments, the classic trade-off
        net.checkpoint_segments = segments
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        F.cross_entropy(net(x), y).backward()
        torch.cuda.synchronize(device)
        out[f"segments_{segments}"] = {
            "peak_bytes_above_start": torch.cuda.max_memory_allocated(device) - base,
            "ms": (time.perf_counter() - start) * 1e3,
        }
    plain, kept = out["segments_0"]["peak_bytes_above_start"], out["segments_3"]["peak_bytes_above_start"]
    out["ratio"] = kept / plain if plain else None
    out["ok"] = kept < plain
    return out


def _zero_run(base: nn.Module, zero: int, algorithm: str, device: torch.device) -> dict[str, Any]:
    """Two AdamW steps of a copy of `base` at ZeRO `zero` (0: ringtree's DDP); params, state, peak."""
    model = copy.deepcopy(base)
    ids = [device.index] if device.type == "cuda" else None
    if zero == 0:
        wrapped: nn.Module = DistributedDataParallel(
            model, device_ids=ids, algorithm=algorithm, timeout_s=TIMEOUT_S
        )
        params = list(model.parameters())
    else:
        sdp = ShardedDataParallel(
            model, zero=zero, algorithm=algorithm, bucket_cap_mb=1.0, timeout_s=TIMEOUT_S
        )
        wrapped, params = sdp, sdp.shard_parameters()
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 256, generator=g).to(device), torch.randn(32, 256, generator=g).to(device)
    peak = 0
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        F.mse_loss(wrapped(x), y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - start)
        opt.step()
    state = model_state_bytes(model, opt)
    if isinstance(wrapped, ShardedDataParallel | DistributedDataParallel):
        wrapped.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": flat, "state_bytes": state, "peak_bytes": peak}


def check_zero(device: torch.device) -> dict[str, Any]:
    """ZeRO 1/2/3 against DDP: the same parameters, 1/p of the state, layers freed on CUDA."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    base = nn.Sequential(*layers, nn.Linear(256, 256)).to(device)
    whole_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    out: dict[str, Any] = {}
    for algorithm in ("native", "ring"):
        ddp = _zero_run(base, 0, algorithm, device)
        for zero in (1, 2, 3):
            run = _zero_run(base, zero, algorithm, device)
            error = float((run["params"] - ddp["params"]).abs().max())
            ratio = run["state_bytes"] / ddp["state_bytes"]
            ideal = (8 + 8 / world) / 16 if zero == 1 else (4 + 12 / world) / 16 if zero == 2 else 1 / world
            row = {"max_abs_param_error": error, "state_vs_ddp": ratio, "ideal_state_vs_ddp": ideal}
            ok = error < 1e-4 and ratio <= ideal + 0.05
            if zero == 3 and device.type == "cuda":
                row["peak_bytes_vs_whole_params"] = run["peak_bytes"] / whole_bytes
                ok = ok and (world == 1 or run["peak_bytes"] < whole_bytes + ddp["peak_bytes"])
            out[f"zero{zero}_{algorithm}"] = row | {"ok": ok}
    return out


def check_moe(device: torch.device) -> dict[str, Any]:
    """EP over every rank against the whole MoE layer; the grouped expert matmul against the loop."""
    from ringtree.parallel import ExpertParallel, MoE
    from ringtree.parallel.moe.experts import grouped_mm_available

    p, rank = dist.get_world_size(), dist.get_rank()
    experts = 8 * p  # whole experts on every rank
    x = torch.randn(p, 512, 256, generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    whole = MoE(256, 256, experts, top_k=2, shared=1).to(device)  # the dispatch overlaps the shared expert
    xw = x.clone().requires_grad_()
    out_whole = whole(xw.view(-1, 256)).view_as(x)
    out_whole.square().mean().backward()
    assert xw.grad is not None
    result: dict[str, Any] = {}
    for algorithm in ("native", "auto"):
        layer = copy.deepcopy(whole).cpu()
        ExpertParallel(p, algorithm=algorithm, overlap=True).apply(layer)
        layer.to(device)
        mine = x[rank].clone().requires_grad_()
        out = layer(mine)
        (out.square().mean() / p).backward()
        assert mine.grad is not None
        out_error = float((out - out_whole[rank]).abs().max())
        grad_error = float((mine.grad - xw.grad[rank]).abs().max())
        seconds = _timed(lambda layer=layer, mine=mine: layer(mine).square().mean().backward(), device)
        result[algorithm] = {
            "max_abs_output_error": out_error,
            "max_abs_input_grad_error": grad_error,
            "ms_per_forward_backward": seconds * 1e3,
            "ok": max(out_error, grad_error) < 1e-4,
        }
    rows = torch.randn(4096, 256, device=device, dtype=torch.bfloat16)
    if not grouped_mm_available(rows):
        result["grouped_mm"] = {"skipped": "needs CUDA, bf16 and torch._grouped_mm", "ok": True}
        return result
    experts_module = whole.experts.to(torch.bfloat16)
    counts = [4096 // experts] * experts
    grouped = experts_module(rows, counts)
    experts_module.grouped = False
    loop = experts_module(rows, counts)
    error = float((grouped.float() - loop.float()).abs().max() / loop.float().abs().max())
    loop_s = _timed(lambda: experts_module(rows, counts), device)
    experts_module.grouped = True
    grouped_s = _timed(lambda: experts_module(rows, counts), device)
    result["grouped_mm"] = {
        "max_rel_error_vs_loop": error,
        "ms_grouped": grouped_s * 1e3,
        "ms_loop": loop_s * 1e3,
        "ok": error < 2e-2,
    }
    return result


def check_trace(device: torch.device) -> dict[str, Any]:
    """Profile 4 DDP steps per rank (StepProfiler, as `train --profile`), then read them back."""
    import tempfile

    from ringtree.trace import load, report
    from ringtree.train.profile import StepProfiler

    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    folder = Path(tempfile.gettempdir()) / f"ringtree-gpu-check-trace-{run}"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids, algorithm="native", timeout_s=TIMEOUT_S)
    x = torch.randn(256, 1024, device=device)
    profiler = StepProfiler(str(folder), "1:4", dist.get_rank(), device)
    for step in range(6):
        profiler.before(step)
        model.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        _sync(device)
        profiler.after(step + 1)
    profiler.close()
    dist.barrier()
    if dist.get_rank() != 0:
        return {"ok": True}
    traces = load.read_all([folder])
    r = report.analyse(traces)
    kernels = sorted({k for t in traces for k in _nccl_kernel_names(t.path)})
    ops = {(row.op, row.nbytes) for row in r.collectives}
    return {
        "device_kind": traces[0].device,
        "ranks": [row["rank"] for row in r.rank_rows()],
        "compute_pct": [row["compute_pct"] for row in r.rank_rows()],
        "comm_overlap_pct": [row["comm_overlap_pct"] for row in r.rank_rows()],
        "collectives": [row.as_dict() for row in r.collectives],
        "nccl_kernels": kernels[:10],
        "ok": traces[0].device == ("gpu" if device.type == "cuda" else "cpu")
        and all(op != "send_recv" and n > 0 for op, n in ops)
        and any(op == "all_reduce" for op, _ in ops),
    }


def check_diloco(device: torch.device) -> dict[str, Any]:
    """DiLoCo H = 1 against torch's DDP; Streaming DiLoCo's global copy pinned and equal on every rank."""
    from ringtree.parallel import DiLoCo

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))

    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device))
               for _ in range(8)]  # fmt: skip

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    model, ref = net().to(device), net().to(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    start = time.perf_counter()
    with DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), 1, timeout_s=TIMEOUT_S):
        train(model, inner)
    seconds = time.perf_counter() - start
    ddp = nn.parallel.DistributedDataParallel(
        ref, device_ids=[device.index] if device.type == "cuda" else None
    )
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05))
    error = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    out["h1_vs_torch_ddp"] = {
        "max_abs_param_error": error,
        "ms_per_step": seconds / 8 * 1e3,
        "ok": error < 1e-5,
    }
    model = net().to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    streaming = DiLoCo(
        model, inner, outer, 4, fragments=2, overlap_steps=1, outer_dtype="int8", timeout_s=TIMEOUT_S
    )
    with streaming:
        train(model, inner)
    copies = [g for b in streaming.buckets for g in b.globals]
    flat = torch.cat([c.reshape(-1) for c in copies]).to(device)
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    equal = all(torch.equal(e, every[0]) for e in every)
    pinned = all(c.is_pinned() for c in copies) if device.type == "cuda" else None
    out["streaming_int8"] = {
        "outer_syncs": streaming.outer_syncs,
        "global_copy_pinned": pinned,
        "replicas_equal": equal,
        "exposed_s": streaming.exposed_s,
        "comm_s": streaming.comm_s,
        "ok": equal and streaming.outer_syncs == 4 and pinned is not False,
    }
    return out


def _nccl_kernel_names(path: str) -> set[str]:
    import gzip

    doc = json.loads(gzip.decompress(Path(path).read_bytes()))
    return {e["name"] for e in doc["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"].lower()}


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "ddp": check_ddp,
    "tp": check_tp,
    "pp": check_pp,
    "zero_bubble": check_zero_bubble,
    "amp": check_amp,
    "h2d": check_h2d,
    "checkpoint": check_checkpoint,
    "zero": check_zero,
    "moe": check_moe,
    "diloco": check_diloco,
    "powersgd": check_powersgd,
    "trace": check_trace,
}


def worker(rank: int, use_cuda: bool) -> dict[str, Any]:
    """One rank (started by ringtree's elastic_spawn, which joins the group and binds the GPU):
    every check, each caught and recorded on its own."""
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    results: dict[str, Any] = {"device": str(device)}
    if use_cuda:
        results["gpu"] = torch.cuda.get_device_name(device)
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            results[name] = check(device)
        except Exception as e:  # recorded: one broken path must not hide the others
            results[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        results[name]["seconds"] = time.perf_counter() - start
        dist.barrier()
    return results


def _summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for name in CHECKS:
        r = result.get(name, {})
        if "skipped" in r:
            lines.append(f"{name:>10}: skipped ({r['skipped']})")
        elif "error" in r:
            lines.append(f"{name:>10}: FAILED {r['error']}")
        else:
            state = (
                "ok"
                if r.get("ok", all(v.get("ok", True) for v in r.values() if isinstance(v, dict)))
                else "CHECK"
            )
            lines.append(f"{name:>10}: {state} in {r.get('seconds', 0):.1f}s")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, default=Path("gpu_check.json"), help="where to write the results"
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: one per visible GPU)")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run the checks on CPU (gloo)")
    args = parser.parse_args()
    if args.json.exists():
        print(f"gpu_check: --json {args.json} exists; remove it or name another file", file=sys.stderr)
        return 2
    use_cuda = torch.cuda.is_available()
    env = environment("cuda" if use_cuda else "cpu")
    if not use_cuda and not args.allow_cpu:
        print(NO_CUDA)
        args.json.write_text(json.dumps({"cuda": False, "message": NO_CUDA, "environment": env}, indent=1))
        print(f"wrote {args.json}")
        return 0
    nproc = args.nproc or (torch.cuda.device_count() if use_cuda else 2)
    if nproc < 1 or (use_cuda and nproc > torch.cuda.device_count()):
        print(
            f"gpu_check: --nproc {nproc}: choose 1 to {torch.cuda.device_count()} (one rank per GPU)",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    backend = "nccl" if use_cuda else "gloo"
    ranks = elastic_spawn(worker, nproc, (use_cuda,), backend=backend, collective_timeout_s=TIMEOUT_S)
    seconds = time.perf_counter() - start
    data = {
        "cuda": use_cuda,
        "nproc": nproc,
        "seconds": seconds,
        "environment": {**env, "world_size": nproc},
        "ranks": ranks,
    }
    args.json.write_text(json.dumps(data, indent=1, default=str))
    for line in _summary(ranks[0]):
        print(line)
    print(f"{nproc} rank(s), {seconds:.0f}s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
