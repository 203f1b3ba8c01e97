"""Mixed precision: torch.autocast (bf16 anywhere, fp16 on CUDA with GradScaler); skipped steps counted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

AMP_MODES = ("off", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(mode: str, device_type: str) -> None:
    """Raise ValueError for an unknown mode, or fp16 off CUDA (where ringtree has no loss scaling)."""
    if mode not in AMP_MODES:
        raise ValueError(f"unknown amp {mode!r}; choose one of {', '.join(AMP_MODES)}")
    if mode == "fp16" and device_type != "cuda":
        raise ValueError(
            f"--amp fp16 needs a CUDA device, this run is on {device_type!r}: fp16's narrow exponent "
            "range needs dynamic loss scaling (GradScaler), which is for CUDA; use --amp bf16 on CPU "
            "(fp32's exponent range, no scaling needed)"
        )


class MixedPrecision:
    """Autocast for forward, loss scaling for backward (fp16), and a count of the steps not applied.

    A step whose gradients hold inf or NaN is skipped, never applied: with fp16 GradScaler skips it
    and lowers its scale; with bf16 (no scaler) `step` checks the gradients itself. `finite` lets a
    data-parallel caller agree across ranks before stepping (see `all_finite`).
    """

    def __init__(self, mode: str, device_type: str = "cpu") -> None:
        check_amp(mode, device_type)
        self.mode = mode
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if mode == "fp16" else None
        self.skipped_steps = 0

    def autocast(self) -> AbstractContextManager[object]:
        """The context for forward and the loss (nothing when amp is off)."""
        if self.mode == "off":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=_DTYPES[self.mode])

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled first under fp16."""
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        scaled.backward()  # type: ignore[no-untyped-call]

    def step(self, optimizer: torch.optim.Optimizer, agree: Callable[[bool], bool] | None = None) -> bool:
        """Step unless a gradient is not finite; True when the step was applied.

        agree: turns this rank's verdict into the one every rank shares (e.g. an all-reduce of
        the flag), so that data- and pipeline-parallel ranks skip the same steps. With amp off
        nothing is checked (no host sync).
        """
        if self.mode == "off":
            optimizer.step()
            return True
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ok = all_finite(params)
        ok = ok if agree is None else agree(ok)
        if self.scaler is not None:
            if ok:
                self.scaler.step(optimizer)  # the unscaled gradients are finite here: it steps
                self.scaler.update()
            else:  # back off as GradScaler would, the same on every rank
                self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        elif ok:
            optimizer.step()
        self.skipped_steps += 0 if ok else 1
        return ok


def all_finite(params: Iterable[nn.Parameter | torch.Tensor]) -> bool:
    """True when no gradient holds inf or NaN (parameters without a gradient count as finite)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())  # one host sync


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (a ZeRO shard's DTensor: its block; the caller agrees)."""
    return t.to_local() if hasattr(t, "to_local") else t
