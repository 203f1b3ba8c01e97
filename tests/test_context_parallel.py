"""Context parallelism against torch's full attention, in one spawned world of 4 ranks.

Every case (CP = 2 and 4, each --cp-comm, causal or not, head-tail or contiguous) runs inside that
world and returns its largest difference from torch's scaled_dot_product_attention over the whole
sequence, in the output and in the q, k and v gradients, computed on the same rank; the ring's
point-to-point shifts are counted. Tolerance: float32 with a different summation order, 1e-5.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from typer.testing import CliRunner

from ringtree.cli.app import app
from ringtree.comm import p2p
from ringtree.parallel import ContextParallel
from ringtree.processes import spawn
from ringtree.schedules.ring_attention import (
    CAUSAL,
    FULL,
    SKIP,
    exchanges,
    layout,
    ring_steps,
    work,
)

TOL = 1e-5
B, H, G, T, E = 2, 4, 2, 16, 8  # grouped-query: two query heads share a key/value head
CASES = list(itertools.product((2, 4), ("p2p", "all-gather", "all-to-all"), (True, False), (True, False)))


def _case(cp: ContextParallel, causal: bool, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, E, generator=g) for n in (H, G, G))
    up = torch.randn(B, H, T, E, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    (ref * up).sum().backward()  # type: ignore[no-untyped-call]
    mine = [cp.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
    before = dict(p2p.counts)
    out = cp.attention(*mine, is_causal=causal)
    forward = {w: p2p.counts[w] - before.get(w, 0) for w in ("kv", "dkv")}
    (out * cp.shard(up, dim=2)).sum().backward()  # type: ignore[no-untyped-call]
    errors = {"out": _err(out, cp.shard(ref, dim=2))}
    for name, a, b in zip("qkv", mine, full, strict=True):
        assert a.grad is not None and b.grad is not None
        errors["d" + name] = _err(a.grad, cp.shard(b.grad, dim=2))
    errors |= {f"forward {w}": float(n) for w, n in forward.items()}
    errors |= {f"total {w}": float(p2p.counts[w] - before.get(w, 0)) for w in ("kv", "dkv")}
    return errors


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.detach() - b.detach()).abs().max())


def _world(rank: int) -> dict[str, Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[rank // 2], 4: None}
    out: dict[str, Any] = {}
    for i, (p, comm, causal, balanced) in enumerate(CASES):
        cp = ContextParallel(groups[p], comm, load_balance=balanced)
        out[str((p, comm, causal, balanced))] = _case(cp, causal, seed=i)
    out["bf16"] = _bf16(ContextParallel(groups[2], "p2p"))
    return out


def _bf16(cp: ContextParallel) -> dict[str, Any]:
    """bf16 inputs under autocast: the ring computes and merges in fp32, returns bf16."""
    g = torch.Generator().manual_seed(99)
    q, k, v = (torch.randn(B, n, T, E, generator=g) for n in (H, G, G))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mine = [cp.shard(t, dim=2).bfloat16().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cp.attention(*mine, is_causal=True)
    out.float().sum().backward()  # type: ignore[no-untyped-call]
    grads = [str(t.grad.dtype) for t in mine if t.grad is not None]
    return {"dtype": str(out.dtype), "err": _err(out.float(), cp.shard(ref, dim=2)), "grads": grads}


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(_world, 4, timeout_s=180)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_context_parallel_attention_equals_full_attention(
    world: list[dict[str, Any]], case: tuple[int, str, bool, bool]
) -> None:
    for rank in range(4):
        errors = world[rank][str(case)]
        for name in ("out", "dq", "dk", "dv"):
            assert errors[name] <= TOL, (rank, name, errors)


@pytest.mark.parametrize("p", [2, 4])
def test_the_ring_shifts_kv_p_minus_1_times_forward_and_3p_minus_2_in_all(
    world: list[dict[str, Any]], p: int
) -> None:
    for rank in range(4):
        for causal, balanced in itertools.product((True, False), repeat=2):
            e = world[rank][str((p, "p2p", causal, balanced))]
            assert (e["forward kv"], e["forward dkv"]) == (p - 1, 0)
            assert e["total kv"] + e["total dkv"] == 3 * p - 2 == sum(exchanges(p).values())
            assert e["total dkv"] == p  # dK/dV ride the ring once round: home after p shifts
        assert world[rank][str((p, "all-gather", True, True))]["total kv"] == 0


def test_bf16_ring_attention_returns_bf16_close_to_fp32(world: list[dict[str, Any]]) -> None:
    for rank in range(4):
        got = world[rank]["bf16"]
        assert got["dtype"] == "torch.bfloat16" and got["grads"] == ["torch.bfloat16"] * 3
        assert got["err"] < 2e-2, got  # bf16's own rounding of inputs and output (8 bits of mantissa)


def test_head_tail_layout_and_the_ring_schedule_as_data() -> None:
    assert layout(2, True) == [0, 3, 1, 2] and layout(4, True) == [0, 7, 1, 6, 2, 5, 3, 4]
    steps = ring_steps(4, causal=True, balanced=True)
    assert [s.source for s in (steps[1][0], steps[1][3], steps[3][0])] == [3, 2, 1]
    assert work(steps) == [8.0] * 4  # balanced: every rank computes 8 chunk products
    assert work(ring_steps(4, causal=True, balanced=False)) == [0.5, 1.5, 2.5, 3.5]
    first = steps[0][1]  # rank 1 at step 0 holds its own chunks 1 and 6
    expected = [(1, 1, CAUSAL), (1, 6, SKIP), (6, 1, FULL), (6, 6, CAUSAL)]
    assert [(b.q, b.k, b.kind) for b in first.blocks] == expected
    assert all(b.kind == FULL for s in ring_steps(3, causal=False) for r in s for b in r.blocks)


def test_show_ring_attention_prints_the_ring_and_writes_json_and_png(tmp_path: Path) -> None:
    out, png = tmp_path / "ring.json", tmp_path / "ring.png"
    args = ["show", "ring-attention", "--ranks", "2", "--json", str(out), "--png", str(png)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "rank 1: 1,2" in result.output and "q0-k0 causal" in result.output
    data = json.loads(out.read_text())
    assert data["chunks"] == [[0, 3], [1, 2]] and data["work"] == [4.0, 4.0]
    step1 = data["steps"][1]["ranks"][0]  # rank 0 holds rank 1's K/V (chunks 1, 2)
    assert (step1["kv_from"], step1["kv_chunks"]) == (1, [1, 2])
    assert [b["kind"] for b in step1["blocks"]] == ["skip", "skip", "full", "full"]
    assert data["exchanges"]["p2p"] == {"forward": 1, "backward": 3}
    assert png.stat().st_size > 10_000
    refused = CliRunner().invoke(app, ["show", "ring-attention", "--stages", "2"])
    assert refused.exit_code == 2 and "--stages does not apply to ring attention" in refused.output
