"""A fragment's global copy and its pseudo-gradients in flat fp32 buckets (DiLoCo's outer state)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ringtree.parallel.buckets import MB


def layers_of(model: nn.Module) -> list[list[nn.Parameter]]:
    """The model's layers, each as its trainable parameters: the children of the model (those of a
    Sequential or ModuleList child one by one); parameters of the model itself form one more layer.
    A parameter shared by two layers belongs to the first."""
    seen: set[int] = set()

    def fresh(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        out = [p for p in params if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    modules: list[nn.Module] = []
    for child in model.children():
        is_list = isinstance(child, nn.Sequential | nn.ModuleList)
        modules += list(child.children()) if is_list else [child]
    layers = [fresh(list(m.parameters())) for m in modules]
    layers.append(fresh(list(model.parameters(recurse=False))))
    return [layer for layer in layers if layer]


class OuterBuckets:
    """`params`' global copy (on `device`, their dtype) and fp32 flat buffers, one per bucket of at
    most `cap_mb`, holding the pseudo-gradients (global - local), then their average."""

    def __init__(self, params: Sequence[nn.Parameter], device: str | torch.device, cap_mb: float) -> None:
        self.params = list(params)
        device = torch.device(device)
        pin = device.type == "cpu" and any(p.is_cuda for p in self.params) and torch.cuda.is_available()
        self.globals = [_copy(p, device, pin) for p in self.params]
        self.slots: list[list[tuple[int, int]]] = []  # per bucket: (param index, offset)
        sizes: list[int] = []
        for i, p in enumerate(self.params):
            if not self.slots or (sizes[-1] + p.numel()) * 4 > cap_mb * MB:
                self.slots.append([])
                sizes.append(0)
            self.slots[-1].append((i, sizes[-1]))
            sizes[-1] += p.numel()
        self.flats = [
            torch.zeros(n, dtype=torch.float32, device=device).pin_memory()
            if pin
            else torch.zeros(n, dtype=torch.float32, device=device)
            for n in sizes
        ]

    def _views(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]:
        """(parameter, its global copy, its slice of a flat buffer shaped like it)."""
        for flat, slots in zip(self.flats, self.slots, strict=True):
            for i, offset in slots:
                p = self.params[i]
                yield p, self.globals[i], flat[offset : offset + p.numel()].view_as(p)

    @torch.no_grad()
    def pseudo_gradient(self) -> None:
        """Each bucket := global copy - local parameters, in fp32."""
        for p, g, view in self._views():
            view.copy_(p.detach().to(view.device, torch.float32))
            torch.sub(g.float(), view, out=view)

    def set_outer_gradients(self) -> None:
        """The averaged pseudo-gradients become the global copy's .grad (what the outer step reads)."""
        for _, g, view in self._views():
            g.grad = view.to(g.dtype) if g.dtype != torch.float32 else view

    @torch.no_grad()
    def load_globals(self, merge_alpha: float) -> None:
        """The parameters := global + merge_alpha (local - global): the global copy when alpha is 0."""
        for p, g, _ in self._views():
            new = g.to(p.device, non_blocking=True)
            if merge_alpha:
                p.lerp_(new, 1.0 - merge_alpha)  # p + (1 - a)(new - p) = new + a (p - new)
            else:
                p.copy_(new)

    @contextmanager
    def on_wire(self, device: torch.device | None) -> Iterator[list[torch.Tensor]]:
        """The flat buffers where the collectives can reach them: themselves (device None), or GPU
        copies on a side stream (NCCL), copied back on exit."""
        if device is None:
            yield self.flats
            return
        torch.cuda.set_device(device)  # this may be DiLoCo's thread, whose current device is cuda:0
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        with torch.cuda.stream(stream):
            moved = [f.to(device, non_blocking=True) for f in self.flats]
            yield moved
            for f, m in zip(self.flats, moved, strict=True):
                f.copy_(m, non_blocking=True)
        stream.synchronize()


def _copy(p: nn.Parameter, device: torch.device, pin: bool) -> torch.Tensor:
    copy = p.detach().to(device, copy=True)
    return copy.pin_memory() if pin else copy
