"""all_to_all_single against torch's own, run inside a spawned world (any transport).

Returns the list of what differed, empty when every algorithm matched torch bit for bit.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from ringtree import comm


def splits_cases(p: int) -> dict[str, list[list[int]]]:
    """Named matrices of rows, sizes[i][j] from rank i to rank j."""
    return {
        "uneven": [[(3 * i + 2 * j) % 5 for j in range(p)] for i in range(p)],
        "zero blocks": [[0 if (i + j) % 2 else i + j + 1 for j in range(p)] for i in range(p)],
        "rank 0 sends nothing": [[0 if i == 0 else 2 for j in range(p)] for i in range(p)],
    }


def against_torch(rank: int) -> list[str]:
    p, failures = dist.get_world_size(), []
    names = [*comm.algorithms("all_to_all"), "auto"]
    for dtype in (torch.float32, torch.int32):
        x = (torch.arange(6 * p * 3).view(6 * p, 3) + 1000 * rank).to(dtype)
        for algorithm in names:
            want = torch.empty_like(x)
            got = torch.empty(3, 6 * p, dtype=dtype).t()  # a non-contiguous output is written back
            comm.all_to_all_single(got, x, algorithm=algorithm)
            dist.all_to_all_single(want, x)
            if not torch.equal(got, want):
                failures.append(f"equal {algorithm} {dtype}")
    for case, sizes in splits_cases(p).items():
        ins = sizes[rank]
        outs = [sizes[i][rank] for i in range(p)]
        x = torch.arange(sum(ins) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank
        want = torch.full((sum(outs), 2), -1.0, dtype=torch.float64)
        dist.all_to_all_single(want, x, outs, ins)
        for algorithm in names:
            got = torch.full_like(want, -1.0)
            comm.all_to_all_single(got, x, outs, ins, algorithm=algorithm)
            if not torch.equal(got, want):
                failures.append(f"{case} {algorithm}")
        for algorithm in ("bruck", "linear"):  # the sizes known everywhere: nothing exchanged
            got = torch.full_like(want, -1.0)
            comm.all_to_all_single(got, x, outs, ins, algorithm, validate=False, split_matrix=sizes)
            if not torch.equal(got, want):
                failures.append(f"{case} {algorithm} with split_matrix")
    return failures


def gradients_against_torch(rank: int) -> list[str]:
    """The autograd form's output and input gradient against torch.distributed.nn's."""
    p, failures = dist.get_world_size(), []
    sizes = splits_cases(p)["uneven"]
    ins, outs = sizes[rank], [sizes[i][rank] for i in range(p)]
    x = torch.arange(sum(ins) * 3, dtype=torch.float64).view(-1, 3) + 10 * rank
    weight = torch.arange(sum(outs) * 3, dtype=torch.float64).view(-1, 3) % 7 - 3
    a = x.clone().requires_grad_()
    with warnings.catch_warnings():  # deprecated for the traced functional collectives, still exact
        warnings.simplefilter("ignore", FutureWarning)
        want = dist_fn.all_to_all_single(torch.empty(sum(outs), 3, dtype=torch.float64), a, outs, ins)
    (want * weight).sum().backward()
    for algorithm in [*comm.algorithms("all_to_all"), "auto"]:
        b = x.clone().requires_grad_()
        got = comm.all_to_all_single_autograd(b, outs, ins, algorithm)
        (got * weight).sum().backward()
        if not torch.equal(got.detach(), want.detach()) or not torch.equal(b.grad, a.grad):  # type: ignore[arg-type]
            failures.append(f"autograd {algorithm}")
    return failures
