"""The split backward: B (input gradient) then W (weight gradients) equals one backward, per layer."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringtree import comm
from ringtree.parallel.pipeline.split import (
    SplitCache,
    _plan,
    _walk,
    backward_input,
    backward_weight,
    node_of,
)
from ringtree.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from ringtree.processes import spawn
from ringtree.train.gpt import DecoderBlock, GPTConfig
from ringtree.train.techniques import run_blocks


class EmbedAdd(nn.Module):
    """x + an embedding of fixed token ids: the embedding's weight meets the input at the add."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.register_buffer("ids", torch.arange(5) % 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.emb(self.ids)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Blocks(nn.Module):
    """Layers under run_blocks: with segments > 0, torch's (non-reentrant) activation checkpointing."""

    def __init__(self, layers: list[nn.Module], segments: int) -> None:
        super().__init__()
        self.layers, self.segments = nn.Sequential(*layers), segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_blocks(self.layers, x, self.segments)


LAYERS: dict[str, Callable[[], list[nn.Module]]] = {
    "linear": lambda: [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)],
    "attention": lambda: [Attention(), nn.Linear(8, 8)],
    "norm": lambda: [nn.LayerNorm(8), nn.Linear(8, 8), nn.RMSNorm(8)],
    "embedding": lambda: [EmbedAdd(), nn.Linear(8, 8)],
    "decoder": lambda: [DecoderBlock(GPTConfig(dim=8, heads=2, kv_heads=1, hidden=16))],
}


def _pair(name: str, segments: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    layers = LAYERS[name]()
    model = Blocks([*layers, nn.Linear(8, 8)], segments)
    return model, copy.deepcopy(model)


def _grads(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("segments", [0, 2])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_b_then_w_gives_one_backwards_gradients(name: str, segments: int) -> None:
    whole, split = _pair(name, segments)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, 8, generator=g) for _ in range(2)]
    grads = [torch.randn(3, 5, 8, generator=g) for _ in range(2)]
    inputs_whole, inputs_split = (
        [x.clone().requires_grad_() for x in xs],
        [x.clone().requires_grad_() for x in xs],
    )
    for x, dy in zip(inputs_whole, grads, strict=True):
        torch.autograd.backward(whole(x), dy)
    # B of both micro-batches first, then their W in the other order: as a zero-bubble stage does
    works = []
    for x, dy in zip(inputs_split, grads, strict=True):
        works.append(backward_input(split(x), dy, x))
        assert x.grad is not None
    assert _grads(split) == {}, "B computed weight gradients"
    for x, y in zip(inputs_split, inputs_whole, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)
    for work in reversed(works):
        backward_weight(work)
    expected, got = _grads(whole), _grads(split)
    assert set(got) == set(expected) == {n for n, _ in whole.named_parameters()}
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_loss_splits_and_a_first_stage_runs_whole_at_w() -> None:
    whole, split = _pair("linear", 0)
    x, y = torch.randn(4, 5, 8), torch.randint(0, 8, (4, 5))
    xw, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.cross_entropy(whole(xw).flatten(0, 1), y.flatten()).backward()  # type: ignore[no-untyped-call]
    backward_weight(backward_input(F.cross_entropy(split(xs).flatten(0, 1), y.flatten()), None, xs))
    torch.testing.assert_close(xs.grad, xw.grad)
    for n, p in _grads(whole).items():
        torch.testing.assert_close(_grads(split)[n], p)
    # the first stage: its input needs no gradient, so B does nothing and W is the whole backward
    first = copy.deepcopy(whole)
    first.zero_grad()
    work = backward_input(first(x).sum(), None, x)
    assert _grads(first) == {}
    backward_weight(work)
    whole.zero_grad()
    whole(x).sum().backward()  # type: ignore[no-untyped-call]
    for n, p in _grads(whole).items():
        torch.testing.assert_close(_grads(first)[n], p)


# -- tensor parallelism: column then row, with and without sequence parallelism ---------------


def _tp(rank: int, sequence_parallel: bool, segments: int) -> dict[str, Any]:
    torch.manual_seed(0)
    dense = [nn.Linear(8, 16), nn.Linear(16, 8)]
    col, row = ColumnParallelLinear.from_dense(dense[0]), RowParallelLinear.from_dense(dense[1])
    col.sequence_parallel = row.sequence_parallel = sequence_parallel
    whole = Blocks([col, nn.GELU(), row], segments)
    split = copy.deepcopy(whole)
    g = torch.Generator().manual_seed(1)
    t = 4 // 2 if sequence_parallel else 4  # sequence parallel: each rank holds t/tp tokens
    x = (
        torch.randn(2, 4, 8, generator=g)[:, rank * t : (rank + 1) * t]
        if sequence_parallel
        else torch.randn(2, 4, 8, generator=g)
    )
    dy = torch.randn_like(x)
    xw, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward(whole(xw), dy)
    out = split(xs)
    linears = len(_plan(out.grad_fn, node_of(xs), None)[1].linears)
    work = backward_input(out, dy, xs)
    del out
    b_grads = _grads(split)
    calls: list[str] = []
    for name in ("all_reduce", "all_gather", "reduce_scatter"):  # count W's collectives
        original = getattr(comm, name)
        setattr(comm, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    backward_weight(work)
    return {
        "x": (xs.grad, xw.grad),
        "b": b_grads,
        "whole": _grads(whole),
        "split": _grads(split),
        "calls": calls,
        "linears": linears,
    }


@pytest.mark.parametrize(("sequence_parallel", "segments"), [(False, 0), (True, 0), (False, 2)])
def test_tensor_parallel_layers_split_without_collectives_in_w(
    sequence_parallel: bool, segments: int
) -> None:
    for r in spawn(_tp, 2, (sequence_parallel, segments), timeout_s=60):
        torch.testing.assert_close(*r["x"])
        assert r["b"] == {} and r["calls"] == []
        assert r["linears"] == 2, "both layers' weights direct (the row-parallel bias by autograd)"
        assert set(r["split"]) == set(r["whole"]) and r["whole"]
        for n, p in r["whole"].items():
            torch.testing.assert_close(r["split"][n], p, rtol=1e-5, atol=1e-6, msg=n)


class Counted(nn.Module):
    def __init__(self, calls: list[int]) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(8, 8), calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[0] += 1
        return torch.tanh(self.linear(x))


def test_a_checkpointed_stage_computes_its_weights_in_b_with_one_recomputation() -> None:
    calls = [0]
    torch.manual_seed(0)
    split = Blocks([Counted(calls) for _ in range(4)], 2)  # the first two blocks checkpointed
    whole = copy.deepcopy(split)
    x, dy = torch.randn(3, 8), torch.randn(3, 8)
    xw, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.autograd.backward(whole(xw), dy)
    calls[0] = 0
    out = split(xs)
    assert calls == [4]
    work = backward_input(out, dy, xs, defer=False)
    assert calls == [6], "B recomputed the checkpointed segment once"
    backward_weight(work)
    assert calls == [6], "W had nothing left to do"
    torch.testing.assert_close(xs.grad, xw.grad)
    for n, p in _grads(whole).items():
        torch.testing.assert_close(_grads(split)[n], p, msg=n)
    # deferred, W is one pass per weight group, each recomputing the segment it unpacks
    calls[0] = 0
    backward_weight(backward_input(split(xs), dy, xs))
    assert calls[0] > 6


class Branchy(nn.Module):
    """Three projections of one normed input (q, k, v-like siblings), a second path when `wide`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b, self.c = nn.RMSNorm(8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.out, self.wide = nn.Linear(8, 8), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.a(h) * torch.sigmoid(self.b(h)) + self.c(h)
        if self.wide:  # another graph shape: an extra use of a's weight and a tanh
            y = y + torch.tanh(self.a(x))
        return self.out(y)  # type: ignore[no-any-return]


def _split_grads(
    model: nn.Module, xs: list[torch.Tensor], dys: list[torch.Tensor], cache: SplitCache | None
) -> Any:
    model.zero_grad()
    inputs = [x.clone().requires_grad_() for x in xs]
    works = [backward_input(model(x), dy, x, cache=cache) for x, dy in zip(inputs, dys, strict=True)]
    for work in reversed(works):
        backward_weight(work)
    return [x.grad for x in inputs], _grads(model)


def test_the_cache_plans_a_shape_once_and_a_new_shape_anew_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    model, whole = Branchy(), Branchy()
    whole.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, 8, generator=g) for _ in range(3)]
    dys = [torch.randn(3, 5, 8, generator=g) for _ in range(3)]
    cache = SplitCache()
    for wide in (False, True):
        model.wide = whole.wide = wide
        plain_x, plain = _split_grads(model, xs, dys, None)  # analysed every time
        cached_x, cached = _split_grads(model, xs, dys, cache)
        # analysed at the first micro-batch of each shape, planned from the cache from the second on
        assert (cache.misses, cache.hits) == ((1, 2) if not wide else (2, 4))
        assert set(cached) == set(plain) == {n for n, _ in model.named_parameters()}
        for n in plain:
            assert torch.equal(cached[n], plain[n]), n
        for a, b in zip(cached_x, plain_x, strict=True):
            assert torch.equal(a, b)
        whole.zero_grad()
        for x, dy in zip(xs, dys, strict=True):
            x = x.clone().requires_grad_()
            torch.autograd.backward(whole(x), dy)
        for n, p in _grads(whole).items():
            torch.testing.assert_close(cached[n], p, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("direct", [False, True])
def test_w_runs_sibling_weights_in_one_pass_and_never_the_inputs_path_again(direct: bool) -> None:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(3, 5, 8, requires_grad=True)
    out = model(x)
    assert out.grad_fn is not None
    cache = SplitCache(direct=direct)
    _, plan = _plan(out.grad_fn, node_of(x), cache)
    if direct:  # the norm by autograd; a, b, c and out as G^T X
        assert [len(p.weights) for p in plan.passes] == [1] and len(plan.linears) == 4
    else:  # the norm, then a, b, c (the siblings, with their biases) together, then out
        assert [len(p.weights) for p in plan.passes] == [1, 6, 2] and plan.linears == ()
    nodes, _, _ = _walk(out.grad_fn)
    mids = {k for k, _ in plan.captures}
    reach_x = [False] * len(nodes)  # nodes from which x is reachable: the input's path
    changed = True
    while changed:
        changed = False
        for k, n in enumerate(nodes):
            hit = k == plan.x or any(c is not None and reach_x[nodes.index(c)] for c, _ in n.next_functions)
            if hit and not reach_x[k]:
                reach_x[k] = changed = True
    ran: list[str] = []
    for k, n in enumerate(nodes):
        if reach_x[k] and k not in mids:
            n.register_prehook(lambda _, n=n: ran.append(n.name()))  # type: ignore[misc]
    work = backward_input(out, torch.ones_like(out), x, cache=cache)
    assert len(ran) > 5, "B runs the input's path"
    ran.clear()
    del out
    backward_weight(work)
    assert ran == [], f"W ran nodes of the input's path: {ran}"


# -- linear layers: W computes their weights as G^T X, without autograd -------------------------


class Linears(nn.Module):
    """Linear layers with and without a bias, on [b, t, d] and [n, d] inputs, and a norm."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)
        self.norm, self.c, self.shared = nn.LayerNorm(8), nn.Linear(8, 8), shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        if self.shared:  # a's weight used again: its gradient has two paths, W takes autograd's
            h = h + F.linear(h, self.a.weight[:8, :8])
        return self.c(self.norm(h).flatten(0, 1)).view_as(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("shared", [False, True])
def test_w_computes_linear_weights_directly_and_matches_one_backward(shared: bool) -> None:
    torch.manual_seed(0)
    split = Linears(shared)
    whole = copy.deepcopy(split)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, 8, generator=g) for _ in range(2)]
    dys = [torch.randn(3, 5, 8, generator=g) for _ in range(2)]
    for x, dy in zip(xs, dys, strict=True):
        torch.autograd.backward(whole(x.clone().requires_grad_()), dy)
    x = xs[0].clone().requires_grad_()
    out = split(x)
    assert out.grad_fn is not None
    _, plan = _plan(out.grad_fn, node_of(x), None)
    assert len(plan.linears) == (2 if shared else 3)  # a (unless shared), b and c
    assert [len(p.weights) for p in plan.passes] == ([2, 2] if shared else [2])  # the norm; shared a
    # gradient accumulation: two micro-batches' W add into .grad, in either order
    works = [backward_input(out, dys[0], x)]
    x1 = xs[1].clone().requires_grad_()
    works.append(backward_input(split(x1), dys[1], x1))
    assert _grads(split) == {}, "B computed weight gradients"
    del out
    calls: list[int] = []
    original = torch.autograd.grad

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return original(*a, **k)

    torch.autograd.grad = counted  # type: ignore[assignment]
    try:
        for work in reversed(works):
            backward_weight(work)
    finally:
        torch.autograd.grad = original
    assert len(calls) == 2 * len(plan.passes), "W ran autograd for the norm (and a shared weight) only"
    expected, got = _grads(whole), _grads(split)
    assert set(got) == set(expected) == {n for n, _ in whole.named_parameters()}
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("segments", [0, 2])
def test_w_frees_what_the_forward_saved_once_done(segments: int) -> None:
    torch.manual_seed(0)
    model = Blocks([nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.LayerNorm(8)], segments)
    x = torch.randn(3, 5, 8, requires_grad=True)

    class Saved:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    held: list[weakref.ref[Saved]] = []

    def pack(t: torch.Tensor) -> Saved:
        s = Saved(t.detach())  # an output itself would make a cycle: node, saved, output, node
        held.append(weakref.ref(s))
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.t):
        out = model(x)
    whole = copy.deepcopy(model)
    torch.autograd.backward(whole(x.detach().requires_grad_()), torch.ones_like(out))
    work = backward_input(out, torch.ones_like(out), x)
    del out
    assert held and any(r() is not None for r in held), "W's inputs kept until W"
    backward_weight(work)
    assert work.linears == [] and work.passes == []
    assert all(r() is None for r in held), "W freed what the forward saved"
    for n, p in _grads(whole).items():
        torch.testing.assert_close(_grads(model)[n], p, rtol=1e-5, atol=1e-6, msg=n)
