"""PowerSGD: gradient buckets compressed to rank-r products P Q^T (Vogels et al., arXiv:1905.13727).

One bucket at a time, step for step as torch's `powerSGD_hook` (torch's implementation is the
reference; the tests compare gradients with it). Before `start_iter` synchronizations a bucket is
divided by the world size and summed (a plain all-reduce). From then on, per bucket:

1. the local error of the last step is added (error feedback) and the input kept;
2. every parameter's gradient is viewed as an n x m matrix (n = its first dimension); those for
   which (n + m) r x min_compression_rate < n m are compressed, the rest (every 1-D bias at the
   default rate 2) travel uncompressed in one flat all-reduce, then are divided by the world size;
3. Q (m x r; warm start: last step's, otherwise standard normal from a seed drawn from
   numpy's RandomState(seed), the same on every rank) is orthogonalised and P = M Q summed;
4. P is orthogonalised, Q = M^T P summed and divided by the world size, and M becomes P Q^T;
5. the local error is the input minus that result.

The sums are the caller's `all_reduce` (any ringtree algorithm). The only departure from torch:
fp16/bf16 matrices are orthogonalised in fp32 (torch does it in the gradients' dtype, where
Gram-Schmidt's squares can underflow or overflow), so fp32 gradients give torch's results.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across the group, in place

HALF = (torch.float16, torch.bfloat16)


class PowerSGD:
    """PowerSGD's options and state (torch's PowerSGDState): one object per DDP wrapper or hook.

    rank: columns of P and Q (torch's matrix_approximation_rank); start_iter: synchronizations
    that run a plain all-reduce first; min_compression_rate: a matrix smaller than this many
    times its P and Q travels uncompressed; error_feedback, warm_start: as torch's; seed: of the
    random Q; epsilon: added to every column norm in the orthogonalisation (0: as torch's default).
    """

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 1000,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        *,
        epsilon: float = 0.0,
    ) -> None:
        _check(rank, start_iter, min_compression_rate, epsilon)
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, min_compression_rate
        self.error_feedback, self.warm_start, self.seed, self.epsilon = (
            error_feedback,
            warm_start,
            seed,
            epsilon,
        )
        self.rng = np.random.RandomState(seed)  # seeds of the random Qs, in the same order on every rank
        self.error: dict[int, torch.Tensor] = {}  # bucket -> this rank's compression error
        self.p_memory: dict[int, torch.Tensor] = {}  # bucket -> every P of it, flat
        self.q_memory: dict[int, torch.Tensor] = {}  # bucket -> every Q of it, flat (warm start)
        self.iter = 0  # synchronizations done
        self.numel_before = 0  # elements that compressed buckets held, summed over their steps
        self.numel_after = 0  # elements they sent instead (P, Q and the uncompressed ones)
        self.work_s = 0.0  # seconds of this rank's own work in compressed steps, its all-reduces excluded
        self.compressed_steps = 0  # synchronizations that compressed
        self.work_on_host = True  # False once a bucket is on a GPU (its kernels run behind the host's clock)
        self._bound = False  # taken by one DDP wrapper or hook: its buckets' memories are keyed by index

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
            f"min_compression_rate={self.min_compression_rate}, error_feedback={self.error_feedback}, "
            f"warm_start={self.warm_start}, seed={self.seed})"
        )

    def bind(self) -> None:
        """Claim this state for one DDP wrapper or hook (refused for a second: bucket 0 of two
        models would share one error buffer)."""
        if self._bound:
            raise ValueError(
                "this PowerSGD object already compresses another model's buckets (its error and Q "
                "memories are per bucket); give each DistributedDataParallel or hook its own PowerSGD(...)"
            )
        self._bound = True

    @property
    def compressing(self) -> bool:
        """Whether the next synchronization compresses (start_iter synchronizations are behind)."""
        return self.iter >= self.start_iter

    def compression_rate(self) -> float:
        """Elements before compression over elements sent, over the compressed steps (0: none yet)."""
        return self.numel_before / self.numel_after if self.numel_after else 0.0

    def work_s_per_step(self) -> float | None:
        """Seconds per compressed synchronization of PowerSGD's own work on this rank (error
        feedback, the matmuls, orthogonalisation, the product written back; its all-reduces and
        the waits in them excluded), wall time on the host; None before any compressed step or
        for GPU buckets, whose kernels the host's clock does not see."""
        if not self.compressed_steps or not self.work_on_host:
            return None
        return self.work_s / self.compressed_steps

    def reduce(
        self,
        index: int,
        flat: torch.Tensor,
        grads: Sequence[torch.Tensor],
        world_size: int,
        all_reduce: AllReduce,
    ) -> None:
        """Average bucket `index` across the group in place: `flat` holds this rank's summed (not
        divided) gradients, `grads` the parameters' views of it, in the bucket's order."""
        if not self.compressing:
            all_reduce(flat.div_(world_size))
            return
        started, waited = time.perf_counter(), 0.0
        self.work_on_host &= flat.device.type == "cpu"

        def timed(t: torch.Tensor) -> None:  # the sums' time, left out of the work's
            nonlocal waited
            begun = time.perf_counter()
            all_reduce(t)
            waited += time.perf_counter() - begun

        self._compress(index, flat, grads, world_size, timed)
        self.work_s += time.perf_counter() - started - waited

    def _compress(
        self,
        index: int,
        flat: torch.Tensor,
        grads: Sequence[torch.Tensor],
        world_size: int,
        all_reduce: AllReduce,
    ) -> None:
        """One compressed synchronization of bucket `index` (steps 1-5 of the module's docstring)."""
        kept = self._feed_error(index, flat)
        compress, plain = self._split(grads)
        matrices, ps, qs = self._low_rank(index, compress, flat)
        for m, q, p in zip(matrices, qs, ps, strict=True):
            torch.bmm(m, q, out=p)  # P = M Q
        _average_plain(plain, flat, world_size, all_reduce)
        all_reduce(self.p_memory[index])  # orthogonalised next: no need to divide
        for p in ps:
            orthogonalize(p, self.epsilon)
        for m, p, q in zip(matrices, ps, qs, strict=True):
            torch.bmm(m.transpose(1, 2), p, out=q)  # Q = M^T P
        all_reduce(self.q_memory[index])
        self.q_memory[index].div_(world_size)
        for p, q, m in zip(ps, qs, matrices, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=m)  # M = P Q^T, into the bucket
        if kept is not None:
            self.error[index] = kept - flat
        if not self.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()

    def step_done(self) -> None:
        """One synchronization of every bucket is over (torch: after the last bucket's)."""
        self.compressed_steps += self.compressing
        self.iter += 1

    def _feed_error(self, index: int, flat: torch.Tensor) -> torch.Tensor | None:
        """Add the last step's local error to the bucket; a copy of the result (None: no feedback)."""
        if not self.error_feedback:
            return None
        if index in self.error:
            flat.add_(self.error[index])
        else:
            self.error[index] = torch.zeros_like(flat)
        return flat.detach().clone()

    def _split(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients as matrices worth compressing, and the rest (torch's _should_compress)."""
        compress, plain = [], []
        for t in grads:
            if t.dim() == 0:
                plain.append(t)
                continue
            matrix = t.view(t.shape[0], -1)
            n, m = matrix.shape
            r = min(n, m, self.rank)
            self.numel_before += n * m
            if (n + m) * r * self.min_compression_rate < n * m:
                compress.append(matrix)
                self.numel_after += (n + m) * r
            else:
                plain.append(t)
                self.numel_after += n * m
        return compress, plain

    def _low_rank(
        self, index: int, compress: list[torch.Tensor], flat: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The matrices (1 x n x m, grouped by shape as torch's), their P and Q views into the
        bucket's memory, and Q orthogonalised: last step's (warm start) or freshly random."""
        matrices = [m.unsqueeze(0) for m in _by_shape(compress)]
        dims = [(m.shape[1], m.shape[2], min(m.shape[1], m.shape[2], self.rank)) for m in matrices]
        fresh = not self.warm_start or index not in self.p_memory
        if fresh:
            self.p_memory[index] = flat.new_empty(sum(n * r for n, _, r in dims))
            self.q_memory[index] = flat.new_empty(sum(m * r for _, m, r in dims))
        ps = list(_views(self.p_memory[index], [(n, r) for n, _, r in dims]))
        qs = list(_views(self.q_memory[index], [(m, r) for _, m, r in dims]))
        if fresh:
            # torch seeds the CPU generator with a draw from the RandomState, for every bucket's
            # fresh Qs, and fills them in order; a generator of our own gives the same numbers
            # without touching the global one (this runs on the communication thread).
            g = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=g, dtype=flat.dtype))
        for q in qs:
            orthogonalize(q, self.epsilon)
        return matrices, ps, qs

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The options and this rank's state (errors, P and Q memories, iteration, the seeds'
        generator), as tensors and numbers that torch.load(weights_only=True) reads back."""
        _, keys, pos, has_gauss, cached = self.rng.get_state(legacy=True)
        generator = {"keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos)}
        return {
            "options": self._options(),
            "iter": self.iter,
            "rng": generator | {"has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "error": {str(k): v.detach().cpu().clone() for k, v in self.error.items()},
            "p_memory": {str(k): v.detach().cpu().clone() for k, v in self.p_memory.items()},
            "q_memory": {str(k): v.detach().cpu().clone() for k, v in self.q_memory.items()},
            "numel": [self.numel_before, self.numel_after],
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Continue from `state_dict()`'s output (the same options; tensors go to `device`)."""
        if state["options"] != self._options():
            raise ValueError(
                f"the saved PowerSGD state has options {state['options']}, this one {self._options()}; "
                "resume with the options the run was saved with"
            )
        self.iter = int(state["iter"])
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        for name in ("error", "p_memory", "q_memory"):
            setattr(self, name, {int(k): v.to(device) for k, v in state[name].items()})
        self.numel_before, self.numel_after = (int(n) for n in state["numel"])

    def _options(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_iter": self.start_iter,
            "min_compression_rate": float(self.min_compression_rate),
            "error_feedback": self.error_feedback,
            "warm_start": self.warm_start,
            "seed": self.seed,
            "epsilon": float(self.epsilon),
        }


def _average_plain(
    plain: list[torch.Tensor], flat: torch.Tensor, world_size: int, all_reduce: AllReduce
) -> None:
    """The uncompressed tensors summed in one flat copy, divided by the world size, put back."""
    uncompressed = torch.cat([t.view(-1) for t in plain]) if plain else flat.new_empty(0)
    all_reduce(uncompressed)
    uncompressed.div_(world_size)
    offset = 0
    for t in plain:
        t.copy_(uncompressed[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of each matrix of a batch [b, n, r] (r <= n) in place, as
    torch's: Gram-Schmidt for r <= 2, QR otherwise; fp16/bf16 go through fp32."""
    if matrices.dtype in HALF:
        wide = matrices.float()
        orthogonalize(wide, epsilon)
        return matrices.copy_(wide)
    assert matrices.dim() == 3 and matrices.shape[2] <= matrices.shape[1]
    if matrices.shape[2] <= 2:
        _gram_schmidt(matrices, epsilon)
    else:
        b, _, r = matrices.shape
        torch.linalg.qr(matrices, out=(matrices, matrices.new_empty(b, r, r)))
    return matrices


def _gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    r = matrices.shape[2]
    for i in range(r):  # i: the column made unit and removed from the ones after it
        col = matrices[:, :, i : i + 1]
        col /= (
            torch.norm(col, dim=1, keepdim=True) + epsilon
            if epsilon
            else torch.norm(col, dim=1, keepdim=True)
        )
        if i + 1 < r:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _by_shape(matrices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The matrices grouped by shape, groups in order of first appearance (torch's order)."""
    groups: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    for m in matrices:
        groups[m.shape].append(m)
    return [m for group in groups.values() for m in group]


def _views(memory: torch.Tensor, shapes: list[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """Consecutive [1, rows, cols] views of a flat tensor."""
    offset = 0
    for rows, cols in shapes:
        yield memory[offset : offset + rows * cols].view(1, rows, cols)
        offset += rows * cols


def _check(rank: int, start_iter: int, min_compression_rate: float, epsilon: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"PowerSGD rank must be an integer of at least 1, got {rank!r}; torch's default is 1"
        )
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"PowerSGD start_iter must be an integer of at least 0, got {start_iter!r}")
    if not min_compression_rate > 0:
        raise ValueError(f"PowerSGD min_compression_rate must be positive, got {min_compression_rate!r}")
    if not epsilon >= 0:
        raise ValueError(f"PowerSGD epsilon must be 0 or more, got {epsilon!r}")
