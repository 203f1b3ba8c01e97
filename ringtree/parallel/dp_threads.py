"""Single-process data parallelism with threads: torch's DataParallel, and the balanced variant of the seeds.

Indices: n devices, k device, N samples in the batch. One step replicates the module on the n
devices, scatters the batch into n chunks, runs each replica on its chunk in its own thread
(parallel_apply), and then either

- `balanced=False` (torch.nn.DataParallel): gathers every output on devices[0] and computes the
  loss there, so device 0 holds all N outputs, the labels and the loss's work on top of its own
  chunk: the imbalance the seeds point at; or
- `balanced=True` (the seeds' custom DataParallel): scatters the labels too, computes each
  chunk's loss on its own device and gathers only the n scalar losses, weighted by chunk size so
  that the mean equals the full batch's.

Backward runs through the replicas, and the gradients arrive on the original module's
parameters, as with torch's DataParallel. On CUDA devices this uses torch.nn.parallel's
replicate, scatter, parallel_apply and gather. Without GPUs the devices may all be the CPU:
each "device" is then a copy of the module run in its own thread with clones of the module's
parameters (the clones route their gradients back, like replicate's broadcast), so the plumbing
and the imbalance are exercised on any machine. Like torch's DataParallel, the threads share one
interpreter and its GIL.

Wiring into a training loop (what `--mode dp-threads` / `dp-threads-balanced` do):

    dp = ThreadedDataParallel(net, devices, balanced=mode == "dp-threads-balanced", loss_fn=loss_fn)
    for x, y in loader:
        optimizer.zero_grad()
        loss = dp.forward_backward(x, y)    # detached; read it once per log interval
        optimizer.step()                    # the optimizer holds net's parameters
    summary["device_imbalance"] = dp.stats()["imbalance"]
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.parallel import gather, parallel_apply, replicate, scatter

LossFn = Callable[[Tensor, Tensor], Tensor]


class _WithLoss(nn.Module):
    """A replica followed by the loss on the same device (the balanced variant's unit of work)."""

    def __init__(self, replica: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.replica, self.loss_fn = replica, loss_fn

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        out = self.replica(x)
        self.output_bytes = _nbytes(out)  # held on this device until backward
        return self.loss_fn(out, y)


class ThreadedDataParallel(nn.Module):
    """`module` replicated on `devices` (devices[0] holds it) and stepped with one thread per device."""

    def __init__(
        self, module: nn.Module, devices: Sequence[torch.device], *, balanced: bool, loss_fn: LossFn
    ) -> None:
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        kinds = {d.type for d in self.devices}
        if not self.devices or len(kinds) != 1 or kinds - {"cpu", "cuda"}:
            raise ValueError(
                f"devices {[str(d) for d in self.devices]}: give one or more devices, all CUDA or all CPU"
            )
        self.on_cuda = kinds == {"cuda"}
        self.module, self.balanced, self.loss_fn = module.to(self.devices[0]), balanced, loss_fn
        # CPU: one structural copy per extra "device"; each step runs it with clones of module's tensors
        self._copies = [] if self.on_cuda else [copy.deepcopy(module) for _ in self.devices[1:]]
        self._stats: dict[str, Any] = {}

    def forward(self, *inputs: Tensor) -> Tensor:
        """The module itself on devices[0] (evaluation; training steps go through forward_backward)."""
        return self.module(*(x.to(self.devices[0]) for x in inputs))  # type: ignore[no-any-return]

    def forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One step's forward and backward over the devices; gradients land on self.module. The mean loss."""
        if self.on_cuda:
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        chunks = self._scatter(inputs)
        n = len(chunks)  # fewer than the devices when the batch is smaller
        labels = self._scatter(targets) if self.balanced else [targets.to(self.devices[0])]
        start = time.perf_counter()
        if self.balanced:
            results = self._per_device([(x, y) for x, y in zip(chunks, labels, strict=True)], with_loss=True)
            losses = [r for r, _, _ in results]
            weights = torch.tensor([len(x) / len(inputs) for x in chunks], device=self.devices[0])
            loss = (self._gather([v.reshape(1) for v in losses]) * weights).sum()
            held = [out_bytes + _nbytes(v) for v, out_bytes, _ in results]  # its outputs and its loss
            held[0] += n * losses[0].element_size()  # the gathered losses
            labels_bytes = [_nbytes(y) for y in labels]
        else:
            results = self._per_device([(x,) for x in chunks], with_loss=False)
            outputs = [r for r, _, _ in results]
            gathered = self._gather(outputs)
            loss = self.loss_fn(gathered, labels[0])
            held = [_nbytes(o) for o in outputs]
            held[0] += _nbytes(gathered)  # device 0 holds every output again, for the loss
            labels_bytes = [_nbytes(labels[0])] + [0] * (n - 1)
        seconds = [s for _, _, s in results]
        seconds[0] += time.perf_counter() - start - max(seconds)  # gather and loss on device 0
        torch.autograd.backward(loss)
        self._record(held, labels_bytes, seconds)
        return loss.detach()

    def stats(self) -> dict[str, Any]:
        """Per-device work of the last step and `imbalance`, the largest over the mean.

        Keys: `devices`, `held_bytes` (outputs, gathered outputs or losses, and labels each device
        held for the loss), `seconds` (each device's thread: forward, plus the loss; device 0 also
        the gather), `peak_memory_bytes` (CUDA only: torch.cuda.max_memory_allocated per device),
        and `imbalance`: max/mean of the peak memory on CUDA, of the held bytes on CPU.
        """
        return dict(self._stats)

    def _record(self, held: list[int], labels: list[int], seconds: list[float]) -> None:
        work = [h + y for h, y in zip(held, labels, strict=True)]
        stats: dict[str, Any] = {
            "devices": [str(d) for d in self.devices[: len(work)]],
            "balanced": self.balanced,
            "held_bytes": work,
            "seconds": seconds,
        }
        basis: list[float] = [float(w) for w in work]
        if self.on_cuda:
            peaks = [torch.cuda.max_memory_allocated(d) for d in self.devices[: len(work)]]
            stats["peak_memory_bytes"] = peaks
            basis = [float(p) for p in peaks]
        stats["imbalance"] = max(basis) / (sum(basis) / len(basis)) if sum(basis) else 1.0
        self._stats = stats

    def _scatter(self, t: Tensor) -> list[Tensor]:
        if self.on_cuda:
            return list(scatter(t, self.devices))
        return [c for c in t.chunk(len(self.devices)) if len(c)]  # the chunks torch's scatter makes

    def _gather(self, ts: list[Tensor]) -> Tensor:
        if self.on_cuda:
            return gather(ts, self.devices[0])  # type: ignore[no-any-return]  # torch: untyped
        return torch.cat(ts)

    def _per_device(self, args: list[tuple[Tensor, ...]], with_loss: bool) -> list[tuple[Tensor, int, float]]:
        """Each device's replica (and loss) on its arguments, one thread per device.

        Per device: (output, or loss with_loss; the output's bytes; seconds).
        """
        n = len(args)
        if self.on_cuda:
            replicas = replicate(self.module, self.devices[:n])
            units: list[nn.Module] = [_WithLoss(r, self.loss_fn) if with_loss else r for r in replicas]
            start = time.perf_counter()
            outs = parallel_apply(units, args, devices=self.devices[:n])
            seconds = time.perf_counter() - start  # asynchronous kernels: the launches only
            sizes = [
                int(getattr(u, "output_bytes", 0)) or _nbytes(o) for u, o in zip(units, outs, strict=True)
            ]
            return [(o, b, seconds) for o, b in zip(outs, sizes, strict=True)]
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        results: list[tuple[Tensor, int, float] | BaseException | None] = [None] * n

        def run(k: int) -> None:
            try:
                start = time.perf_counter()
                mod = self.module if k == 0 else self._copies[k - 1]
                # clones: autograd routes each copy's gradient back to the module's parameters
                own = {name: t if k == 0 else t.clone() for name, t in tensors.items()}
                out = functional_call(mod, own, (args[k][0],))
                size = _nbytes(out)
                if with_loss:
                    out = self.loss_fn(out, args[k][1])
                results[k] = (out, size, time.perf_counter() - start)
            except BaseException as e:  # carried back to the caller and re-raised there
                results[k] = e

        threads = [threading.Thread(target=run, args=(k,), name=f"dp-threads-{k}") for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [r for r in results if isinstance(r, tuple)]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
