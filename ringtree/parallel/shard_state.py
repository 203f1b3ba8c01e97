"""What ShardedDataParallel shows as its parameters and state: the shards, as FSDP2 does.

`parameters()` and `named_parameters()` give the flat shards (DTensors, one per bucket), what an
optimizer, torch's `clip_grad_norm_` and an LR scheduler built on `model.parameters()` need.
`state_dict()` gives them with the module's buffers (this layout's save); `full_state_dict()`
gathers the dense state_dict of the wrapped module and `load_full_state_dict()` cuts one into the
shards, as torch.distributed.checkpoint's state-dict helpers do for FSDP2.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ringtree.parallel.mismatch import check_keys
from ringtree.parallel.shards import FlatBucket, local


class ShardStateDicts(nn.Module):
    """The base of ShardedDataParallel that shows the shards (its `buckets`, `module`, gathering)."""

    buckets: list[FlatBucket]
    module: nn.Module

    def gather_parameters(self) -> None:
        raise NotImplementedError

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The shards, named `shards.<bucket>`, then any trained parameter ZeRO leaves whole (an expert
        under expert parallelism), under its module's name: what an optimizer on `parameters()` steps."""
        dot = f"{prefix}." if prefix else ""
        for b in self.buckets:
            yield f"{dot}shards.{b.index}", b.shard
        bucketed = {id(p) for b in self.buckets for p in b.params}
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in bucketed:
                yield f"{dot}module.{name}", p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shards (DTensors) and the module's buffers: what this layout saves and loads."""
        out: dict[str, Any] = {n: p.detach() for n, p in self.named_parameters()}
        return out | {n: b.detach() for n, b in self.module.named_buffers()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load what `state_dict()` gave (the same layout); for another layout, `load_full_state_dict`."""
        expected = self.state_dict()
        check_keys(expected, state_dict)
        with torch.no_grad():
            for name, value in expected.items():
                local(value).copy_(local(state_dict[name]))
        for b in self.buckets:
            b.version = -1  # whole parameters out of date: gathered again before use
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's dense state_dict, gathered from every rank (collective)."""
        self.gather_parameters()
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Cut a dense state_dict of the wrapped module into this rank's shards (no communication)."""
        check_keys(self.module.state_dict(), state)
        with torch.no_grad():
            for b in self.buckets:
                flat = torch.zeros(b.full.numel(), dtype=b.full.dtype)
                for name, p, off in zip(b.names, b.params, b.offsets, strict=True):
                    flat[off : off + p.numel()] = state[name].reshape(-1)
                b.local.copy_(flat[b.block])
                b.version = -1
            owned = dict(self.module.named_buffers())
            for name, buffer in owned.items():
                buffer.copy_(state[name])
