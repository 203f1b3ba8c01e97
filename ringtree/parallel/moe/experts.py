"""The routed experts: E SwiGLU networks stored as three stacked weights, run on expert-major rows.

Rows arrive sorted by expert (`counts[e]` rows for expert e, in order). On CUDA in bf16 (autocast
or a bf16 model), where this torch has it, the three matmuls of all experts run as one grouped
matmul each (torch._grouped_mm, offsets = the running sum of the counts, as torchtitan's
GroupedExperts); elsewhere a loop runs each expert on its slice. Every expert runs even on no
rows, so each weight gets a gradient (zero) and the data-parallel reduction sees every tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the grouped path runs for rows x: CUDA, bf16, and torch has _grouped_mm."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts d -> hidden -> d: down(silu(gate(x)) * up(x)) for each one's rows.

    w_gate, w_up: [E, d, hidden]; w_down: [E, hidden, d]. Expert parallelism keeps a slice of E.
    """

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w_up = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w_down = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)
        self.grouped = True  # False: always the loop (the GPU check compares the two)

    @property
    def local_experts(self) -> int:
        return int(self.w_gate.shape[0])

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [sum(counts), d] in expert-major order -> [sum(counts), d]."""
        aligned = rows.shape[-1] % 8 == 0 and self.w_gate.shape[-1] % 8 == 0  # 16-byte strides in bf16
        if self.grouped and aligned and grouped_mm_available(rows):
            try:
                return self._grouped(rows, counts)
            except RuntimeError:  # a GPU this torch has no grouped kernel for: the loop from now on
                self.grouped = False
        outs = []
        for e, x in enumerate(torch.split(rows, counts)):
            h = F.silu(x @ self.w_gate[e].to(x.dtype)) * (x @ self.w_up[e].to(x.dtype))
            outs.append(h @ self.w_down[e].to(x.dtype))
        return torch.cat(outs) if outs else rows

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        dtype = rows.dtype
        gate = torch._grouped_mm(rows, self.w_gate.to(dtype), offs=offs)
        up = torch._grouped_mm(rows, self.w_up.to(dtype), offs=offs)
        out: torch.Tensor = torch._grouped_mm(F.silu(gate) * up, self.w_down.to(dtype), offs=offs)
        return out
