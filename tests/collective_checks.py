"""Every collective and algorithm against torch's own, run inside a spawned world.

One check for every transport's tests (shared memory, gloo point-to-point in pieces): each
returns the list of what differed, empty when everything matched torch bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtree import comm


def against_torch(rank: int, count: int) -> list[str]:
    """Every algorithm of every collective on `count` small integers (exact in any order)."""
    p, failures = dist.get_world_size(), []
    for dtype in (torch.float32, torch.int32):
        x = (torch.arange(count) * (rank + 1) % 17 - 8).to(dtype)
        for algorithm in comm.algorithms("all_reduce")[1:]:
            for op, torch_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                got, want = x.clone(), x.clone()
                comm.all_reduce(got, op, algorithm=algorithm)
                dist.all_reduce(want, op=torch_op)
                if not torch.equal(got, want):
                    failures.append(f"all_reduce {op} {algorithm} {dtype}")
                every = [torch.empty_like(got) for _ in range(p)]
                dist.all_gather(every, got)
                if not all(torch.equal(e, got) for e in every):
                    failures.append(f"all_reduce {op} {algorithm} {dtype}: ranks differ")
        full, n = x[: count - count % p].clone(), count // p
        for algorithm in comm.algorithms("reduce_scatter")[1:]:
            out, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            comm.reduce_scatter(out, full, algorithm=algorithm)
            dist.reduce_scatter_tensor(ref, full)
            if not torch.equal(out, ref):
                failures.append(f"reduce_scatter {algorithm} {dtype}")
        for algorithm in comm.algorithms("all_gather")[1:]:
            out, ref = torch.empty(p * count, dtype=dtype), torch.empty(p * count, dtype=dtype)
            comm.all_gather(out, x, algorithm=algorithm)
            dist.all_gather_into_tensor(ref, x)
            if not torch.equal(out, ref):
                failures.append(f"all_gather {algorithm} {dtype}")
        for algorithm in comm.algorithms("broadcast")[1:]:
            got = x.clone()
            comm.broadcast(got, src=1, algorithm=algorithm)
            if not torch.equal(got, (torch.arange(count) * 2 % 17 - 8).to(dtype)):
                failures.append(f"broadcast {algorithm} {dtype}")
        for algorithm in comm.algorithms("reduce")[1:]:
            got, want = x.clone(), x.clone()
            comm.reduce(got, dst=p - 1, algorithm=algorithm)
            dist.reduce(want, dst=p - 1)
            if rank == p - 1 and not torch.equal(got, want):
                failures.append(f"reduce {algorithm} {dtype}")
    return failures
