"""One spelling per dtype: bf16, fp16, fp32, fp64, fp8, with torch's long names accepted everywhere.

Every command shows and records the short names (`--dtype bf16`, `--amp fp16`, `--grad-dtype fp32`);
a user who writes torch's names (`bfloat16`, `torch.float16`, `half`, `float`) or another case gets
the same. `bench` runs torch tensors, so it turns a short name back into torch's (`torch_name`).
Pure Python: the planner reads it without torch.
"""

from __future__ import annotations

# torch's names (and C's) of the dtypes that have a short one
_SHORT = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}
_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def short(name: str) -> str:
    """The one spelling of a dtype name: 'bfloat16' -> 'bf16', 'torch.float16' -> 'fp16';
    any other name (int32, off, a typo for the caller to refuse) comes back lowercased."""
    key = name.strip().lower().removeprefix("torch.")
    return _SHORT.get(key, key)


def torch_name(name: str) -> str:
    """torch's attribute name of a dtype written either way: 'fp32' or 'float32' -> 'float32'."""
    key = short(name)
    return _TORCH.get(key, key)
