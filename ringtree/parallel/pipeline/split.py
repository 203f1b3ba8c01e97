"""A stage's backward in two: B, the gradients of the stage's inputs, and W, those of its weights.

Each matmul's backward is two matmuls, dX = G W (B) and dW = G^T X (W); only B lies on the path
between stages, so a zero-bubble schedule sends B's result upstream at once and runs W later, in
what would otherwise be a bubble. Both halves are autograd, as torch.distributed.pipelining's
stage_backward_input / stage_backward_weight do it:

- B walks the stage's graph once: the nodes from which the input is reachable are the input's
  closure; a weight's path enters that closure at "intermediate" nodes (the matmul, norm or
  embedding node whose other branch leads to the weight). B asks autograd for the input's gradient
  and, captured on the way, the gradient arriving at every intermediate (retaining the graph).
  Autograd computes only the outputs a node's consumers need, so no weight gradient is formed in B.
- W computes a linear layer's weights directly, as the zero-bubble paper does: where a weight W
  (and its bias b) enters the closure at a single matmul of its own, y = x W^T (+ b) as one addmm
  or mm node (nn.Linear's, a column- or row-parallel layer's local matmul), W is G^T x from the
  gradient G captured at that node and the input x it saved, and b's gradient is G summed over the
  tokens: no autograd pass. These run first: an autograd pass walking through such a matmul would
  free its input.
- For the other weights (norms, embeddings, a weight used twice, a row-parallel bias added after
  the reduction) W restarts autograd at the intermediates with the captured gradients and asks for
  the weights' gradients, which it adds into `.grad`; the graph is freed after it. One pass serves
  every group of weights none of whose intermediates reaches another group's weights: a pass never
  walks from one intermediate down the input's path to another (a row-parallel layer's
  reduce-scatter lies between its bias's add and its matmul: it must not run again in W). By
  autograd alone (SplitCache(direct=False)) a transformer block's q, k and v (or gate and up)
  projections share a pass, a block being six passes; with the linear layers direct, two (its norms).

The analysis (closure, groups, passes) depends on the graph's shape only: every node's type and
edges, in the walk's order. A `SplitCache` keeps it by shape, so a stage's later micro-batches pay
for the walk that checks the shape, not for the analysis; a graph of another shape is analysed anew.

What W keeps: the intermediates' nodes (and through them the tensors they saved, a linear layer's
input among them) and the captured gradients, dropped as W uses them; once the caller drops B's
output, the rest of the output-side graph goes. Under activation checkpointing (torch's
non-reentrant checkpoint) each autograd pass recomputes the segments it unpacks, and W is one pass
per set of groups: deferring W there would recompute a segment once per pass (and each linear
layer's input read outside a pass once), so `backward_input(..., defer=False)` computes the
weights' gradients in B instead (one pass, one recomputation; W then has nothing left to do). A
column- or row-parallel layer's W is a local matmul: its collectives sit on the input's path and
run in B. No collectives, no process groups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Shape = tuple[object, ...]  # a graph's shape: each node's type, then its edges' (child, input slot)


@dataclass(frozen=True)
class _Group:
    """Weights and the intermediates where their paths enter the input's closure (a weight reached
    from several intermediates, or an intermediate leading to several weights, joins them); nodes by
    their place in the walk."""

    intermediates: tuple[int, ...]
    weights: tuple[int, ...]  # their gradient accumulators


@dataclass(frozen=True)
class _PassPlan:
    """One pass of W: per intermediate (node, its first capture, its slots, pinned), the weights."""

    intermediates: tuple[tuple[int, int, int, bool], ...]
    weights: tuple[int, ...]


@dataclass(frozen=True)
class _LinearPlan:
    """A linear layer's weights, computed in W without autograd: its matmul node (addmm with the
    bias, mm without), the capture of the gradient arriving there, and the weight's and the bias's
    accumulators (-1: no bias)."""

    node: int
    capture: int
    weight: int
    bias: int


@dataclass(frozen=True)
class Plan:
    """What B and W do to a graph of one shape, nodes by their place in the walk: the gradients B
    captures, (intermediate, input slot) each, the linear layers W computes directly and W's
    autograd passes."""

    x: int  # the input's node (-1: none, W runs the whole backward)
    leaves: tuple[int, ...]  # every weight's accumulator (not x's)
    captures: tuple[tuple[int, int], ...] = ()
    passes: tuple[_PassPlan, ...] = ()
    linears: tuple[_LinearPlan, ...] = ()


class SplitCache:
    """The plans of the graph shapes a stage has seen (at most `size`, the oldest dropped first).

    direct=False: W computes linear layers' weights by autograd too (to compare with the direct path)."""

    def __init__(self, size: int = 8, direct: bool = True) -> None:
        self.size, self.hits, self.misses, self.direct = size, 0, 0, direct
        self.plans: dict[tuple[int, Shape], Plan] = {}

    def plan(self, nodes: list[Node], shape: Shape, x: int) -> Plan:
        """The plan of a graph whose walk gave `nodes` and `shape`; analysed when the shape is new."""
        found = self.plans.get((x, shape))
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        if len(self.plans) >= self.size:
            del self.plans[next(iter(self.plans))]
        made = self.plans[(x, shape)] = _analyse(nodes, x, self.direct)
        return made


@dataclass
class _Pass:
    """One autograd pass of W: from these edges, with these gradients, to these weights."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    weights: list[tuple[Node, torch.Tensor]]  # (gradient accumulator, the leaf)
    pinned: list[tuple[Node, tuple[torch.Tensor | None, ...]]]  # intermediates fed by another of their group


@dataclass
class _Linear:
    """A linear layer's W: its matmul node (holding the layer's input), the gradient of its output,
    the weight, the bias (None: none)."""

    node: Node
    grad: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class WeightWork:
    """What W needs from B: its linear layers and its passes."""

    passes: list[_Pass] = field(default_factory=list)
    linears: list[_Linear] = field(default_factory=list)
    # no input to split off (the first stage): W runs the whole backward from here
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None
    cache: SplitCache | None = None  # the whole backward's walk: its plan (the graph's weights)


def node_of(t: torch.Tensor) -> Node | None:
    """t's grad_fn, or for a leaf that requires grad its gradient accumulator (made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn  # a leaf's AccumulateGrad node exists once a graph uses it
    assert view is not None, "a leaf that requires grad has a grad accumulator"
    return view.next_functions[0][0]


def _walk(root: Node) -> tuple[list[Node], dict[Node, int], Shape]:
    """root's graph breadth first: the nodes, their places, and the graph's shape."""
    nodes, place, shape = [root], {root: 0}, list[object]()
    for node in nodes:  # grows as it goes
        shape.append(type(node))
        for child, slot in node.next_functions:
            if child is None:
                shape.append(-1)
                continue
            k = place.get(child)
            if k is None:
                k = place[child] = len(nodes)
                nodes.append(child)
            shape += (k, slot)
    return nodes, place, tuple(shape)


def _plan(root: Node, x_node: Node | None, cache: SplitCache | None) -> tuple[list[Node], Plan]:
    nodes, place, shape = _walk(root)
    x = -1 if x_node is None else place.get(x_node, -1)
    return nodes, (_analyse(nodes, x) if cache is None else cache.plan(nodes, shape, x))


def _analyse(nodes: list[Node], x: int, direct: bool = True) -> Plan:
    """The closure of x, the groups, the linear layers (direct: else none) and the passes of the
    graph whose walk gave `nodes`."""
    place = {n: k for k, n in enumerate(nodes)}
    children = [[place[c] for c, _ in n.next_functions if c is not None] for n in nodes]
    consumers: list[list[int]] = [[] for _ in nodes]
    for k, cs in enumerate(children):
        for c in cs:
            consumers[c].append(k)
    leaves = tuple(
        k for k, n in enumerate(nodes) if k != x and isinstance(getattr(n, "variable", None), torch.Tensor)
    )
    if x < 0:
        return Plan(x, leaves)
    inputs, _ = _upward([x], consumers, set())
    groups = _groups(leaves, consumers, inputs)
    captures: list[tuple[int, int]] = []
    linears, rest = [], []
    for g in groups:
        found = _linear(g, nodes, place, consumers) if direct else None
        if found is None:
            rest.append(g)
            continue
        k, w, b = found
        linears.append(_LinearPlan(k, len(captures), w, b))
        captures.append((k, 0))
    groups = tuple(rest)
    passes = []
    for p in _passes(groups, children):
        mids = []
        for g in (groups[a] for a in p):
            for k in g.intermediates:
                slots = len(nodes[k]._input_metadata)  # the outputs of k's forward
                mids.append((k, len(captures), slots, len(g.intermediates) > 1))
                captures += [(k, slot) for slot in range(slots)]
        passes.append(_PassPlan(tuple(mids), tuple(w for a in p for w in groups[a].weights)))
    return Plan(x, leaves, tuple(captures), tuple(passes), tuple(linears))


# a matmul node's edges: (its weight's, its bias's (-1: none)); its saved input is _INPUT's
_MATMULS = {"AddmmBackward0": (2, 0), "MmBackward0": (1, -1)}
_INPUT = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}


def _linear(
    g: _Group, nodes: list[Node], place: dict[Node, int], consumers: list[list[int]]
) -> tuple[int, int, int] | None:
    """(the matmul, the weight's, the bias's accumulator or -1) when g is one linear layer's weights:
    y = x W^T (+ b), one addmm or mm node whose weight edge is W's transpose and bias edge b's
    accumulator, W and b used by nothing else. None otherwise (W runs g by autograd)."""
    if len(g.intermediates) != 1:
        return None
    k = g.intermediates[0]
    edges = _MATMULS.get(nodes[k].name())
    if edges is None:
        return None
    w_edge, b_edge = edges
    t = nodes[k].next_functions[w_edge][0]
    if t is None or t.name() != "TBackward0" or consumers[place[t]] != [k]:
        return None
    acc = t.next_functions[0][0]
    if acc is None or consumers[place[acc]] != [place[t]]:
        return None
    w, b = place[acc], -1
    if b_edge >= 0:
        bias = nodes[k].next_functions[b_edge][0]
        if bias is not None and place[bias] in g.weights and consumers[place[bias]] == [k]:
            b = place[bias]
    if sorted(g.weights) != sorted({w, b} - {-1}):
        return None
    return k, w, b


def _upward(starts: Iterable[int], consumers: list[list[int]], stop: set[int]) -> tuple[set[int], set[int]]:
    """The nodes reachable from `starts` towards the output, not entering `stop`; and the ones of
    `stop` met on the way."""
    closure, met = set(starts), set()
    queue = deque(closure)
    while queue:
        for up in consumers[queue.popleft()]:
            if up in stop:
                met.add(up)
            elif up not in closure:
                closure.add(up)
                queue.append(up)
    return closure, met


def _groups(leaves: tuple[int, ...], consumers: list[list[int]], inputs: set[int]) -> tuple[_Group, ...]:
    """The weights of the graph, grouped by the intermediates their paths enter the input's closure at."""
    owner: dict[int, int] = {}  # intermediate -> its group's index in `groups`
    groups: list[tuple[set[int], list[int]]] = []
    for leaf in leaves:
        _, entered = _upward([leaf], consumers, inputs)
        if not entered:
            continue
        joined = sorted({owner[n] for n in entered if n in owner})
        mids, weights = set(entered), [leaf]
        for k in joined:  # merge every group this weight shares an intermediate with
            mids |= groups[k][0]
            weights += groups[k][1]
            groups[k] = (set(), [])
        groups.append((mids, weights))
        for n in mids:
            owner[n] = len(groups) - 1
    return tuple(_Group(tuple(sorted(m)), tuple(w)) for m, w in groups if w)


def _passes(groups: tuple[_Group, ...], children: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """W's passes: groups share one when none of their intermediates reaches another's weights.

    Groups are placed first fit, those reaching fewest weights first: along a chain of layers each
    reaches the ones below it, so siblings (q, k and v of one block) land in the same pass."""
    below = []  # per group, the nodes its intermediates reach
    for g in groups:
        seen, queue = set(g.intermediates), deque(g.intermediates)
        while queue:
            for c in children[queue.popleft()]:
                if c not in seen:
                    seen.add(c)
                    queue.append(c)
        below.append(seen)
    passes: list[list[int]] = []
    for a in sorted(range(len(groups)), key=lambda a: len(below[a])):
        for p in passes:
            if not any(_reaches(below[a], groups[b]) or _reaches(below[b], groups[a]) for b in p):
                p.append(a)
                break
        else:
            passes.append([a])
    return tuple(tuple(p) for p in passes)


def _reaches(nodes: set[int], group: _Group) -> bool:
    return any(w in nodes for w in group.weights)


def backward_input(
    out: torch.Tensor,
    grad: torch.Tensor | None,
    x: torch.Tensor,
    defer: bool = True,
    cache: SplitCache | None = None,
) -> WeightWork:
    """B: x.grad = the gradient of `out` (given its gradient `grad`; None for a loss) w.r.t. x.

    Returns what W needs. When x needs no gradient (the first stage) nothing runs
    here and W runs the whole backward. defer=False: the weights' gradients too, now, in the same
    pass (W is then empty); for activation-checkpointed stages. cache: the plans of the shapes seen
    (None: the graph is analysed every time).
    """
    x_node, root = node_of(x), out.grad_fn
    if x_node is None or root is None:
        return WeightWork(whole=(out, grad), cache=cache)
    nodes, plan = _plan(root, x_node, cache)
    if plan.x < 0:  # out does not depend on x
        return WeightWork(whole=(out, grad), cache=cache)
    if not defer:
        leaves = [_leaf(nodes[k]) for k in plan.leaves]
        grads = torch.autograd.grad(out, [x, *leaves], grad, allow_unused=True)
        _add_grad(x, grads[0])
        _accumulate(leaves, grads[1:])
        return WeightWork()
    edges = [GradientEdge(nodes[k], slot) for k, slot in plan.captures]
    dx, *captured = torch.autograd.grad(
        out, [get_gradient_edge(x), *edges], grad, retain_graph=True, allow_unused=True
    )
    _add_grad(x, torch.zeros_like(x) if dx is None else dx)
    linears = [
        _Linear(nodes[p.node], g, _leaf(nodes[p.weight]), None if p.bias < 0 else _leaf(nodes[p.bias]))
        for p in plan.linears
        if (g := captured[p.capture]) is not None
    ]
    return WeightWork(passes=[_pass(nodes, p, captured) for p in plan.passes], linears=linears)


def _pass(nodes: list[Node], p: _PassPlan, captured: Sequence[torch.Tensor | None]) -> _Pass:
    """W's pass `p`, from what B captured."""
    out = _Pass([], [], [], [])
    for k, first, slots, pinned in p.intermediates:
        got = tuple(captured[first : first + slots])
        for s, g in enumerate(got):
            if g is not None:
                out.edges.append(GradientEdge(nodes[k], s))
                out.grads.append(g)
        if pinned:
            out.pinned.append((nodes[k], got))
    out.weights = [(nodes[w], _leaf(nodes[w])) for w in p.weights]
    return out


def _leaf(node: Node) -> torch.Tensor:
    leaf = node.variable  # type: ignore[attr-defined]  # AccumulateGrad's, not in Node's stub
    assert isinstance(leaf, torch.Tensor)
    return leaf


def backward_weight(work: WeightWork) -> None:
    """W: add the weights' gradients into their `.grad`, from what B recorded; frees the graph."""
    if work.whole is not None:  # like the split one, outside the weights' hooks
        (out, grad), work.whole = work.whole, None
        if out.grad_fn is None:
            return
        nodes, plan = _plan(out.grad_fn, None, work.cache)
        leaves = [_leaf(nodes[k]) for k in plan.leaves]
        if leaves:
            _accumulate(leaves, torch.autograd.grad(out, leaves, grad, allow_unused=True))
        return
    # the linear layers first: an autograd pass that walks through one's matmul frees its input
    while work.linears:  # each one's input and gradient dropped once its weights have their own
        _linear_weight(work.linears.pop())
    for p in work.passes:
        _weight_pass(p)
    work.passes = []


def _linear_weight(lin: _Linear) -> None:
    """dW = G^T X, db = G summed over the tokens: what autograd's addmm / mm and t nodes compute."""
    node, g = lin.node, lin.grad
    with torch.no_grad():  # X may be a checkpointed segment's, recomputed with its graph
        x = getattr(node, _INPUT[node.name()])
        dw = g.t().mm(x)
        alpha = getattr(node, "_saved_alpha", 1)
        _accumulate([lin.weight], [dw if alpha == 1 else dw * alpha])
        if lin.bias is not None:
            db = g.sum_to_size(lin.bias.shape)
            beta = getattr(node, "_saved_beta", 1)
            _accumulate([lin.bias], [db if beta == 1 else db * beta])


def _weight_pass(p: _Pass) -> None:
    if not p.edges:
        return
    # an intermediate may feed another of its group: each gets exactly what B recorded there, not
    # that plus what flows down from the first again
    handles = [n.register_prehook(lambda _, saved=saved: saved) for n, saved in p.pinned]
    try:
        dws = torch.autograd.grad(
            p.edges, [GradientEdge(acc, 0) for acc, _ in p.weights], p.grads, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    _accumulate([w for _, w in p.weights], dws)


def _add_grad(x: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is not None:
        x.grad = g if x.grad is None else x.grad + g


def _accumulate(
    weights: list[torch.Tensor], dws: tuple[torch.Tensor | None, ...] | list[torch.Tensor | None]
) -> None:
    for w, dw in zip(weights, dws, strict=True):
        if dw is not None:
            w.grad = dw if w.grad is None else w.grad.add_(dw)
