"""Binary trees: the in-order tree, NCCL-style double binary trees, and pipelined reduce/broadcast."""

from __future__ import annotations

from dataclasses import dataclass

from ringtree.schedules.base import Builder

# n tree size; x a position 0..n-1 (in-order); v = x+1 its 1-based label; k pipeline chunks;
# c a chunk; h a node's height (leaves 0); d its depth (root 0).


@dataclass(frozen=True)
class Tree:
    """A rooted tree over ranks: `parent[r]` (-1 at the root) and `children[r]`, ordered."""

    root: int
    parent: dict[int, int]
    children: dict[int, list[int]]

    def interior(self) -> set[int]:
        return {r for r, kids in self.children.items() if kids}

    def leaves(self) -> set[int]:
        return {r for r, kids in self.children.items() if not kids}

    def heights(self) -> dict[int, int]:
        h: dict[int, int] = {}
        for r in reversed(self.preorder()):
            h[r] = 1 + max((h[c] for c in self.children[r]), default=-1)
        return h

    def depths(self) -> dict[int, int]:
        d = {self.root: 0}
        for r in self.preorder():
            for c in self.children[r]:
                d[c] = d[r] + 1
        return d

    def preorder(self) -> list[int]:
        order, stack = [], [self.root]
        while stack:
            r = stack.pop()
            order.append(r)
            stack.extend(reversed(self.children[r]))
        return order


def inorder_parent(x: int, n: int) -> int:
    """Parent position of x in the in-order binary tree over 0..n-1 (-1 for the root).

    Label v = x+1; its lowest set bit b is its height's power. Leaves are the odd labels (even
    positions), so neighbouring positions meet at the lowest level: the tree keeps locality.
    A node whose natural parent v+b falls past n hangs from v-b instead (its missing right child).
    """
    v = x + 1
    b = v & -v
    up = v + b if (v // b) % 4 == 1 else v - b
    if up > n:
        up = v - b
    return up - 1  # -1 when v is the root (the largest power of two <= n)


def inorder_tree(ranks: list[int]) -> Tree:
    """The in-order binary tree with position x held by ranks[x]."""
    n = len(ranks)
    parent: dict[int, int] = {}
    children: dict[int, list[int]] = {r: [] for r in ranks}
    root = ranks[0]
    for x, r in enumerate(ranks):
        up = inorder_parent(x, n)
        if up < 0:
            root = r
            parent[r] = -1
        else:
            parent[r] = ranks[up]
            children[ranks[up]].append(r)
    return Tree(root, parent, children)


def double_trees(p: int) -> tuple[Tree, Tree]:
    """Two complementary trees over p ranks (Sanders, Speck and Träff's two-tree scheme, as in NCCL).

    Tree 1 is the in-order tree over ranks 0..p-1, whose leaves are the even ranks. Tree 2 is its
    mirror for even p (leaves: the odd ranks) and its shift by one for odd p. Either way no rank is
    interior in both trees, so each rank forwards data for at most one of them.
    """
    first = inorder_tree(list(range(p)))
    if p % 2 == 0:
        second = inorder_tree([p - 1 - x for x in range(p)])
    else:
        second = inorder_tree([(x + 1) % p for x in range(p)])
    return first, second


def rooted_tree(p: int, root: int) -> Tree:
    """The in-order tree over p ranks, relabelled so that `root` is its root."""
    top = (1 << (p.bit_length() - 1)) - 1  # the in-order root position
    return inorder_tree([(x - top + root) % p for x in range(p)])


def tree_reduce(b: Builder, tree: Tree, bounds: list[int]) -> int:
    """Pipelined reduction to the root: a node of height h sends chunk c up at step c + h."""
    h = tree.heights()
    k = len(bounds) - 1
    for r, up in tree.parent.items():
        if up >= 0:
            for c in range(k):
                b.transfer(c + h[r], r, up, bounds[c], bounds[c + 1], reduce=True)
    return k + h[tree.root] - 1 if k and h[tree.root] else 0


def tree_broadcast(b: Builder, tree: Tree, bounds: list[int]) -> int:
    """Pipelined broadcast from the root: a node at depth d sends chunk c down at step c + d."""
    d = tree.depths()
    k = len(bounds) - 1
    for r, up in tree.parent.items():
        if up >= 0:
            for c in range(k):
                b.transfer(c + d[up], up, r, bounds[c], bounds[c + 1], reduce=False)
    depth = max(d.values())
    return k + depth - 1 if k and depth else 0


def tree_all_reduce(b: Builder, tree: Tree, bounds: list[int]) -> int:
    """Reduce up and broadcast down, overlapped: chunk c starts down as soon as the root has it.

    The root holds chunk c complete after step c + h(root) - 1, so the broadcast phase starts at
    step h(root): 2 lg(p) + k - 1 steps instead of the 2 (lg(p) + k - 1) of reduce-then-broadcast.
    """
    lead = tree.heights()[tree.root]
    up = tree_reduce(b, tree, bounds)
    b.base += lead
    down = tree_broadcast(b, tree, bounds)
    b.base -= lead
    return max(up, lead + down)
