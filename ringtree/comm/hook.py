"""A communication hook for torch's own DistributedDataParallel that reduces with ringtree's algorithms.

    model = torch.nn.parallel.DistributedDataParallel(net)
    model.register_comm_hook(None, ringtree.comm_hook(algorithm="ring"))

torch's C++ reducer keeps doing what it does well (bucketing, autograd hooks, copying gradients
in and out of buckets, launching buckets in the same order on every rank); the hook only
replaces the bucket's all-reduce. Like torch's default hook it divides by the world size, then
sums. `native` returns torch's own async work's future; a ringtree schedule runs on one
communication thread per hook (buckets in launch order), so backward goes on while it runs: the
executor spends its time in gloo calls and tensor kernels that release the interpreter.

    model.register_comm_hook(PowerSGD(rank=2, start_iter=10), ringtree.powersgd_hook("ring"))

`powersgd_hook` is torch's powerSGD_hook with its sums on ringtree's algorithms; its state is a
ringtree.comm.powersgd.PowerSGD (saved and loaded with its state_dict).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # exported, not in __all__

from ringtree.comm.collectives import DEFAULT_TIMEOUT_S, NATIVE, algorithms, all_reduce
from ringtree.comm.powersgd import PowerSGD

COMPRESSION: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

Hook = Callable[[dist.ProcessGroup | None, GradBucket], torch.futures.Future[torch.Tensor]]
PowerSGDHook = Callable[[PowerSGD, GradBucket], torch.futures.Future[torch.Tensor]]


def comm_hook(
    algorithm: str = "ring", compression: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Hook:
    """A hook for `torch.nn.parallel.DistributedDataParallel.register_comm_hook(state, hook)`.

    `state` is the process group to reduce over (None: the world, as for torch's allreduce_hook).
    `algorithm`: any of ringtree.comm.algorithms(); `compression`: None, "fp16" or "bf16"
    (buckets travel in that dtype and return into the gradients' dtype).
    """
    if algorithm not in algorithms("all_reduce"):
        raise ValueError(
            f"unknown all_reduce algorithm {algorithm!r}; choose one of {', '.join(algorithms())}"
        )
    if compression is not None and compression not in COMPRESSION:
        raise ValueError(f"unknown compression {compression!r}; choose None, 'fp16' or 'bf16'")
    wire = None if compression is None else COMPRESSION[compression]
    pool: list[ThreadPoolExecutor] = []  # started on first use, so a hook object pickles before use

    def hook(state: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        group, grads = state, bucket.buffer()
        payload = grads.div_(dist.get_world_size(group))
        if wire is not None and grads.dtype != wire:
            payload = grads.to(wire)
        if algorithm == NATIVE:
            work = dist.all_reduce(payload, group=group, async_op=True)
            assert work is not None
            done: torch.futures.Future[torch.Tensor] = work.get_future().then(
                lambda _: _restore(grads, payload)
            )
            return done
        if not pool:
            pool.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-comm-hook"))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        pool[0].submit(_run, fut, grads, payload, algorithm, group, timeout_s)
        return fut

    # torch checks a hook's annotations as objects; this module's are strings (future import)
    hook.__annotations__.update({"bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]})
    return hook


def _run(
    fut: torch.futures.Future[torch.Tensor],
    grads: torch.Tensor,
    payload: torch.Tensor,
    algorithm: str,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> None:
    try:
        all_reduce(payload, "sum", algorithm, group, timeout_s=timeout_s, validate=False)
        fut.set_result(_restore(grads, payload))
    except Exception as e:  # carried to the reducer, which re-raises it in backward
        fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub says Tensor; it takes exceptions


def _restore(grads: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    if payload is not grads:
        grads.copy_(payload)
    return grads


def powersgd_hook(
    algorithm: str = "ring",
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PowerSGDHook:
    """torch's powerSGD_hook with P, Q and the uncompressed tensors summed by `algorithm` over
    `group` (None: the world): `ddp.register_comm_hook(PowerSGD(...), powersgd_hook(...))`.

    Every bucket runs on one communication thread, in launch order (its three sums depend on
    each other). As for torch's hook, start_iter must be 2 or more with error feedback or warm
    start: torch's DDP rebuilds its buckets after the first step.
    """
    if algorithm not in algorithms("all_reduce"):
        raise ValueError(
            f"unknown all_reduce algorithm {algorithm!r}; choose one of {', '.join(algorithms())}"
        )
    pool: list[ThreadPoolExecutor] = []
    bound: list[PowerSGD] = []

    def hook(state: PowerSGD, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not bound:
            _check_hook_state(state)
            state.bind()
            bound.append(state)
            pool.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringtree-powersgd-hook"))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        job = (state, bucket.index(), bucket.is_last(), bucket.buffer(), bucket.gradients())
        pool[0].submit(_run_powersgd, fut, *job, algorithm, group, timeout_s)
        return fut

    hook.__annotations__.update({"bucket": GradBucket, "return": torch.futures.Future[torch.Tensor]})
    return hook


def _check_hook_state(state: object) -> None:
    if not isinstance(state, PowerSGD):
        raise TypeError(
            f"powersgd_hook's state must be a ringtree PowerSGD(...), got {type(state).__name__}; "
            "register it with ddp.register_comm_hook(PowerSGD(...), powersgd_hook())"
        )
    if (state.error_feedback or state.warm_start) and state.start_iter <= 1:
        raise ValueError(
            f"PowerSGD start_iter={state.start_iter} with error feedback or warm start in torch's DDP: "
            "it rebuilds its buckets after the first step; use start_iter 2 or more (as torch's hook)"
        )


def _run_powersgd(
    fut: torch.futures.Future[torch.Tensor],
    state: PowerSGD,
    index: int,
    last: bool,
    flat: torch.Tensor,
    grads: list[torch.Tensor],
    algorithm: str,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> None:
    def summed(t: torch.Tensor) -> None:
        if t.numel():
            all_reduce(t, "sum", algorithm, group, timeout_s=timeout_s, validate=False)

    try:
        state.reduce(index, flat, grads, dist.get_world_size(group), summed)
        if last:
            state.step_done()
        if flat.is_cuda:  # as torch's hook: the kernels of this thread done before the reducer reads
            torch.cuda.synchronize(flat.device)
        fut.set_result(flat)
    except Exception as e:  # carried to the reducer, which re-raises it in backward
        fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub says Tensor; it takes exceptions
