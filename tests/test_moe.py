"""Mixture of experts and expert parallelism: the dispatch, the permutation, and EP = N against
EP = 1 (outputs and every parameter's gradient), on 4 gloo ranks in one spawned world."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtree.parallel import DistributedDataParallel, ExpertParallel, MoE
from ringtree.parallel.moe import CLOCK, AllToAllDispatcher, LocalDispatcher, expert_major, sort_by_expert
from ringtree.processes import spawn

DIM, HIDDEN, EXPERTS, TOKENS = 8, 16, 8, 12


def _identity(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    assert sum(counts) == rows.shape[0]
    return rows


def test_sort_by_expert_orders_copies_by_expert_and_keeps_token_order() -> None:
    experts = torch.tensor([[2, 0], [0, 3], [2, 1]])
    keep = torch.tensor([[True, True], [True, False], [True, True]])
    order, counts = sort_by_expert(experts, keep, 5)
    assert order.tolist() == [1, 2, 5, 0, 4]  # expert 0: copies 1, 2; 1: 5; 2: 0, 4; 3 dropped
    assert counts.tolist() == [2, 1, 2, 0, 0]


@pytest.mark.parametrize(
    "counts",
    [[[2, 0, 1], [0, 0, 3]], [[0, 0, 0], [0, 0, 0]], [[1, 1, 1], [1, 1, 1]], [[0, 4, 0], [2, 0, 0]]],
)
def test_expert_major_permutes_source_major_rows_even_with_experts_that_get_nothing(
    counts: list[list[int]],
) -> None:
    table = torch.tensor(counts)  # [sources, local experts]
    labels = [
        (s, e) for s in range(table.shape[0]) for e in range(table.shape[1]) for _ in range(counts[s][e])
    ]
    index = expert_major(table)
    assert sorted(index.tolist()) == list(range(len(labels)))  # a permutation
    reordered = [labels[i] for i in index.tolist()]
    assert reordered == sorted(labels, key=lambda se: (se[1], se[0]))  # expert-major, then source


def test_local_round_trip_with_identity_experts_returns_the_input_and_its_gradient() -> None:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, EXPERTS, top_k=2)
    layer.experts.forward = _identity  # type: ignore[method-assign]
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform scores: weights 1/2 each, normalized
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(out, x, atol=1e-6, rtol=0)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, grad, atol=1e-6, rtol=0)
    assert isinstance(layer.dispatcher, LocalDispatcher)


def test_capacity_factor_drops_copies_past_the_balanced_load() -> None:
    torch.manual_seed(0)
    layer = MoE(DIM, HIDDEN, 4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # everyone picks expert 0
    layer(torch.randn(TOKENS, DIM))
    assert layer.router.tokens_per_expert.tolist() == [3.0, 0.0, 0.0, 0.0]  # ceil(1.0 x 12 / 4)
    assert layer.router.dropped.tolist() == [9.0, 12.0]


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        MoE(DIM, HIDDEN, EXPERTS, top_k=2, shared=1), nn.Tanh(), MoE(DIM, HIDDEN, EXPERTS, top_k=2)
    )


def _data(rank: int, world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world, TOKENS, DIM, generator=g)
    return x, x[rank]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(rank: int, ep: int, algorithm: str, bias: torch.Tensor | None = None) -> dict[str, Any]:
    """EP = ep on the world against the whole model on the whole batch in this process."""
    world = dist.get_world_size()
    everything, mine = _data(rank, world)
    reference = _model()
    if bias is not None:
        for m in reference.modules():
            if isinstance(m, MoE):
                m.router.expert_bias.copy_(bias)
    full = reference(everything.view(-1, DIM)).view(world, TOKENS, DIM)
    (full**2).sum(-1).mean().backward()
    expected = _grads(reference)

    model = _model()
    if bias is not None:
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.expert_bias.copy_(bias)
    parallel = ExpertParallel(ep, algorithm=algorithm)
    parallel.apply(model)
    ddp = DistributedDataParallel(model, algorithm="ring")
    mine.requires_grad_()  # as a block's input: the first dispatch has a backward too
    calls = CLOCK.calls
    out = ddp(mine)
    (out**2).sum(-1).mean().backward()
    a2a = CLOCK.calls - calls
    parallel.reduce_expert_gradients()
    local = len(parallel.layers[0].router.tokens_per_expert) // ep
    first = parallel.ep_rank * local
    errors = {"output": float((out - full[rank]).abs().max())}
    for name, grad in _grads(model).items():
        want = expected[name]
        if name.split(".")[-1] in ("w_gate", "w_up", "w_down") and "shared" not in name:
            want = want[first : first + local]
        errors[name] = float((grad - want).abs().max())
    received = sum(int(r.tokens_per_expert.sum()) for r in (m.router for m in parallel.layers))
    return {
        "errors": errors,
        "a2a": a2a,
        "grads": len(expected),
        "compared": len(errors) - 1,
        "routed": received,
    }


def _independent(rank: int) -> float:
    """Rank 0's output with the other ranks' data changed: dropless, it must not move."""
    model = ExpertParallel(4, algorithm="pairwise").apply(_model())
    outs = []
    for seed in (1, 2):
        _, mine = _data(rank, 4, seed if rank else 1)
        with torch.no_grad():
            outs.append(model(mine))
    return float((outs[0] - outs[1]).abs().max())


def _sharded_states(rank: int) -> float:
    """One AdamW step with the experts' states sharded over the EDP group against whole states."""
    _, mine = _data(rank, dist.get_world_size())
    stepped = []
    for sharded in (False, True):
        model = _model()
        parallel = ExpertParallel(2, algorithm="native")  # EDP groups of 2 on 4 ranks
        parallel.apply(model)
        params = [p for p in model.parameters() if getattr(p, "allreduce", True)]
        if sharded:
            params += parallel.shard_states()
            assert sum(p.numel() for p in params) < sum(p.numel() for p in model.parameters())
        else:
            params += parallel.params
        optimizer = torch.optim.AdamW(params, lr=0.1)
        parallel.register(optimizer)
        model(mine).square().mean().backward()
        optimizer.step()
        stepped.append(torch.cat([p.detach().flatten() for p in parallel.params]))
    return float((stepped[0] - stepped[1]).abs().max())


def _world(rank: int) -> dict[str, Any]:
    starved = torch.tensor([100.0] * 6 + [0.0, 0.0])  # experts 6, 7 (rank 3's under EP 4) get nothing
    layers = ExpertParallel(4, algorithm="native")
    dispatcher = AllToAllDispatcher(layers.ep_group, "native")
    rows = torch.randn(6, DIM, requires_grad=True)
    counts = torch.tensor([1, 0, 2, 0, 0, 1, 2, 0])  # to experts 0, 2, 2, 5, 6, 6
    back = dispatcher(rows, counts, _identity)
    grad = torch.randn_like(back)
    back.backward(grad)
    assert rows.grad is not None
    round_trip = max(float((back - rows).abs().max()), float((rows.grad - grad).abs().max()))
    return {
        "round_trip": round_trip,
        "ep2": _compare(rank, 2, "bruck"),
        "ep4": _compare(rank, 4, "auto"),
        "starved": _compare(rank, 4, "native", starved),
        "independent": _independent(rank),
        "sharded_states": _sharded_states(rank),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(_world, 4, timeout_s=120)


def test_ep_round_trip_with_identity_experts_returns_the_input_and_its_gradient(
    results: list[dict[str, Any]],
) -> None:
    assert all(r["round_trip"] < 1e-6 for r in results)


@pytest.mark.parametrize("ep", ["ep2", "ep4"])
def test_ep_equals_ep1_in_outputs_and_every_gradient(results: list[dict[str, Any]], ep: str) -> None:
    for r in results:
        assert r[ep]["compared"] == r[ep]["grads"]  # every parameter of the model has a gradient
        bad = {k: v for k, v in r[ep]["errors"].items() if v > 1e-5}
        assert not bad, bad


def test_a_rank_whose_experts_receive_no_tokens_still_matches(results: list[dict[str, Any]]) -> None:
    for r in results:
        bad = {k: v for k, v in r["starved"]["errors"].items() if v > 1e-5}
        assert not bad, bad


def test_dropless_output_of_a_rank_does_not_depend_on_other_ranks_data(results: list[dict[str, Any]]) -> None:
    assert results[0]["independent"] == 0.0


def test_each_moe_layer_runs_one_counts_exchange_and_four_data_all_to_alls_a_step(
    results: list[dict[str, Any]],
) -> None:
    assert all(r["ep4"]["a2a"] == 2 * 5 for r in results)  # two layers: counts, dispatch, combine, 2 back


def test_expert_states_sharded_over_the_edp_group_step_as_whole_ones(results: list[dict[str, Any]]) -> None:
    assert all(r["sharded_states"] < 1e-6 for r in results)
