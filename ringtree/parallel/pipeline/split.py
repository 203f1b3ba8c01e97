"""A stage's backward in two: B, the gradients of the stage's inputs, and W, those of its weights.

Each matmul's backward is two matmuls, dX = G W (B) and dW = G^T X (W); only B lies on the path
between stages, so a zero-bubble schedule sends B's result upstream at once and runs W later, in
what would otherwise be a bubble. Both halves are autograd, as torch.distributed.pipelining's
stage_backward_input / stage_backward_weight do it:

- B walks the stage's graph once: the nodes from which the input is reachable are the input's
  closure; a weight's path enters that closure at "intermediate" nodes (the matmul, norm or
  embedding node whose other branch leads to the weight). B asks autograd for the input's gradient
  only (retaining the graph), and a pre-hook on every intermediate records the gradient that
  arrives there. Autograd computes only the outputs a node's consumers need, so no weight gradient
  is formed in B.
- W restarts autograd at the intermediates with the recorded gradients and asks for the weights'
  gradients, which it adds into `.grad`; the graph is freed after it.

What W keeps: the intermediates' nodes (and through them the tensors they saved) and the recorded
gradients; once the caller drops B's output, the rest of the output-side graph goes. Under activation
checkpointing (torch's non-reentrant checkpoint) each autograd pass recomputes the segments it
unpacks, and W is one pass per group of weights: deferring W there would recompute a segment once
per weight, so `backward_input(..., defer=False)` computes the weights' gradients in B instead (one
pass, one recomputation; W then has nothing left to do). A column-
or row-parallel layer's W is a local matmul: its collectives sit on the input's path and run in B.
Pure autograd: no collectives, no process groups.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class _Group:
    """Weights and the intermediates where their paths enter the input's closure (a weight reached
    from several intermediates, or an intermediate leading to several weights, joins them)."""

    intermediates: list[Node]
    weights: list[tuple[Node, torch.Tensor]]  # (gradient accumulator, the leaf)
    grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # by intermediate


@dataclass
class WeightWork:
    """What W needs from B: per group, the intermediates, the gradients recorded there, the weights."""

    groups: list[_Group] = field(default_factory=list)
    # no input to split off (the first stage): W runs the whole backward from here
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None


def node_of(t: torch.Tensor) -> Node | None:
    """t's grad_fn, or for a leaf that requires grad its gradient accumulator (made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn  # a leaf's AccumulateGrad node exists once a graph uses it
    assert view is not None, "a leaf that requires grad has a grad accumulator"
    return view.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Every node of root's graph -> the nodes that feed it gradients (the graph's reverse edges)."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upward(
    starts: Iterable[Node], consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """The nodes reachable from `starts` towards the output, not entering `stop`; and the ones of
    `stop` met on the way."""
    closure, met = set(starts), set()
    queue = deque(closure)
    while queue:
        for up in consumers.get(queue.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in closure:
                closure.add(up)
                queue.append(up)
    return closure, met


def backward_input(
    out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, defer: bool = True
) -> WeightWork:
    """B: x.grad = the gradient of `out` (given its gradient `grad`; None for a loss) w.r.t. x.

    Returns what W needs. When x needs no gradient (the first stage) nothing runs
    here and W runs the whole backward. defer=False: the weights' gradients too, now, in the same
    pass (W is then empty); for activation-checkpointed stages.
    """
    x_node, root = node_of(x), out.grad_fn
    if x_node is None or root is None:
        return WeightWork(whole=(out, grad))
    if not defer:
        leaves = [(n, w) for n, w in _leaves(root) if n is not x_node]
        grads = torch.autograd.grad(out, [x, *(w for _, w in leaves)], grad, allow_unused=True)
        if grads[0] is not None:
            x.grad = grads[0] if x.grad is None else x.grad + grads[0]
        _accumulate(leaves, grads[1:])
        return WeightWork()
    consumers = _consumers(root)
    if x_node not in consumers and x_node is not root:
        return WeightWork(whole=(out, grad))  # out does not depend on x
    inputs, _ = _upward([x_node], consumers, set())
    work = WeightWork(groups=_groups(x_node, consumers, inputs))
    handles = [
        n.register_prehook(_recorder(group.grads, k))
        for group in work.groups
        for k, n in enumerate(group.intermediates)
    ]
    try:
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    x.grad = dx if x.grad is None else x.grad + dx
    return work  # once the caller drops `out`, the graph lives on through the intermediates only


def _groups(x_node: Node, consumers: dict[Node, list[Node]], inputs: set[Node]) -> list[_Group]:
    """The weights of the graph, grouped by the intermediates their paths enter the input's closure at.

    W runs one autograd pass per group asking for that group's weights only, so a pass never
    walks from one intermediate down the input's path to another (a row-parallel layer's
    reduce-scatter lies between its bias's add and its matmul: it must not run again in W).
    """
    owner: dict[Node, int] = {}  # intermediate -> its group's index in `groups`
    groups: list[tuple[set[Node], list[tuple[Node, torch.Tensor]]]] = []
    for node in consumers:
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: a weight (or x)
        if node is x_node or not isinstance(leaf, torch.Tensor):
            continue
        _, entered = _upward([node], consumers, inputs)
        if not entered:
            continue
        joined = sorted({owner[n] for n in entered if n in owner})
        mids, weights = set(entered), [(node, leaf)]
        for k in joined:  # merge every group this weight shares an intermediate with
            mids |= groups[k][0]
            weights += groups[k][1]
            groups[k] = (set(), [])
        groups.append((mids, weights))
        for n in mids:
            owner[n] = len(groups) - 1
    return [_Group(list(mids), weights) for mids, weights in groups if weights]


def _recorder(grads: dict[int, tuple[torch.Tensor | None, ...]], k: int):  # type: ignore[no-untyped-def]
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        grads[k] = tuple(grad_outputs)

    return record


def backward_weight(work: WeightWork) -> None:
    """W: add the weights' gradients into their `.grad`, from what B recorded; frees the graph."""
    if work.whole is not None:  # like the split one, outside the weights' hooks
        out, grad = work.whole
        work.whole = None
        leaves = [] if out.grad_fn is None else _leaves(out.grad_fn)
        if leaves:
            dws = torch.autograd.grad(out, [w for _, w in leaves], grad, allow_unused=True)
            _accumulate(leaves, dws)
        return
    for group in work.groups:
        _weight_pass(group)
    work.groups = []


def _weight_pass(group: _Group) -> None:
    edges, grads = [], []
    for k, node in enumerate(group.intermediates):
        for n, g in enumerate(group.grads.get(k, ())):
            if g is not None:
                edges.append(GradientEdge(node, n))
                grads.append(g)
    if not edges:
        return
    # an intermediate may feed another of its group: each gets exactly what B recorded there, not
    # that plus what flows down from the first again
    handles = []
    if len(group.intermediates) > 1:
        handles = [
            n.register_prehook(lambda _, saved=group.grads[k]: saved)
            for k, n in enumerate(group.intermediates)
            if k in group.grads
        ]
    try:
        dws = torch.autograd.grad(
            edges, [GradientEdge(acc, 0) for acc, _ in group.weights], grads, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    _accumulate(group.weights, dws)


def _leaves(root: Node) -> list[tuple[Node, torch.Tensor]]:
    """The leaves (weights) of root's graph, with their gradient accumulators."""
    return [
        (node, leaf)
        for node in _consumers(root)
        if isinstance(leaf := getattr(node, "variable", None), torch.Tensor)
    ]


def _accumulate(weights: list[tuple[Node, torch.Tensor]], dws: tuple[torch.Tensor | None, ...]) -> None:
    for (_, w), dw in zip(weights, dws, strict=True):
        if dw is not None:
            w.grad = dw if w.grad is None else w.grad.add_(dw)
