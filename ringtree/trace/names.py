"""Names in traces: which kernels communicate, which collective an op or kernel is, dtype sizes.

The kernel classes follow Holistic Trace Analysis (hta/common/types.py) so that the breakdown
agrees with it, and add what it misses: NCCL >= 2.19's `ncclDevKernel_*`, RCCL, and any kernel
whose arguments name a collective.
"""

from __future__ import annotations

import re

from ringtree.trace.events import COMM, COMPUTE, MEMCPY, OTHER

_HTA_COMM = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
_ANY_COMM = re.compile(r"(?i)nccl|rccl")
_HTA_MEMORY = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
    r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
    r"|(^collective_subgraph_execution)"
)


def kernel_kind(name: str, cat: str, has_collective_args: bool) -> int:
    """COMM, MEMCPY, COMPUTE or OTHER (synchronisation rows) for a GPU event."""
    if has_collective_args or _HTA_COMM.match(name) or _ANY_COMM.search(name):
        return COMM
    if cat in ("gpu_memcpy", "gpu_memset", "Memcpy", "Memset") or _HTA_MEMORY.match(name):
        return MEMCPY
    if _HTA_NOT_COMPUTE.match(name):
        return OTHER
    return COMPUTE


# Collective names as Kineto's `Collective name` arg, c10d's ops, NCCL's record functions and
# gloo's write them, lower-cased, without leading underscores and c10d's `_base`/`_` suffixes.
_OPS = {
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "allgather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "alltoallv": "all_to_all",
    "all_to_allv": "all_to_all",
    "alltoall_base": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recvanysource": "recv",
    "recv_any_source": "recv",
}
_KERNEL = re.compile(r"(?i)nccl(?:Dev|Symk?Dev)?Kernel_([A-Za-z]+)")
_KERNEL_OPS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "send_recv",  # all-to-all or point-to-point: only the host side tells
}


def collective_op(name: str) -> str | None:
    """The collective a `Collective name` arg or a host op names (c10d::allreduce_,
    nccl:_all_gather_base, gloo:all_to_all, ringtree:all_reduce), or None."""
    text = name.split("::", 1)[-1].split(":", 1)[-1].strip().lower()
    text = text.split(" ", 1)[0].strip("_").removesuffix("_base").strip("_")
    return _OPS.get(text)


def kernel_op(name: str) -> str | None:
    """The collective an NCCL kernel's name gives (<= 2.18 `ncclKernel_AllReduce_RING_LL_Sum_float`,
    >= 2.19 `ncclDevKernel_AllGather_RING_LL`), `send_recv` for SendRecv, None if no NCCL kernel."""
    m = _KERNEL.search(name)
    if m is None:
        return None
    return _KERNEL_OPS.get(m.group(1).lower(), m.group(1).lower())


def is_host_collective(name: str) -> bool:
    """A host-side collective op or record function (the ones old traces carry the size on)."""
    return name.startswith(("nccl:", "gloo:", "ringtree:", "c10d::")) and collective_op(name) is not None


# dtype spellings (Kineto's `dtype`: Float, BFloat16; `Input type`: float, c10::BFloat16,
# unsigned char) -> (torch name, bytes per element)
_DTYPES = {
    "float": ("float32", 4),
    "float32": ("float32", 4),
    "double": ("float64", 8),
    "float64": ("float64", 8),
    "half": ("float16", 2),
    "c10::half": ("float16", 2),
    "float16": ("float16", 2),
    "bfloat16": ("bfloat16", 2),
    "c10::bfloat16": ("bfloat16", 2),
    "long": ("int64", 8),
    "long int": ("int64", 8),
    "int64": ("int64", 8),
    "int": ("int32", 4),
    "int32": ("int32", 4),
    "short": ("int16", 2),
    "int16": ("int16", 2),
    "char": ("int8", 1),
    "signed char": ("int8", 1),
    "int8": ("int8", 1),
    "byte": ("uint8", 1),
    "unsigned char": ("uint8", 1),
    "uint8": ("uint8", 1),
    "bool": ("bool", 1),
    "c10::float8_e4m3fn": ("float8_e4m3fn", 1),
    "float8_e4m3fn": ("float8_e4m3fn", 1),
    "c10::float8_e5m2": ("float8_e5m2", 1),
    "float8_e5m2": ("float8_e5m2", 1),
}


def dtype(name: str) -> tuple[str, int] | None:
    """(torch's name, bytes per element) of a trace's dtype spelling, or None."""
    return _DTYPES.get(name.strip().lower())
