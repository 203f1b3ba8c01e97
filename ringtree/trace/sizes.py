"""A collective's size, dtype and group from what a trace records of it.

New Kineto traces put the collective's own arguments on its kernel (`In msg nelems`, `dtype`,
`Group size`, ...). Older ones only record the host ops' `Input Dims` and `Input type` (with
`record_shapes=True`): c10d's op lists its output and input tensors, NCCL's and gloo's record
function its input. The size reported is nccl-tests' `size`: the all-gather's gathered output,
the reduce-scatter's whole input, the all-to-all's send buffer, the all-reduce's buffer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ringtree.trace import names


def from_kernel_args(args: Mapping[str, Any]) -> tuple[int, str, int, str, int]:
    """(bytes, dtype, group size, group, seq) from Kineto's collective arguments on a kernel."""
    nelems = max(_int(args.get("In msg nelems")), _int(args.get("Out msg nelems")))
    dtype_name, itemsize = names.dtype(str(args.get("dtype", ""))) or (str(args.get("dtype", "")), 0)
    group = str(args.get("Process Group Name", "")) or "0"
    size = _int(args.get("Group size")) or len(group_ranks(args.get("Process Group Ranks")))
    return nelems * itemsize, dtype_name, size, group, _int(args.get("Seq"), -1)


def from_host_ops(
    op: str, records: Sequence[tuple[str, Mapping[str, Any]]], world: int
) -> tuple[int, str, int]:
    """(bytes, dtype, group size) from the host ops around a collective, innermost first: NCCL's,
    gloo's or ringtree's record function lists the input tensor, c10d's op the output and then
    the input (an all-gather's output and a reduce-scatter's input are group-size times the
    other, which gives the group's size where the trace does not say it)."""
    record = next((args for name, args in records if not name.startswith("c10d::")), None)
    c10d = next((args for name, args in records if name.startswith("c10d::")), None)
    c10d_tensors = _tensors(c10d) if c10d is not None else []
    tensors = _tensors(record) if record is not None else []
    if tensors:
        inp = tensors[0]
    elif len(c10d_tensors) >= 2:
        inp = c10d_tensors[1]
    elif c10d_tensors:
        inp = c10d_tensors[0]
    else:
        return 0, "", world
    out = c10d_tensors[0] if len(c10d_tensors) >= 2 else None
    dtype_name, itemsize = names.dtype(inp[1]) or (inp[1], 0)
    total, group = inp[0], world
    if op == "all_gather":
        if out is not None and out[0] > inp[0] and out[0] % inp[0] == 0:
            total, group = out[0], out[0] // inp[0]
        else:
            total = inp[0] * world
    elif op == "reduce_scatter" and out is not None and inp[0] > out[0] and inp[0] % out[0] == 0:
        group = inp[0] // out[0]
    return total * itemsize, dtype_name, group


def _tensors(args: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(elements, dtype) of each tensor argument of a host op (`Input Dims`, `Input type`)."""
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    out = []
    for shape, kind in zip(dims, list(types) + [""] * len(dims), strict=False):
        n = _numel(shape)
        if n:
            out.append((n, str(kind)))
    return out


def from_kernel_name(name: str) -> str:
    """The dtype an NCCL kernel's name carries (`..._Sum_float`, `..._Sum_f32_RING_LL`), or ''."""
    for word in reversed(name.split("(", 1)[0].split("_")):
        found = names.dtype(word) or names.dtype(_SHORT.get(word, ""))
        if found and word not in ("Sum",):
            return found[0]
    return ""


_SHORT = {
    "f32": "float32",
    "f16": "float16",
    "f64": "float64",
    "bf16": "bfloat16",
    "i8": "int8",
    "u8": "uint8",
    "i32": "int32",
    "i64": "int64",
    "int8_t": "int8",
    "uint8_t": "uint8",
    "int32_t": "int32",
    "int64_t": "int64",
    "half": "float16",
    "__nv_bfloat16": "bfloat16",
}


def group_ranks(value: Any) -> list[int]:
    """`Process Group Ranks` ("[0, 1]", or a list) as ints; [] when absent or unreadable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if isinstance(value, list) and all(isinstance(r, int) for r in value):
        return list(value)
    return []


def _numel(shape: Any) -> int:
    if not isinstance(shape, list) or not shape:
        return 0
    if all(isinstance(d, int) for d in shape):
        n = 1
        for d in shape:
            n *= d
        return n
    return sum(_numel(s) for s in shape)  # a TensorList: its tensors' shapes


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
