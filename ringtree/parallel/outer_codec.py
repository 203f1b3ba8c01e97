"""Pseudo-gradients on the wire: fp32, bf16, fp8, int8 or int4 with per-block scales, summed in fp32.

A quantised average cannot be a plain all-reduce (every rank's scales differ), so it runs as the
all-reduce's two halves: an all-to-all hands shard j of every rank's encoded buffer to rank j,
which decodes them to fp32, averages and re-encodes its shard; an all-gather of the encoded shards
gives every rank the whole average. Each element crosses the wire twice, as in a ring all-reduce,
at 1/4 (int8, fp8) or 1/8 (int4) of fp32's bytes plus one fp32 scale per BLOCK elements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtree import comm
from ringtree.comm.alltoall import all_to_all_single

OUTER_DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")
BLOCK = 128  # elements sharing one scale: small enough that one outlier costs only its block
_QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}  # largest encodable magnitude (e4m3: 448)


def check_dtype(outer_dtype: str) -> None:
    if outer_dtype not in OUTER_DTYPES:
        raise ValueError(
            f"unknown outer_dtype (--outer-dtype) {outer_dtype!r}; choose one of {', '.join(OUTER_DTYPES)}"
        )


def payload_bytes(n: int, outer_dtype: str) -> int:
    """Bytes n elements take on the wire in `outer_dtype`, scales included (n a multiple of BLOCK)."""
    per = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}[outer_dtype]
    scales = 4 * (n // BLOCK) if outer_dtype in _QMAX else 0
    return int(n * per) + scales


def encode(x: torch.Tensor, outer_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload as uint8, per-block fp32 scales) of a flat fp32 `x` whose length is a multiple of BLOCK."""
    if outer_dtype == "fp32":
        return x.contiguous().view(torch.uint8), x.new_empty(0)
    if outer_dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8), x.new_empty(0)
    blocks = x.view(-1, BLOCK)  # (n / BLOCK, BLOCK)
    qmax = _QMAX[outer_dtype]
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / qmax
    scaled = blocks / scales[:, None]
    if outer_dtype == "fp8":
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1), scales
    q = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    if outer_dtype == "int8":
        return q.view(torch.uint8).reshape(-1), scales
    nibbles = (q + 8).to(torch.uint8).view(-1, 2)  # int4: two values per byte, offset to 1..15
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scales


def decode(payload: torch.Tensor, scales: torch.Tensor, outer_dtype: str) -> torch.Tensor:
    """The flat fp32 values `encode` turned into (payload, scales)."""
    if outer_dtype == "fp32":
        return payload.view(torch.float32)
    if outer_dtype == "bf16":
        return payload.view(torch.bfloat16).float()
    if outer_dtype == "fp8":
        values = payload.view(torch.float8_e4m3fn).float()
    elif outer_dtype == "int8":
        values = payload.view(torch.int8).float()
    else:
        low, high = (payload & 0xF).to(torch.int16) - 8, (payload >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=1).reshape(-1).float()
    return (values.view(-1, BLOCK) * scales[:, None]).reshape(-1)


def padded(n: int, shards: int) -> int:
    """The smallest length >= n that cuts into `shards` shards of whole blocks."""
    unit = BLOCK * shards
    return -(-n // unit) * unit


def average(
    flat: torch.Tensor,
    outer_dtype: str,
    group: dist.ProcessGroup | None,
    algorithm: str,
    timeout_s: float,
) -> int:
    """Average the fp32 `flat` over `group` in place, encoded as `outer_dtype` on the wire.

    Returns the bytes this rank sent. fp32 is ringtree's all-reduce (op avg, `algorithm`); the
    others are the all-to-all / decode-and-average / all-gather of the module's docstring.
    """
    r = dist.get_world_size(group)
    if outer_dtype == "fp32":
        comm.all_reduce(flat, "avg", algorithm, group, timeout_s=timeout_s, validate=False)
        return 2 * (r - 1) * flat.numel() * 4 // r
    n = flat.numel()
    work = torch.zeros(padded(n, r), dtype=torch.float32, device=flat.device)
    work[:n] = flat
    payload, scales = encode(work, outer_dtype)
    got_payload, got_scales = torch.empty_like(payload), torch.empty_like(scales)
    all_to_all_single(got_payload, payload, group=group, timeout_s=timeout_s, validate=False)
    if scales.numel():
        all_to_all_single(got_scales, scales, group=group, timeout_s=timeout_s, validate=False)
    shard = work.numel() // r
    parts = decode(got_payload, got_scales, outer_dtype).view(r, shard)  # row j: rank j's shard
    mine_payload, mine_scales = encode(parts.sum(dim=0).div_(r), outer_dtype)
    all_payload = torch.empty(r * mine_payload.numel(), dtype=torch.uint8, device=flat.device)
    all_scales = torch.empty(r * mine_scales.numel(), dtype=torch.float32, device=flat.device)
    gather = algorithm if algorithm in comm.algorithms("all_gather") else "ring"
    comm.all_gather(all_payload, mine_payload, gather, group, timeout_s=timeout_s, validate=False)
    if mine_scales.numel():
        comm.all_gather(all_scales, mine_scales, gather, group, timeout_s=timeout_s, validate=False)
    flat.copy_(decode(all_payload, all_scales, outer_dtype)[:n])
    return 2 * (r - 1) * payload_bytes(shard, outer_dtype)
