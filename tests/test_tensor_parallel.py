"""Tensor parallelism against the dense torch modules, in one spawned world of 4 ranks.

Every case runs inside that one world (TP = 1, 2 and 4 as meshes over it) and returns the largest
difference from the dense layer computed on the same rank; the tests compare here. Tolerance:
float32 with a different summation order (the all-reduce adds partial products in ring order),
so 1e-5 absolute on O(1) values; training compounds three SGD steps, so 1e-4 there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    Mesh,
    ParallelBlock,
    ParallelSelfAttention,
    RowParallelLinear,
)
from ringtree.parallel.tensor import (
    all_gather_last_dim,
    copy_from_dense,
    copy_to_dense,
    gather_optimizer_state,
    parallelize_blocks,
    reduce_scatter_last_dim,
    shard_optimizer_state,
)
from ringtree.parallel.tensor.ops import Group
from ringtree.processes import spawn
from ringtree.train.models import Block, ViT

TOL = 1e-5
TRAIN_TOL = 1e-4
IN, OUT = 7, 12  # odd input width; 12 divides by 1, 2, 4
Errors = dict[str, float]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.detach() - b.detach()).abs().max())


def _dense_case(seed: int, d_in: int, d_out: int) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """The same dense layer, input [3, 5, in] and upstream gradient on every rank."""
    g = torch.Generator().manual_seed(seed)
    dense = nn.Linear(d_in, d_out)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(d_out, d_in, generator=g))
        dense.bias.copy_(torch.randn(d_out, generator=g))
    return dense, torch.randn(3, 5, d_in, generator=g), torch.randn(3, 5, d_out, generator=g)


def _dense_grads(dense: nn.Linear, x: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = dense(x)
    (out * up).sum().backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    return out.detach(), x.grad


def _column(group: Group, gather: bool) -> Errors:
    dense, x, up = _dense_case(1, IN, OUT)
    ref, ref_dx = _dense_grads(dense, x, up)
    layer = ColumnParallelLinear.from_dense(dense, group, gather_output=gather)
    xp = x.clone().requires_grad_()
    out = layer(xp)
    cut = slice(None) if gather else _slice(OUT, group)
    (out * up[..., cut]).sum().backward()  # type: ignore[no-untyped-call]
    assert dense.weight.grad is not None and dense.bias.grad is not None
    assert xp.grad is not None and layer.weight.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None
    return {
        "out": _err(out, ref[..., cut]),
        "dx": _err(xp.grad, ref_dx),
        "dw": _err(layer.weight.grad, dense.weight.grad[_slice(OUT, group)]),
        "db": _err(layer.bias.grad, dense.bias.grad[_slice(OUT, group)]),
        "full_weight": _err(layer.full_weight(), dense.weight),
        "params": sum(p.numel() for p in layer.parameters()) * dist.get_world_size(group) - (IN + 1) * OUT,
    }


def _row(group: Group, parallel_input: bool) -> Errors:
    dense, x, up = _dense_case(2, OUT, IN)  # in_features = 12 splits; out_features = 7 is odd
    ref, ref_dx = _dense_grads(dense, x, up)
    layer = RowParallelLinear.from_dense(dense, group, input_is_parallel=parallel_input)
    cut = _slice(OUT, group) if parallel_input else slice(None)
    xp = x[..., cut].clone().requires_grad_()
    out = layer(xp)
    (out * up).sum().backward()  # type: ignore[no-untyped-call]
    assert dense.weight.grad is not None and dense.bias.grad is not None
    assert xp.grad is not None and layer.weight.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None
    tp = dist.get_world_size(group)
    return {
        "out": _err(out, ref),
        "dx": _err(xp.grad, ref_dx[..., cut]),
        "dw": _err(layer.weight.grad, dense.weight.grad[:, _slice(OUT, group)]),
        "db": _err(layer.bias.grad, dense.bias.grad),
        "full_weight": _err(layer.full_weight(), dense.weight),
        # weight split, bias replicated: tp x (weight / tp + bias) = dense + (tp - 1) x bias
        "params": sum(p.numel() for p in layer.parameters()) * tp - (OUT * IN + tp * IN),
    }


def _slice(n: int, group: Group) -> slice:
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    return slice(r * n // tp, (r + 1) * n // tp)


def _block(group: Group, algorithm: str) -> Errors:
    torch.manual_seed(3)
    dense = Block(16, 4)
    x = torch.randn(2, 5, 16)
    up = torch.randn(2, 5, 16)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = dense(xd)
    (ref * up).sum().backward()  # type: ignore[no-untyped-call]
    block = ParallelBlock.from_dense(dense, group, algorithm)
    out = block(xp)
    (out * up).sum().backward()  # type: ignore[no-untyped-call]
    grads = Block(16, 4)  # receives the parallel block's gradients, gathered like weights
    copy_to_dense(_shadow(block), grads)
    assert xd.grad is not None and xp.grad is not None
    return {
        "out": _err(out, ref),
        "dx": _err(xp.grad, xd.grad),
        "dparams": max(
            _err(q, p.grad)
            for q, p in zip(grads.parameters(), dense.parameters(), strict=True)
            if p.grad is not None
        ),
    }


def _shadow(block: ParallelBlock) -> ParallelBlock:
    """The block with its parameters replaced by their gradients (to gather those like weights)."""
    with torch.no_grad():
        for p in block.parameters():
            assert p.grad is not None
            p.copy_(p.grad)
    return block


def _duals(group: Group) -> Errors:
    """all-gather forward / reduce-scatter backward, and the reverse, against the formulas."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(tp, 3, 2, generator=g)  # rank s holds xs[s]
    ups = torch.randn(tp, 3, 2 * tp, generator=g)  # rank s weights the gathered tensor by ups[s]
    x = xs[r].clone().requires_grad_()
    y = all_gather_last_dim(x, group)
    (y * ups[r]).sum().backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    z = torch.randn(tp, 3, 2 * tp, generator=g)
    zr = z[r].clone().requires_grad_()
    w = reduce_scatter_last_dim(zr, group)
    (w * ups[r][..., :2]).sum().backward()  # type: ignore[no-untyped-call]
    assert zr.grad is not None
    return {
        "gather": _err(y, torch.cat(list(xs), dim=-1)),
        "gather_grad": _err(x.grad, ups.sum(0)[..., 2 * r : 2 * r + 2]),
        "reduce_scatter": _err(w, z.sum(0)[..., 2 * r : 2 * r + 2]),
        "reduce_scatter_grad": _err(zr.grad, torch.cat([u[..., :2] for u in ups], dim=-1)),
    }


def _errors(group: Group) -> dict[str, str]:
    """The messages of the mistakes a user can make, raised before any communication."""
    out: dict[str, str] = {}
    cases: dict[str, Any] = {
        "features": lambda: ColumnParallelLinear(8, 6, group=group),
        "row_features": lambda: RowParallelLinear(6, 8, group=group),
        "heads": lambda: ParallelSelfAttention.build(12, 6, group),
    }
    for name, make in cases.items():
        try:
            make()
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


def _train(mesh: Mesh, algorithm: str) -> dict[str, Any]:
    """3 SGD steps with momentum of a small ViT at DP x TP; the gathered weights and optimizer state.

    SGD, not Adam: Adam's first steps are about lr x sign(gradient), so gradients that differ by
    rounding near zero would move weights by 2 lr and hide what the test checks.
    """
    xs, ys = _train_data(mesh.dp)
    torch.manual_seed(5)
    net = ViT(dim=16, depth=2, heads=4)
    parallelize_blocks(net.blocks, mesh.tp_group, algorithm)
    model = DistributedDataParallel(net, process_group=mesh.dp_group)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    rows = slice(mesh.dp_rank * 4, (mesh.dp_rank + 1) * 4)
    for k in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs[k, rows]), ys[k, rows]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    model.close()
    dense = ViT(dim=16, depth=2, heads=4)
    copy_to_dense(net, dense)
    state = gather_optimizer_state(net, opt.state_dict())
    resharded = shard_optimizer_state(net, state)
    local = opt.state_dict()["state"]
    roundtrip = max(_err(resharded["state"][i][k], local[i][k]) for i in local for k in ("momentum_buffer",))
    copy_from_dense(net, dense)  # loading the gathered weights back changes nothing
    return {"weights": [p.detach() for p in dense.parameters()], "state": state, "roundtrip": roundtrip}


def _train_data(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return torch.rand(3, 4 * dp, 64, generator=g), torch.randint(0, 10, (3, 4 * dp), generator=g)


def _group_sum(group: Group) -> float:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    return total.item()


def _world(rank: int) -> dict[str, Any]:
    meshes = {tp: Mesh(tp=tp) for tp in (1, 2, 4)}  # every rank builds every mesh, in one order
    out: dict[str, Any] = {"coords": (meshes[2].dp_rank, meshes[2].tp_rank, meshes[2].pp_rank)}
    out["group sums"] = [_group_sum(meshes[2].tp_group), _group_sum(meshes[2].dp_group)]
    try:
        Mesh(tp=3)
    except ValueError as e:
        out["bad mesh"] = str(e)
    for tp, mesh in meshes.items():
        group = mesh.tp_group
        out[f"column tp={tp}"] = _column(group, gather=False)
        out[f"column gathered tp={tp}"] = _column(group, gather=True)
        out[f"row tp={tp}"] = _row(group, parallel_input=True)
        out[f"row split tp={tp}"] = _row(group, parallel_input=False)
        out[f"block tp={tp}"] = _block(group, "ring")
        out[f"duals tp={tp}"] = _duals(group)
    out["block native tp=2"] = _block(meshes[2].tp_group, "native")
    out["errors"] = _errors(meshes[4].tp_group)
    out["train"] = _train(meshes[2], "ring")
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(_world, 4, timeout_s=120)


def test_mesh_coordinates_in_the_world(world: list[dict[str, Any]]) -> None:
    assert [w["coords"] for w in world] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert [w["group sums"] for w in world] == [
        [1, 2],
        [1, 4],
        [5, 2],
        [5, 4],
    ]  # tp {0,1} {2,3}; dp {0,2} {1,3}
    assert all("tp=3 x pp=1 = 3 does not divide the world size 4" in w["bad mesh"] for w in world)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layer", ["column", "column gathered", "row", "row split", "block", "duals"])
def test_parallel_layer_equals_dense(world: list[dict[str, Any]], layer: str, tp: int) -> None:
    for rank, w in enumerate(world):
        errors = {k: v for k, v in w[f"{layer} tp={tp}"].items() if k != "params"}
        assert max(errors.values()) < TOL, (rank, errors)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layer", ["column", "row"])
def test_parameters_per_rank_are_one_tp_th(world: list[dict[str, Any]], layer: str, tp: int) -> None:
    assert all(w[f"{layer} tp={tp}"]["params"] == 0 for w in world)


def test_block_over_torch_native_collectives(world: list[dict[str, Any]]) -> None:
    assert all(max(w["block native tp=2"].values()) < TOL for w in world)


def test_sizes_that_do_not_divide_name_the_numbers(world: list[dict[str, Any]]) -> None:
    errors = world[0]["errors"]
    assert "out_features=6 is not divisible by tp=4 x stride=1 = 4" in errors["features"]
    assert "in_features=6 is not divisible by tp=4 = 4" in errors["row_features"]
    assert "heads=6 is not divisible by the tensor-parallel size tp=4" in errors["heads"]


def test_dp_times_tp_training_equals_dp_only(world: list[dict[str, Any]]) -> None:
    """DP=2 x TP=2 on 4 ranks equals one process on the whole batch (what DP-only computes)."""
    xs, ys = _train_data(2)
    torch.manual_seed(5)
    ref = ViT(dim=16, depth=2, heads=4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for k in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(xs[k]), ys[k]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    ref_state = opt.state_dict()["state"]
    for w in world:
        got = w["train"]
        assert max(_err(a, b) for a, b in zip(got["weights"], ref.parameters(), strict=True)) < TRAIN_TOL
        assert got["roundtrip"] == 0.0
        for i, s in ref_state.items():
            assert _err(got["state"]["state"][i]["momentum_buffer"], s["momentum_buffer"]) < TRAIN_TOL
